"""Fused experts under DDP and FSDP2 (issue 31): the per-expert row counts travel with the
sums, so an expert routed no token on one rank adds zeros, and every rank's factors and
parameters equal one process that runs every rank's batch with the loss averaged over the
ranks (what DDP's gradient averaging computes).

Each column's cases run in one job (DDP: both kinds; FSDP2: both kinds, both placements), and
each kind's one-process run once: a forked rank pays for its first DDP / FSDP calls once. The
tests, one per case, read those runs."""
import pytest
import torch
import torch.nn as nn

from theory_tests.support.distributed_harness import run

transformers = pytest.importorskip("transformers")

f64 = torch.float64
EXPERTS = "model.layers.0.mlp.experts"
STEPS, WORLD = 3, 2
KINDS = ("mkor", "kfac")
PLACEMENTS = ("replicated", "owner")


def _model():
    config = transformers.MixtralConfig(
        hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=64,
        max_position_embeddings=16)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).to(f64)


def _batch(t, rank):
    g = torch.Generator().manual_seed(100 * t + rank)
    return torch.randint(0, 64, (1, 3), generator=g)  # 6 routed pairs: experts go unused


def _optimizer(kind, model):
    from torch_impl import KFAC, MKOR
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    if kind == "mkor":
        return MKOR(model, sgd, inv_freq=1, factor_dtype=f64)
    return KFAC(model, sgd, inv_freq=1, factor_freq=1)


def _factors(pre):
    return {name: [t.clone() for t in pair if t is not None]
            for name, pair in (pre.inverse_factors() if hasattr(pre, "inverse_factors")
                               else pre.factors()).items()}


def _routed(model, ids):
    """Per expert, how many pairs of this batch are routed to it."""
    seen = {}

    def keep(module, args):
        seen["index"] = args[1].clone()
    handle = model.model.layers[0].mlp.experts.register_forward_pre_hook(keep)
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    return torch.bincount(seen["index"].reshape(-1), minlength=8)


def _ddp_job(rank, world, kinds, steps):
    return {kind: _on_ranks(rank, world, kind, steps) for kind in kinds}


def _on_ranks(rank, world, kind, steps):
    model = nn.parallel.DistributedDataParallel(_model())
    pre = _optimizer(kind, model)
    for t in range(steps):
        ids = _batch(t, rank)
        model(input_ids=ids, labels=ids).loss.backward()
        pre.step()
        pre.zero_grad()
    return {"factors": _factors(pre), "params": {n: p.detach().clone() for n, p in
                                                 model.module.named_parameters()},
            "counters": {k: v.clone() for k, v in pre.counters()[EXPERTS + ".down_proj"].items()}}


def _one_process(kind, steps, world):
    model = _model()
    pre = _optimizer(kind, model)
    for t in range(steps):
        loss = sum(model(input_ids=_batch(t, r), labels=_batch(t, r)).loss
                   for r in range(world)) / world
        loss.backward()
        pre.step()
        pre.zero_grad()
    return _factors(pre), {n: p.detach() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def one_process():
    """{kind: each kind's one-process run (factors, parameters)}."""
    return {kind: _one_process(kind, STEPS, WORLD) for kind in KINDS}


@pytest.fixture(scope="module")
def ddp_runs():
    """Every rank's {kind: its DDP run}."""
    return run(_ddp_job, WORLD, KINDS, STEPS, timeout=120.0)


@pytest.mark.parametrize("kind", KINDS)
def test_ddp_experts_equal_one_process_on_the_union(kind, one_process, ddp_runs):
    routed = [_routed(_model(), _batch(0, r)) for r in range(WORLD)]
    # the premise: some expert gets pairs on one rank and none on the other
    assert any((routed[0] == 0) & (routed[1] > 0)) or any((routed[1] == 0) & (routed[0] > 0))
    factors, params = one_process[kind]
    for res in (r[kind] for r in ddp_runs):
        for name, ref in factors.items():
            for a, b in zip(res["factors"][name], ref):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
        for name, p in params.items():
            torch.testing.assert_close(res["params"][name], p, rtol=1e-12, atol=1e-13, msg=name)
        assert res["counters"]["non_finite"].sum() == 0


def _fsdp_job(rank, world, cases, steps):
    return {case: _fsdp_on_ranks(rank, world, *case, steps) for case in cases}


def _fsdp_on_ranks(rank, world, kind, placement, steps):
    from torch.distributed.fsdp import fully_shard
    model = _model()
    fully_shard(model.model.layers[0])  # the experts' stacks: Shard(0) on the expert axis
    fully_shard(model)
    pre = _optimizer(kind, model) if placement == "replicated" else None
    if pre is None:
        from torch_impl import KFAC, MKOR
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        pre = (MKOR(model, sgd, inv_freq=1, factor_dtype=f64, factor_placement="owner")
               if kind == "mkor" else
               KFAC(model, sgd, inv_freq=1, factor_freq=1, factor_placement="owner"))
    from torch.distributed.tensor import DTensor

    from theory_tests.support.collectives import CountCollectives
    moved = []
    for t in range(steps):
        ids = _batch(t, rank)
        model(input_ids=ids, labels=ids).loss.backward()
        with CountCollectives() as calls:
            pre.step()
        moved += [shape for _, shapes in calls.shapes for shape in shapes]
        pre.zero_grad()
    stacks = {}
    if placement == "owner":  # per expert: the experts of this rank's shard, saved as DTensors
        entries = pre.state_dict()["state"]
        index = {id(p): i for i, p in enumerate(q for g in pre.param_groups for q in g["params"])}
        for layer in pre._layers:
            if layer.experts is None:
                continue
            held = layer.module.weight.to_local().shape[0]
            saved = entries[index[id(layer.module.weight)]][pre._state_key]
            leaves = [(k, v) for k, value in saved.items() for v in (
                value if isinstance(value, (tuple, list)) else (value,)) if torch.is_tensor(v)]
            span = None if layer.expert_shard is None else layer.expert_shard.held
            stacks[layer.name] = (held, layer.kept, span,
                                  [(k, type(v).__name__, tuple(v.shape),
                                    tuple(v.to_local().shape) if isinstance(v, DTensor)
                                    else None) for k, v in leaves])
    return {"params": {n: p.full_tensor().detach().clone() for n, p in
                       model.named_parameters()},
            "moved": moved, "stacks": stacks}


@pytest.fixture(scope="module")
def fsdp_runs():
    """Every rank's {(kind, placement): its FSDP2 run: full parameters, the shapes its steps'
    collectives moved, its stacks' held experts and checkpoint entries (owner placement)}."""
    cases = tuple((kind, placement) for kind in KINDS for placement in PLACEMENTS)
    return run(_fsdp_job, WORLD, cases, STEPS, timeout=120.0)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("kind", KINDS)
def test_fsdp2_experts_equal_one_process_on_the_union(kind, placement, one_process, fsdp_runs):
    """fully_shard shards each stack on its expert axis; the stack's gradient is gathered
    whole, preconditioned per expert and written back to each rank's experts."""
    _, params = one_process[kind]
    for got in (r[kind, placement]["params"] for r in fsdp_runs):
        for name, p in params.items():
            torch.testing.assert_close(got[name], p, rtol=1e-12, atol=1e-13, msg=name)


@pytest.mark.parametrize("kind", KINDS)
def test_fsdp2_owner_placement_is_per_expert(kind, fsdp_runs):
    """``factor_placement="owner"`` under FSDP2 (issue 48 item 3): each rank keeps the factors
    of the experts its ``Shard(0)`` slice holds (4 of 8 here), its checkpoint entries are
    ``Shard(0)`` DTensors of all 8 experts (DCP saves every rank's), and no collective of
    ``step()`` moves a 3-D tensor: a stack's gradient is never gathered (the dense layers' 2-D
    gradients go to their owners as before)."""
    held = set()
    for r in fsdp_runs:
        got = r[kind, "owner"]
        assert len(got["stacks"]) == 2
        for name, (local, kept, span, saved) in got["stacks"].items():
            assert span is not None, f"{name}: not owned per expert"
            assert local == kept == 4 and span[1] - span[0] == 4
            held.add((name, span))
            assert saved
            for key, kind_of, shape, local_shape in saved:
                assert kind_of == "DTensor" and shape[0] == 8 and local_shape[0] == 4, key
        assert not [s for s in got["moved"] if len(s) == 3], got["moved"]
        assert [s for s in r[kind, "replicated"]["moved"] if len(s) == 3]  # the control
    assert len(held) == 4  # two stacks, each split over the two ranks
