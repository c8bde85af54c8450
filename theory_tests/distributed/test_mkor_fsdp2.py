"""MKOR and K-FAC on FSDP2 (``fully_shard``) models on 2 and 3 gloo CPU ranks (4: slow), against
one process on the whole batch (issue 23; ``torch_impl/kronecker/placement.py``).

Each rank runs an equal slice of the global batch through a ``fully_shard``ed model: the
hooks see the unsharded layers, MKOR all-reduces (a_bar, g_bar) as under DDP, and every
weight and bias gradient is a ``Shard(0)`` DTensor that the preconditioner gathers whole,
preconditions with its replicated factors and writes back to the rank's rows (or, with
``factor_placement="owner"``, gathers to the layer's owner, which preconditions and scatters
the rows back). HSDP's ``(Replicate(), Shard(0))`` is held to the same equality. The model is
awkward on purpose: a layer of 7 rows (divides by none of 2, 3, 4), one of 2 rows (smaller
than 3 and 4 ranks: empty shards), a bias-free layer, a frozen layer (``requires_grad``
False: it is left to the backbone), and mixed ``fully_shard`` granularity (two layers on
their own, the rest under the root). float64; 1e-12 relative covers the different
summation order of the sharded reductions. A control preconditions each rank's *local*
shard as if it were the whole gradient (what a port without the gather computes) and
differs: the comparison can fail. Distributed checkpoints of these runs:
``test_mkor_fsdp2_checkpoints.py``.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as Fn

from torch_impl.baselines import KFAC
from torch_impl.mkor import MKOR

from theory_tests.support.distributed_harness import run

STEPS = 4
VARIANTS = {
    "paper": dict(kind="mkor", variant="paper", inv_freq=1, factor_dtype="float64",
                  stat_decay=0.8),
    # "double" averaging (the released code's) divides by the world size twice by design
    "released": dict(kind="mkor", variant="released", inv_freq=1, factor_dtype="float64",
                     threshold=0.99, average="once"),
    "paper_switch": dict(kind="mkor", variant="paper", inv_freq=2, factor_dtype="float64",
                         switch_step=2),  # MKOR-H hands over on the same step everywhere
    "kfac": dict(kind="kfac", inv_freq=2, damping=1e-2),
    # each sharded layer's factors on one rank: the owner gathers, preconditions, scatters
    "paper_owner": dict(kind="mkor", variant="paper", inv_freq=1, factor_dtype="float64",
                        stat_decay=0.8, factor_placement="owner"),
    "kfac_owner": dict(kind="kfac", inv_freq=2, damping=1e-2, factor_placement="owner"),
    # switched before the checkpoint is written (SAVE_AT): the hand-over must survive DCP
    "paper_switched": dict(kind="mkor", variant="paper", inv_freq=1, factor_dtype="float64",
                           switch_step=1),
    # MKOR-H's loss-rate rule, every check slow. Checking every step with patience 2, the
    # checkpoint at step 2 holds the rule mid-way (one slow check: the second, at step 2,
    # switches); checking every 3 steps with patience 1, it holds two buffered losses (the
    # first check reads the losses of steps 0-2 at step 2 and switches). Losing either
    # moves the switch.
    "paper_rate": dict(kind="mkor", variant="paper", inv_freq=1, factor_dtype="float64",
                       hybrid_switch="loss_rate", switch_window=1, switch_check_every=1,
                       switch_threshold=1e9, switch_patience=2),
    "paper_rate_buffered": dict(kind="mkor", variant="paper", inv_freq=1,
                                factor_dtype="float64", hybrid_switch="loss_rate",
                                switch_window=1, switch_check_every=3, switch_threshold=1e9,
                                switch_patience=1),
}


def _model(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2), nn.Tanh(),
                          nn.Linear(2, 3, bias=False), nn.Tanh(), nn.Linear(3, 4), nn.Tanh(),
                          nn.Linear(4, 3)).double()
    model[6].requires_grad_(False)  # frozen: not preconditioned, not stepped
    return model


def _batch(t):
    g = torch.Generator().manual_seed(t)
    return (torch.randn(12, 5, generator=g, dtype=torch.float64),
            torch.randn(12, 3, generator=g, dtype=torch.float64))


def _preconditioner(model, opt, options):
    options = dict(options)
    kind = options.pop("kind")
    return (MKOR if kind == "mkor" else KFAC)(model, opt, **options)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _build(model, options):
    """SGD with momentum on the trainable parameters, under the preconditioner ``options``."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05,
                          momentum=0.9)
    return opt, _preconditioner(model, opt, options)


def _run(model, pre, opt, steps, rank=None, world=1):
    """The steps ``steps`` of the global batches, on this rank's slice (``rank`` None: all)."""
    for t in steps:
        x, y = _batch(t)
        if rank is not None:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        _backward(pre, Fn.mse_loss(model(x), y))
        pre.step()
        opt.zero_grad()


def _train(model, options, rank=None, world=1):
    opt, pre = _build(model, options)
    _run(model, pre, opt, range(STEPS), rank, world)
    out = {"params": [_full(p.detach()).clone() for p in model.parameters()],
           "factors": _factors(pre)}
    # every matrix the preconditioner keeps: MKOR's inverses, K-FAC's EMAs and eigenbases
    out["factor_bytes"] = sum(t.nbytes for s in pre.preconditioner_state_dict()["layers"].values()
                              for v in s.values() for t in (v if isinstance(v, tuple) else [v])
                              if isinstance(t, torch.Tensor) and t.ndim > 0)
    if isinstance(pre, MKOR):
        out["switched"] = pre.switched
    return out


def _backward(pre, loss):
    """The backward pass, and the loss fed to MKOR-H's loss-rate rule when it has one."""
    loss.backward()
    if isinstance(pre, MKOR) and pre.options.hybrid_switch == "loss_rate":
        pre.observe_loss(loss.detach())


def _factors(pre):
    """{layer: (left, right)}: MKOR's (L_inv, R_inv), K-FAC's EMAs (G, A); None where the
    rank keeps no such factor (an identity side, or a layer another rank owns)."""
    if isinstance(pre, MKOR):
        pairs = pre.inverse_factors()
    else:
        pairs = {n: (s.get("G"), s.get("A"))
                 for n, s in pre.preconditioner_state_dict()["layers"].items()}
    return {k: tuple(None if f is None else f.clone() for f in v) for k, v in pairs.items()}


def _shard(model, mixed=True):
    from torch.distributed.fsdp import fully_shard
    if mixed:
        fully_shard(model[0])
        fully_shard(model[2])
    fully_shard(model)
    return model


def _job(rank, world, names):
    return {name: _train(_shard(_model()), VARIANTS[name], rank, world) for name in names}


def _single(name):
    return _train(_model(), VARIANTS[name])


def _assert_close(result, reference, what):
    for a, b in zip(result["params"], reference["params"]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=what)
    for layer, pair in reference.get("factors", {}).items():
        for a, b in zip(result["factors"][layer], pair):
            if b is not None and a is not None:  # None: a factor another rank owns
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=f"{what} {layer}")


@pytest.fixture(scope="module", params=[2, 3])
def ranks(request):
    return request.param, run(_job, request.param, tuple(VARIANTS))


@pytest.mark.parametrize("name", tuple(VARIANTS))
def test_fsdp2_ranks_equal_one_process_on_the_whole_batch(ranks, name):
    world, results = ranks
    reference = _single(name)
    for rank, result in enumerate(results):
        _assert_close(result[name], reference, f"{name}, rank {rank} of {world}")
    if "switched" in reference:
        assert all(r[name]["switched"] == reference["switched"] for r in results)
    if name in ("paper_switch", "paper_rate", "paper_rate_buffered"):
        assert reference["switched"]
    if name.endswith("_owner"):  # every factor on exactly one rank; memory divided among them
        for layer, pair in reference["factors"].items():
            for side, b in enumerate(pair):
                held = [r[name]["factors"][layer][side] is not None for r in results]
                assert sum(held) == (b is not None), (layer, side, held)
        per_rank = [r[name]["factor_bytes"] for r in results]
        assert sum(per_rank) == reference["factor_bytes"]
        assert max(per_rank) < reference["factor_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("name", tuple(VARIANTS))
def test_fsdp2_on_four_ranks(name):
    reference = _single(name)
    for rank, result in enumerate(run(_job, 4, (name,))):
        _assert_close(result[name], reference, f"{name}, rank {rank} of 4")


def _hsdp_job(rank, world, names, shapes):
    """HSDP: ``fully_shard`` on a (replicate, shard) mesh of each shape, so parameters are
    ``(Replicate(), Shard(0))`` DTensors; each rank still trains its own slice. Also returns
    the refusal of owner-placed factors on such a mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    out = {}
    for shape in shapes:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))

        def sharded():
            model = _model()
            for i in (0, 2):
                fully_shard(model[i], mesh=mesh)
            fully_shard(model, mesh=mesh)
            assert model[0].weight.placements[0].is_replicate(), model[0].weight.placements
            return model

        for name in names:
            out[shape, name] = _train(sharded(), VARIANTS[name], rank, world)
        refusals = []
        for options in (VARIANTS["paper_owner"], VARIANTS["kfac_owner"]):
            model = sharded()
            opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
            try:
                _preconditioner(model, opt, options)
            except ValueError as error:
                refusals.append(str(error))
        out[shape, "refusals"] = refusals
    return out


def _check_hsdp(world, shapes):
    names = ("paper", "released", "kfac")
    for rank, result in enumerate(run(_hsdp_job, world, names, shapes)):
        for shape in shapes:
            for name in names:
                _assert_close(result[shape, name], _single(name),
                              f"HSDP {shape} {name}, rank {rank} of {world}")
            refusals = result[shape, "refusals"]
            assert len(refusals) == 2 and all(
                "factor_placement='owner' needs every sharded layer on one 1-D mesh" in m
                for m in refusals), refusals


def test_hsdp_equals_one_process():
    """The HSDP placement the module accepts, (Replicate(), Shard(0)) on a 2-D mesh, with
    replicated factors: 2 ranks as 1 replica x 2 shards and as 2 replicas x 1 shard equal
    one process on the whole batch (1e-12); owner-placed factors are refused there."""
    _check_hsdp(2, ((1, 2), (2, 1)))


@pytest.mark.slow
def test_hsdp_on_four_ranks_equals_one_process():
    """The same on 4 ranks, 2 replicas x 2 shards."""
    _check_hsdp(4, ((2, 2),))


def _float32_train(model, rank=None, world=1):
    """A float32 model preconditioned in float64 (factor_dtype): the gradient is cast, so
    the preconditioned matrix is copied back into it (not written in place)."""
    model = model.float()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    mkor = MKOR(model, opt, inv_freq=1, factor_dtype="float64", stat_decay=0.8)
    for t in range(STEPS):
        x, y = (v.float() for v in _batch(t))
        if rank is not None:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        Fn.mse_loss(model(x), y).backward()
        mkor.step()
        opt.zero_grad()
    return [_full(p.detach()).clone() for p in model.parameters()]


def _float32_job(rank, world):
    return _float32_train(_shard(_model()), rank, world)


def test_fsdp2_gradient_cast_to_the_compute_dtype():
    """float32 gradients, float64 preconditioning: equal to one process up to float32's
    summation-order error (~1e-7); the raw gradient would differ by O(1)."""
    reference = _float32_train(_model())
    for rank, result in enumerate(run(_float32_job, 2)):
        for a, b in zip(result, reference):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"rank {rank}")


def _root_only_job(rank, world):
    return _train(_shard(_model(), mixed=False), VARIANTS["paper"], rank, world)


def test_fsdp2_root_only_granularity():
    reference = _single("paper")
    for rank, result in enumerate(run(_root_only_job, 2)):
        _assert_close(result, reference, f"root-only, rank {rank}")


def _local_rows_job(rank, world):
    """The control: each rank preconditions only its own rows (no gather)."""
    import torch_impl.mkor.layer_state as ls

    class LocalRows:  # the gradients as this rank holds them, never gathered
        def __init__(self, module):
            b = module.bias
            self.weight = module.weight.grad.to_local()
            self.bias = None if b is None or b.grad is None else b.grad.to_local()
            self.sharded = True

        def matrix(self, layer):
            return layer.type.as_matrix(layer.module, self.weight)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    ls.gradients_of = lambda layer, owner=None: LocalRows(layer.module)
    model = _shard(_model(), mixed=False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05,
                          momentum=0.9)
    # the local rows do not fit the factors' rows: shapes fail, or the result differs
    mkor = MKOR(model, opt, **{k: v for k, v in VARIANTS["paper"].items() if k != "kind"})
    try:
        for t in range(2):
            x, y = _batch(t)
            Fn.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
            mkor.step()
            opt.zero_grad()
    except RuntimeError as error:
        return f"error: {error}"
    return [_full(p.detach()).clone() for p in model.parameters()]


def test_the_control_without_the_gather_is_wrong():
    """Preconditioning the local rows alone cannot reproduce the single-process run: it
    fails on the shapes (the rows are not the factor's), so the equality above is not a
    property of any per-rank computation."""
    out = run(_local_rows_job, 2)
    assert all(isinstance(o, str) and o.startswith("error") for o in out), out


def test_owners_are_balanced_and_deterministic():
    """Greedy longest-first: the costliest layer to the least-loaded rank, ties to the lower
    rank and, among equal costs, in layer order."""
    from torch_impl.kronecker.placement import assign_owners
    costs = {"a": 49 + 25, "b": 4 + 49, "c": 9 + 4, "d": 16 + 9, "e": 9 + 16}
    assert assign_owners(costs, 2) == {"a": 0, "b": 1, "d": 1, "e": 0, "c": 1}
    assert assign_owners(costs, 3) == {"a": 0, "b": 1, "d": 2, "e": 2, "c": 2}
    assert assign_owners(costs, 1) == dict.fromkeys(costs, 0)
    assert assign_owners({"x": 1}, 4) == {"x": 0}  # ranks owning nothing are fine


# -- unsupported sharding is refused, naming the parameter ------------------------------------

def _unsupported_job(rank, world, how):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    model = _model()
    if how == "shard_dim_1":  # fully_shard told to shard the columns (FSDP2 allows even ones)
        fully_shard(model, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 and
                    p.shape[1] % world == 0 else None)
    else:  # a DTensor no fully_shard placed (tensor-parallel style: row-sharded by hand)
        mesh = init_device_mesh("cpu", (world,))
        model[2].weight = nn.Parameter(distribute_tensor(model[2].weight.data, mesh, [Shard(0)]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    messages = []
    for cls in (MKOR, KFAC):
        try:
            cls(model, opt)
        except ValueError as error:
            messages.append(str(error))
    return messages


@pytest.mark.parametrize("how", ["shard_dim_1", "tensor_parallel_style"])
def test_unsupported_sharding_is_refused_by_name(how):
    for messages in run(_unsupported_job, 2, how):
        assert len(messages) == 2, messages
        for message in messages:
            assert "weight is a DTensor with placements" in message, message
            assert "supported:" in message and "fully_shard" in message
        if how == "tensor_parallel_style":
            assert all("2.weight" in m and "no fully_shard placed" in m for m in messages)
        else:  # Linear(2, 3): the first weight with an even column count
            assert all("4.weight" in m and "(Shard(dim=1),)" in m for m in messages)
