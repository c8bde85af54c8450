"""torchtitan's ``GroupedExperts`` under MKOR and K-FAC: three stacks of E expert linear layers
whose rows are the bf16 rows its grouped mms multiplied (``torch_impl/kronecker/experts/torchtitan.py``,
``torch_impl/kronecker/experts/README.md``).

The reference is a twin (``theory_tests/support/titan_twin.py``): the same tiny model with a
fixed routing (one expert routed nothing) whose experts are E x 3 ``nn.Linear`` layers
computing the same bf16 products, each seen by the preconditioner as an ordinary layer."""
import pytest
import torch

pytest.importorskip("torchtitan")

from torch_impl import KFAC, MKOR  # noqa: E402
from torch_impl.kronecker.experts.torchtitan import TITAN  # noqa: E402
from torch_impl.kronecker.layers import register_layer_type, unregister_layer_type  # noqa: E402
from theory_tests.support.titan_twin import (  # noqa: E402
    BF16_LINEAR, PARAMS, Routed, as_stacks, grouped_experts, hand_rows, routing, twin_of)

D, F, E, T, K = 16, 8, 4, 6, 2
COUNTS = [3, 0, 5, 4]  # expert 1 is routed nothing


@pytest.fixture(autouse=True)
def _bf16_linear_declared():
    """The twin's BF16Linear experts override forward: declared a linear product here."""
    register_layer_type(BF16_LINEAR)
    yield
    unregister_layer_type(BF16_LINEAR)


def _preconditioner(kind, model):
    # weight decay 0: a twin expert routed nothing has no gradient (AdamW skips it) while its
    # matrix in the stack has a zero one (AdamW would decay it)
    backbone = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    if kind == "MKOR":
        return MKOR(model, backbone, inv_freq=1)
    return KFAC(model, backbone, inv_freq=1, damping=1e-2)


def _train(kind, model, steps=3):
    pre = _preconditioner(kind, model)
    for t in range(steps):
        x = torch.randn(T, D, generator=torch.Generator().manual_seed(t), dtype=torch.float64)
        model(x).square().sum().backward()
        pre.step()
        pre.zero_grad()
    return pre


@pytest.mark.parametrize("kind", ["MKOR", "KFAC"])
def test_grouped_experts_train_as_their_twin(kind):
    """3 steps (float64 parameters, bf16 products, factor update every step, AdamW lr 1e-2):
    the stacks equal the twin's linears to rounding. Measured max |stack - twin| over every
    parameter: MKOR 2.8e-9, K-FAC 1.3e-10, against a largest parameter change of 3e-2 (the
    statistics are float32 sums of the bf16 rows, summed in another order), the linear in
    front 0.0 (bit for bit: the experts' input gradients are the twin's). Each stack is
    preconditioned (the self-check passes for it) and the expert routed nothing counts
    ``no_rows`` on every step, as its twin's layers are absent."""
    torch.manual_seed(0)
    routed = Routed(grouped_experts(D, F, E), routing(T, K, COUNTS), D)
    twin = twin_of(routed)
    start = {p: getattr(routed.experts, p).detach().clone() for p in PARAMS}
    pre = _train(kind, routed)
    _train(kind, twin)
    stacks = {f"experts.{p}" for p in PARAMS}
    assert stacks <= set(pre.preconditioned_modules)
    report = pre.capture_report()
    assert all(report[n]["self_check"]["weight"] == "pass" for n in stacks), report
    twin_stacks = as_stacks(twin)
    change = max((getattr(routed.experts, p) - start[p]).abs().max().item() for p in PARAMS)
    assert change > 1e-2
    for p in PARAMS:
        diff = (getattr(routed.experts, p).detach() - twin_stacks[p]).abs().max().item()
        assert diff <= 1e-6 * change, (p, diff)
    assert torch.equal(routed.proj.weight, twin.proj.weight)
    for name in stacks:
        assert pre.counters()[name]["no_rows"].tolist() == [0, 3, 0, 0]


def test_the_recomputed_rows_are_the_hand_written_forwards():
    """The adapter's rows (x, dL/du1), (x, dL/du3), (h, dL/dout), recomputed from the call's
    inputs and output gradient, against a per-expert forward written with ``torch.matmul``
    and autograd (``retain_grad``): bit for bit (measured max difference 0.0), all bf16, in
    expert order, an expert with 0 rows absent."""
    torch.manual_seed(1)
    module = grouped_experts(D, F, E)
    counts = torch.tensor(COUNTS)
    x = torch.randn(sum(COUNTS), D, dtype=torch.float64)
    grad = torch.randn(sum(COUNTS), D, dtype=torch.float64)
    token, expert, rows = TITAN.rows(module, (x, counts), grad)
    hand = hand_rows(module, x, counts, grad)
    assert token.tolist() == list(range(sum(COUNTS)))
    assert expert.tolist() == [e for e, n in enumerate(COUNTS) for _ in range(n)]
    for (a, g), p in zip(rows, PARAMS):
        assert a.dtype == g.dtype == torch.bfloat16
        assert torch.equal(a, torch.cat([r[0] for r in hand[p]])), p
        assert torch.equal(g, torch.cat([r[1] for r in hand[p]])), p


def test_the_rows_are_the_autograd_rows_of_the_module_itself():
    """The weight gradient autograd gives GroupedExperts is, per expert, the sum of g aᵀ over
    the recomputed rows (in bf16, the dtype the grouped mm's backward forms it in)."""
    torch.manual_seed(2)
    module = grouped_experts(D, F, E)
    counts = torch.tensor(COUNTS)
    x = torch.randn(sum(COUNTS), D, dtype=torch.float64)
    grad = torch.randn(sum(COUNTS), D, dtype=torch.float64)
    module(x, counts).backward(grad)
    _, expert, rows = TITAN.rows(module, (x, counts), grad)
    for (a, g), p in zip(rows, PARAMS):
        want = getattr(module, p).grad
        for e in range(E):
            sel = expert == e
            got = (g[sel].double().T @ a[sel].double())
            assert torch.allclose(got, want[e], rtol=2e-2, atol=1e-2 * want.abs().max()), (p, e)


def test_under_bf16_autocast_the_stacks_pass_the_self_check():
    """A float32 model, one step outside and one inside CPU bf16 autocast, the self-check on
    every capture: each stack's weight gradient is the sum of g aᵀ over its recomputed rows
    (the rows recomputed under the forward's autocast), so no stack is released."""
    torch.manual_seed(0)
    model = Routed(grouped_experts(D, F, E, dtype=torch.float32), routing(T, K, COUNTS), D,
                   dtype=torch.float32)
    pre = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1), inv_freq=1, self_check=True)
    for amp in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = model(torch.randn(T, D))
        out.float().square().sum().backward()
        pre.step()
        pre.zero_grad()
        report = pre.capture_report()
        for p in PARAMS:
            assert report[f"experts.{p}"]["self_check"]["weight"] == "pass", (amp, p)
    assert not pre.skip_reasons
