"""LP5 across ranks (2 gloo CPU ranks, forked): MKOR's stochastic factor writes have no rank
word in their stream, so replicated factors stay bit-identical on every rank, and the default
seed is rank 0's draw even when the ranks' torch generators differ (DDP); under FSDP2 the
owner of a layer (``factor_placement="owner"``) writes exactly what every rank writes under
the replicated placement."""
import torch
import torch.nn as nn
import torch.nn.functional as Fn

from torch_impl.mkor import MKOR

from theory_tests.support.distributed_harness import run

STEPS = 3
OPTIONS = dict(inv_freq=1, factor_dtype=torch.bfloat16, factor_rounding="stochastic")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(),
                         nn.Linear(6, 3))


def _train(model, rank, world, **options):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mkor = MKOR(model, opt, **OPTIONS, **options)
    for t in range(STEPS):
        g = torch.Generator().manual_seed(t)
        x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
        Fn.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        mkor.step()
        mkor.zero_grad()
    factors = {n: tuple(None if f is None else f.clone() for f in pair)
               for n, pair in mkor.inverse_factors().items()}
    return mkor.rounding_seed, factors


def _job(rank, world):
    from torch.distributed.fsdp import fully_shard
    model = nn.parallel.DistributedDataParallel(_model())
    torch.manual_seed(100 + rank)  # each rank's own default draw would differ
    out = {"ddp": _train(model, rank, world)}
    for placement in ("replicated", "owner"):
        out[placement] = _train(fully_shard(_model()), rank, world, rounding_seed=7,
                                factor_placement=placement)
    return out


def test_replicated_factors_round_identically_on_every_rank():
    results = run(_job, 2)
    seeds = [r["ddp"][0] for r in results]
    assert seeds[0] == seeds[1]  # rank 0's draw, broadcast at construction
    for name, pair in results[0]["ddp"][1].items():
        for a, b in zip(pair, results[1]["ddp"][1][name]):
            assert a.dtype == torch.bfloat16 and torch.equal(a, b), name
    # FSDP2: every rank's replicated factors are bit-identical, and each owner's are them
    replicated = [r["replicated"][1] for r in results]
    owned = {}
    for r in results:
        for name, pair in r["owner"][1].items():
            if pair[0] is not None or pair[1] is not None:
                owned[name] = pair
    assert set(owned) == set(replicated[0])
    for name, pair in replicated[0].items():
        for a, b, c in zip(pair, replicated[1][name], owned[name]):
            assert torch.equal(a, b) and torch.equal(a, c), name
