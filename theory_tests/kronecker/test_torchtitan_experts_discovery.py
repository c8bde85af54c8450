"""Which torchtitan experts modules MKOR and K-FAC take as stacks, and what they refuse
(``torch_impl/kronecker/experts/torchtitan.py``): recognised from structure (class, parameters,
methods), never from a coincidence of names or shapes; an EP dispatcher beside stacks not laid
out as torchtitan's EP refused (EP itself: ``theory_tests/distributed/test_kronecker_ep.py``)."""
import pytest
import torch
import torch.nn as nn

pytest.importorskip("torchtitan")

from torchtitan.models.common.moe import GroupedExperts  # noqa: E402

from torch_impl import KFAC, MKOR  # noqa: E402
from torch_impl.kronecker.capture.guards import CaptureError  # noqa: E402
from theory_tests.support.distributed_harness import run  # noqa: E402
from theory_tests.support.titan_twin import PARAMS, Routed, grouped_experts, routing  # noqa: E402
from theory_tests.support.torchtitan_cases import moe_model  # noqa: E402

D, F, E, T, K = 8, 8, 4, 4, 2
COUNTS = [2, 2, 0, 4]


def _routed(cls=None):
    torch.manual_seed(0)
    return Routed(grouped_experts(D, F, E, cls=cls), routing(T, K, COUNTS), D)


def _mkor(model):
    return MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1), inv_freq=1)


class Quantised(GroupedExperts):
    """What torchtitan's MXFP8 converter makes: a subclass with its own grouped mm."""

    def _grouped_mm(self, *, A, B_t, offs):
        return super()._grouped_mm(A=A, B_t=B_t, offs=offs)


class Rewritten(GroupedExperts):
    def forward(self, x_RD, num_tokens_per_expert_E):
        return super().forward(x_RD, num_tokens_per_expert_E)


class Lookalike(nn.Module):
    """Named GroupedExperts, with its parameters, but not torchtitan's class."""

    def __init__(self):
        super().__init__()
        self.num_experts = E
        self.w1_EFD = nn.Parameter(torch.zeros(E, F, D))
        self.w2_EDF = nn.Parameter(torch.zeros(E, D, F))
        self.w3_EFD = nn.Parameter(torch.zeros(E, F, D))

    def forward(self, x, counts):
        return x


Lookalike.__name__ = Lookalike.__qualname__ = "GroupedExperts"


@pytest.mark.parametrize("cls", [MKOR, KFAC])
def test_found_as_three_stacks_named_after_their_parameters(cls):
    model = _routed()
    pre = cls(model, torch.optim.SGD(model.parameters(), lr=0.1))
    stacks = [l for l in pre._layers if l.experts is not None]
    assert [l.name for l in stacks] == [f"experts.{p}" for p in PARAMS]
    assert [(l.experts, l.d_out, l.d_in) for l in stacks] == [(E, F, D), (E, F, D), (E, D, F)]
    assert "experts" not in pre.skip_reasons


def test_in_a_qwen3_moe_model_the_router_gate_and_the_stacks_are_layers():
    """torchtitan's router holds its gate as a Linear module (its output gradient, dL/dlogits
    through the softmax and top-k, is observable): an ordinary layer beside the stacks."""
    model = moe_model(layers=1)
    pre = _mkor(model)
    prefix = "layers.0.moe."
    assert {prefix + "router.gate"} | {f"{prefix}routed_experts.inner_experts.{p}"
                                       for p in PARAMS} <= set(pre.preconditioned_modules)


@pytest.mark.parametrize("cls, method", [(Quantised, "_grouped_mm"), (Rewritten, "forward")])
def test_a_subclass_with_its_own_products_is_skipped_with_its_reason(cls, method):
    pre = _mkor(_routed(cls))
    assert f"overrides GroupedExperts.{method}" in pre.skip_reasons["experts"]
    assert not [l for l in pre._layers if l.experts is not None]


def test_an_instance_patched_grouped_mm_is_skipped():
    model = _routed()
    model.experts._grouped_mm = lambda *, A, B_t, offs: torch._grouped_mm(A, B_t, offs=offs)
    assert "overrides GroupedExperts._grouped_mm" in _mkor(model).skip_reasons["experts"]


@pytest.mark.parametrize("edit, words", [
    (lambda m: setattr(m, "w3_EFD", nn.Parameter(torch.zeros(E, F + 1, D))), "expected w1, w3"),
    (lambda m: setattr(m, "w2_EDF", nn.Parameter(torch.zeros(E, D, F + 1))), "expected w1, w3"),
    (lambda m: setattr(m, "w1_EFD", nn.Parameter(torch.zeros(E + 1, F, D))), "num_experts=4"),
    (lambda m: setattr(m, "w1_EFD", nn.Parameter(torch.zeros(F, D))), "num_experts=4"),
    (lambda m: setattr(m, "bias", nn.Parameter(torch.zeros(D))), "not GroupedExperts'"),
])
def test_a_parameter_out_of_the_declared_layout_is_skipped(edit, words):
    model = _routed()
    edit(model.experts)
    reason = _mkor(model).skip_reasons["experts"]
    assert words in reason, reason


def test_a_lookalike_class_is_not_taken_for_grouped_experts():
    model = nn.Sequential(Lookalike())
    reason = _mkor(model).skip_reasons["0"]
    assert "not a registered layer type" in reason


def test_an_ep_token_dispatcher_is_refused_at_construction():
    """torchtitan's "standard" all-to-all dispatcher falls back to the local dispatch while no
    EP mesh is wired (accepted); once a mesh is wired it is expert parallelism, which needs the
    stacks laid out as torchtitan's EP lays them out (``test_kronecker_ep.py``): a wired mesh
    beside plain stacks (or a mesh that is no DeviceMesh) is refused, naming it."""
    model = moe_model(layers=1)
    dispatcher = model.layers["0"].moe.routed_experts.token_dispatcher
    assert type(dispatcher).__name__ == "AllToAllTokenDispatcher" and dispatcher.ep_mesh is None
    name = "layers.0.moe.routed_experts.inner_experts"
    assert name not in _mkor(model).skip_reasons
    dispatcher.ep_mesh = object()  # what RoutedExperts.parallelize wires under EP
    assert "expert parallelism" in _mkor(model).skip_reasons[name]



def test_the_padding_dispatcher_with_an_ep_mesh_is_refused():
    """torchtitan's TorchAOTokenDispatcher (an all-to-all dispatcher padding each expert's
    group for quantized grouped mms) falls back to the local dispatch while no EP mesh is
    wired (accepted); with one wired it is expert parallelism along a path the capture does
    not follow (its padded groups): refused, naming expert parallelism."""
    from torchtitan.models.common.token_dispatcher import TorchAOTokenDispatcher
    model = moe_model(layers=1)
    routed = model.layers["0"].moe.routed_experts
    routed.token_dispatcher = TorchAOTokenDispatcher(TorchAOTokenDispatcher.Config(
        num_experts=4, top_k=2, pad_multiple=16))
    name = "layers.0.moe.routed_experts.inner_experts"
    assert name not in _mkor(model).skip_reasons
    routed.token_dispatcher.ep_mesh = object()
    assert "expert parallelism" in _mkor(model).skip_reasons[name]

def _dtensor_experts(rank, world):
    """Parameters that are DTensors when the module runs (GroupedExperts' to_local path, what
    EP's parallelisation leaves): the capture refuses, naming expert parallelism."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    model = _routed()
    pre = _mkor(model)  # held: a collected preconditioner's hooks capture nothing
    mesh = init_device_mesh("cpu", (world,))
    for p in PARAMS:
        setattr(model.experts, p, nn.Parameter(distribute_tensor(
            getattr(model.experts, p).detach(), mesh, [Shard(0)])))
    try:
        model(torch.randn(T, D, dtype=torch.float64)).sum().backward()
    except CaptureError as exc:
        return str(exc)
    return repr(pre)


def test_expert_parallel_parameters_are_refused_at_capture():
    message, = run(_dtensor_experts, 1)
    assert message is not None and "expert parallelism" in message, message
