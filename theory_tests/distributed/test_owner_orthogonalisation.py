"""Owner-rank orthogonalisation under FSDP2 (``fully_shard``) on gloo CPU ranks (issue 23.4).

``orthogonalize_on="owner"`` (``common.sharding.orthogonalize_on_owners``) runs each
Newton-Schulz / SVD of a step once, on the rank that owns the whole matrix (greedy LPT on
the Newton-Schulz flops), with one ``all_to_all`` to bring the shards to the owners and one
to bring the results back; ``"every_rank"`` all-gathers each matrix and runs every
orthogonalisation on every rank. Checked here:

- both modes equal the unsharded optimizer (float64, 1e-12) for MARS-Shampoo (Newton-Schulz
  and SVD, loop and foreach) and MARS-M (and its efficient form), on 2 and 3 ranks (4:
  ``-m slow``), with uneven shards (7 rows on 2, 3, 4 ranks), empty shards (2 rows on 3 and
  4 ranks), tall and wide matrices, and a rank that owns nothing (3 matrices on 4 ranks);
- owner mode really ran: every matrix orthogonalised once per step, on one rank, with two
  collectives per step, where every-rank mode runs each on every rank;
- the exchange itself on hand-made DTensors (column shards, 1-row matrices, an empty
  matrix, a result in another dtype, a single matrix so that other ranks own nothing),
  against the function of the full matrix;
- the LPT map (:func:`sharding.assign_owners`): deterministic, ties by parameter order,
  within Graham's 4/3 bound of the brute-force optimum; :func:`sharding.ns_flops` counts what
  ``newton_schulz`` multiplies (``FlopCounterMode``);
- the measurement helper: what :func:`recording.record_orthogonalisation` (the benchmarks'
  recorder, ``figures/bench/recording.py``) counts equals
  :func:`sharding.exchange_bytes`'s prediction from the shapes, in both modes.
"""
import collections
import functools
import itertools
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as Fn

import torch_impl.mars.functional as functional
from torch_impl import MARS, MARSM
from torch_impl.common import sharding
from torch_impl.common.matrix_functions import newton_schulz

from figures.bench.recording import record_orthogonalisation
from theory_tests.support.distributed_harness import run

STEPS = 3
SHAPES = [(7, 5), (3, 7), (2, 3)]  # the model's weights: tall, wide, fewer rows than ranks
F64 = torch.float64
CASES = {  # name -> (class, options); every case runs in owner mode, some in both
    "shampoo-ns": (MARS, dict(mars_type="mars-shampoo", clip_scope="tensor")),
    "shampoo-ns-foreach-global": (MARS, dict(mars_type="mars-shampoo", clip_scope="global",
                                             foreach=True)),
    "shampoo-svd": (MARS, dict(mars_type="mars-shampoo", orthogonalizer="svd")),
    "mars-m": (MARSM, dict(gamma=0.3)),
    "mars-m-efficient-foreach": (MARSM, dict(gamma=0.3, efficient=True, clip_c=False,
                                             foreach=True)),
    # Newton-Schulz's result in another dtype than the parameter's (the exchange sends it
    # back as float32): equal to the unsharded run up to float32 rounding
    "mars-m-float32-ns": (MARSM, dict(gamma=0.3, ns_dtype=torch.float32)),
    # issue 32's options through the owner exchange ((3, 7) takes the Gram form)
    "shampoo-gram-polar-express": (MARS, dict(mars_type="mars-shampoo",
                                              orthogonalizer="gram_newton_schulz",
                                              ns_coefficients="polar_express")),
    "mars-m-gram-polar-express": (MARSM, dict(gamma=0.3, orthogonalizer="gram_newton_schulz",
                                              ns_coefficients="polar_express")),
}
TOLERANCE = collections.defaultdict(lambda: 1e-12, {"mars-m-float32-ns": 1e-5})
BOTH_MODES = ("shampoo-ns", "mars-m")
RUNS = [(c, "owner") for c in CASES] + [(c, "every_rank") for c in BOTH_MODES]


def _options(name):
    cls, options = CASES[name]
    return cls, {"lr": 1e-2, "weight_decay": 0.1, "ns_dtype": F64, **options}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Tanh(),
                         nn.Linear(3, 2)).double()


def _batch(t):
    """12 rows (split evenly on 2, 3, 4 ranks); large targets keep the clip active."""
    g = torch.Generator().manual_seed(t)
    return (3 * torch.randn(12, 5, generator=g, dtype=F64),
            30 * torch.randn(12, 2, generator=g, dtype=F64))


def _train(model, opt, rank=None, world=1):
    for t in range(STEPS):
        x, y = _batch(t)
        if rank is not None:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        opt.zero_grad()
        Fn.mse_loss(model(x), y).backward()
        opt.step()


@functools.lru_cache(maxsize=None)
def _reference(name):
    cls, options = _options(name)
    model = _model()
    _train(model, cls(model.parameters(), **options))
    return [p.detach() for p in model.parameters()]


def _optimizer(cls, params, mode, options):
    """``cls(params, orthogonalize_on=mode, ...)``: the keyword from the constructor."""
    return cls(params, orthogonalize_on=mode, **options)


def _sharded_model(mesh):
    from torch.distributed.fsdp import fully_shard
    model = _model()
    for layer in model[::2]:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _exchange_cases(mesh, world):
    """``orthogonalize_on_owners`` on hand-made DTensors against ``fn`` of the full matrix:
    a function whose every entry depends on every shard (cumulative sums both ways)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    g = torch.Generator().manual_seed(1)
    layouts = [((1, 4), 0), ((6, 5), 0), ((2, 9), 0), ((0, 3), 0), ((3, 7), 1), ((4, 1), 1),
               ((5, 2), 0)]
    fulls = [torch.randn(*s, generator=g, dtype=F64) for s, _ in layouts]
    sharded = [distribute_tensor(f, mesh, [Shard(d)]) for f, (_, d) in zip(fulls, layouts)]
    plain = torch.randn(3, 3, generator=g, dtype=F64)
    replicated = distribute_tensor(fulls[1], mesh, [Replicate()])

    def fn(M):  # each matrix of a batch on its own
        return M.cumsum(-2).cumsum(-1)

    out = {"local_rows": [tuple(s.to_local().shape) for s in sharded]}
    with record_orthogonalisation() as record:
        results = sharding.orthogonalize_on_owners(fn, sharded + [plain, replicated])
        single = sharding.orthogonalize_on_owners(lambda M: fn(M).float(), sharded[1:2],
                                                  out_dtype=torch.float32)
    out["none_at"] = [i for i, r in enumerate(results) if r is None]
    out["diffs"] = [(r.full_tensor() - fn(f)).abs().sum().item()
                    for r, f in zip(results, fulls) if r is not None]
    out["placements_kept"] = all(r.placements == s.placements and r.shape == s.shape
                                 for r, s in zip(results, sharded) if r is not None)
    out["single"] = (single[0].dtype,
                     (single[0].full_tensor() - fn(fulls[1]).float()).abs().sum().item())
    out["computed"] = record.computed
    # same-shape matrices: the owner runs one batched call per shape (issue 32)
    same = [torch.randn(6, 5, generator=g, dtype=F64) for _ in range(2 * world)]
    calls = []

    def batched(M):
        calls.append(tuple(M.shape))
        return fn(M)
    results = sharding.orthogonalize_on_owners(
        batched, [distribute_tensor(f, mesh, [Shard(0)]) for f in same])
    out["batched_calls"] = calls
    out["batched_diff"] = max((r.full_tensor() - fn(f)).abs().max().item()
                              for r, f in zip(results, same))
    return out


def _job(rank, world, runs):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    out = {"shards": [tuple(p.to_local().shape) for p in _sharded_model(mesh).parameters()]}
    for name, mode in runs:
        cls, options = _options(name)
        model = _sharded_model(mesh)
        opt = _optimizer(cls, model.parameters(), mode, options)
        with record_orthogonalisation() as record:
            _train(model, opt, rank, world)
        out[name, mode] = dict(params=[p.full_tensor() for p in model.parameters()],
                               record=record)
    out["exchange"] = _exchange_cases(mesh, world)
    return out


@pytest.fixture(scope="module")
def ranks():
    """world -> every rank's results of one job (run on first use)."""
    jobs = {}

    def get(world):
        if world not in jobs:
            jobs[world] = run(_job, world, _runs_at(world), timeout=120.0,
                              collective_timeout=20.0)
        return jobs[world]
    return get


WORLDS = [2, 3, pytest.param(4, marks=pytest.mark.slow)]
FOUR_RANK_RUNS = [("shampoo-ns", "owner"), ("shampoo-svd", "owner"), ("mars-m", "owner"),
                  ("shampoo-ns", "every_rank"), ("mars-m", "every_rank")]


def _runs_at(world):
    return RUNS if world < 4 else FOUR_RANK_RUNS


@pytest.mark.parametrize("world", WORLDS)
def test_shards_are_uneven_and_empty(ranks, world):
    rows = [[shape[0] for shape in r["shards"][::2]] for r in ranks(world)]  # weights only
    for m, (A, _) in enumerate(SHAPES):
        assert [r[m] for r in rows] == sharding.shard_sizes(A, world)
    assert any(0 in r for r in rows) == (world > 2)  # 2 rows on 3 or 4 ranks
    owners = sharding.assign_owners([sharding.ns_flops(*s) for s in SHAPES], world)
    assert (len(set(owners)) < world) == (world == 4)  # a rank that owns nothing


@pytest.mark.parametrize("world,name,mode", [(w, n, m) for w in WORLDS[:2] for n, m in RUNS]
                         + [pytest.param(4, n, m, marks=pytest.mark.slow)
                            for n, m in FOUR_RANK_RUNS])
def test_sharded_equals_unsharded(ranks, world, name, mode):
    reference = _reference(name)
    for res in ranks(world):
        for a, b in zip(res[name, mode]["params"], reference):
            torch.testing.assert_close(a, b, rtol=TOLERANCE[name], atol=TOLERANCE[name])


@pytest.mark.parametrize("world", WORLDS)
def test_owner_mode_orthogonalises_each_matrix_once(ranks, world):
    """Owner: over all ranks, each matrix once per step, two collectives per step; every
    rank: each rank every matrix, one all-gather per matrix."""
    results = ranks(world)
    each_step = collections.Counter({s: STEPS for s in SHAPES})
    for name, mode in _runs_at(world):
        records = [r[name, mode]["record"] for r in results]
        if mode == "owner":
            assert sum((collections.Counter(r.computed) for r in records),
                       collections.Counter()) == each_step, name
            assert all(r.collectives == 2 * STEPS for r in records), name
        else:
            assert all(collections.Counter(r.computed) == each_step for r in records), name
            assert all(r.collectives == len(SHAPES) * STEPS for r in records), name


@pytest.mark.parametrize("world", WORLDS)
def test_measurement_matches_prediction(ranks, world):
    """``record_orthogonalisation`` against ``exchange_bytes`` (float64, Shard(0)), per rank,
    both modes; what the ranks send is what they receive."""
    results = ranks(world)
    for name, mode in _runs_at(world):
        cls, options = _options(name)  # MARS-M's result comes back in ns_dtype
        out_itemsize = options["ns_dtype"].itemsize if cls is MARSM else 8
        predicted = sharding.exchange_bytes(SHAPES, world, itemsize=8, out_itemsize=out_itemsize)
        records = [r[name, mode]["record"] for r in results]
        assert [r.bytes_received for r in records] == [
            STEPS * b for b in predicted[mode]["received"]], (name, mode)
        assert [r.flops() for r in records] == [STEPS * f for f in predicted[mode]["flops"]]
        assert sum(r.bytes_sent for r in records) == sum(r.bytes_received for r in records)
    predicted = sharding.exchange_bytes(SHAPES, world, itemsize=8)
    owner, every = (sum(predicted[m]["received"]) for m in ("owner", "every_rank"))
    assert owner < every  # uneven shards: the all-gather's padding costs even at P = 2


@pytest.mark.parametrize("world", WORLDS)
def test_exchange_equals_function_of_full_matrix(ranks, world):
    for res in ranks(world):
        ex = res["exchange"]
        assert ex["none_at"] == [3, 7, 8]  # the empty matrix, a plain tensor, a replicated one
        assert max(ex["diffs"]) < 1e-12 and len(ex["diffs"]) == 6
        assert ex["placements_kept"]
        assert ex["single"][0] == torch.float32 and ex["single"][1] < 1e-5
    computed = [s for res in ranks(world) for s in res["exchange"]["computed"]]
    assert sorted(computed) == sorted([(1, 4), (6, 5), (2, 9), (3, 7), (4, 1), (5, 2), (6, 5)])
    rows = [res["exchange"]["local_rows"] for res in ranks(world)]
    assert any(0 in (s[0] * s[1] for s in r) for r in rows)  # (1, 4) leaves ranks empty


@pytest.mark.parametrize("world", WORLDS)
def test_an_owner_orthogonalises_its_same_shape_matrices_in_one_call(ranks, world):
    """2 x world matrices of one shape, equal cost: LPT gives each rank two, and each rank
    makes one batched call of both, equal to fn of each full matrix."""
    for res in ranks(world):
        assert res["exchange"]["batched_calls"] == [(2, 6, 5)]
        assert res["exchange"]["batched_diff"] < 1e-12


# -- the owner map and the cost model (no processes) ----------------------------------------
def test_lpt_is_deterministic_and_breaks_ties_by_parameter_order():
    assert sharding.assign_owners([5, 5, 5], 2) == [0, 1, 0]
    assert sharding.assign_owners([1, 9, 9, 1], 2) == [0, 0, 1, 1]
    assert sharding.assign_owners([4], 3) == [0]
    assert sharding.assign_owners([], 2) == []
    costs = [sharding.ns_flops(*s) for s in [(768, 256), (256, 256), (1024, 256), (256, 1024)] * 3]
    first = sharding.assign_owners(costs, 4)
    assert all(sharding.assign_owners(list(costs), 4) == first for _ in range(3))
    # Equal costs keep their order whatever the list around them: parameter order decides.
    assert sharding.assign_owners([3, 7, 3, 7], 2) == [0, 0, 1, 1]


def test_lpt_balance_within_graham_bound():
    rng = random.Random(0)
    for _ in range(100):
        world = rng.randint(2, 3)
        costs = [rng.randint(1, 50) for _ in range(rng.randint(1, 6))]
        owners = sharding.assign_owners(costs, world)
        loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(world)]
        best = min(max(sum(c for c, o in zip(costs, assign) if o == r) for r in range(world))
                   for assign in itertools.product(range(world), repeat=len(costs)))
        assert max(loads) * 3 * world <= (4 * world - 1) * best
        assert max(loads) <= sum(costs) / world + max(costs)


def test_ns_flops_counts_newton_schulz():
    from torch.utils.flop_counter import FlopCounterMode
    for shape in [(6, 10), (10, 6), (4, 4), (1, 5)]:
        with FlopCounterMode(display=False) as counter:
            newton_schulz(torch.randn(*shape, dtype=F64), steps=3, dtype=F64)
        assert counter.get_total_flops() == sharding.ns_flops(*shape, steps=3), shape


def test_exchange_bytes_prediction():
    """The closed forms: every rank receives (P-1) padded shards of each matrix; owner mode
    at P = 2 moves as much, at P = 4 about half, and splits the flops."""
    shapes = [(8, 4), (4, 8)]
    p2, p4 = (sharding.exchange_bytes(shapes, w, itemsize=1) for w in (2, 4))
    assert p2["every_rank"]["received"] == [32, 32] and p2["owner"]["received"] == [32, 32]
    assert p4["every_rank"]["received"] == [48] * 4 and sum(p4["owner"]["received"]) == 96
    assert sorted(p4["owner"]["flops"]) == [0, 0] + sorted([sharding.ns_flops(8, 4)] * 2)
    assert sharding.exchange_bytes([(3, 2)], 1)["owner"]["received"] == [0]


def test_orthogonalize_on_is_validated():
    with pytest.raises(ValueError, match="orthogonalize_on"):
        functional.mars([], [], [], [], [], [], [], [], lr=1e-3, betas=(0.9, 0.99), eps=1e-8,
                        weight_decay=0.0, amsgrad=False, gamma=0.025, lr_1d_factor=1.0,
                        betas_1d=(0.9, 0.95), weight_decay_1d=0.0, orthogonalize_on="owners")
    with pytest.raises(ValueError, match="orthogonalize_on"):
        functional.mars_m([], [], [], [], [], [], [], [], lr=1e-3, weight_decay=0.0,
                          momentum=0.9, gamma=0.025, orthogonalize_on=None)
