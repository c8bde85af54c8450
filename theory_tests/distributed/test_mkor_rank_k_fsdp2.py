"""Rank-k MKOR on FSDP2 (``fully_shard``, 2 gloo ranks), on ``test_mkor_fsdp2.py``'s awkward
model (a 7-row layer, a 2-row layer, a bias-free and a frozen layer, mixed sharding): the ranks
equal one process accumulating their slices as micro-batches (KC7's pooled groups, as under
DDP: ``test_mkor_rank_k.py``), with replicated and owner-placed factors (float64, 1e-12)."""
import pytest
import torch
import torch.nn.functional as Fn

from theory_tests.distributed.test_mkor_fsdp2 import (_assert_close, _batch, _factors, _full,
                                                      _model, _shard)
from theory_tests.support.distributed_harness import run
from torch_impl.mkor import MKOR

OPTIONS = {"replicated": dict(variant="paper", inv_freq=1, factor_dtype="float64",
                              stat_decay=0.8, rank=3),
           "owner": dict(variant="paper", inv_freq=1, factor_dtype="float64", stat_decay=0.8,
                         rank=3, factor_placement="owner")}


def _train(model, options, rank=None, world=2, steps=3):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05,
                          momentum=0.9)
    mkor = MKOR(model, opt, **options)
    for t in range(steps):
        x, y = _batch(t)
        for r, (xs, ys) in enumerate(zip(x.chunk(world), y.chunk(world))):
            if rank is None:  # one process: the slices as micro-batches
                (Fn.mse_loss(model(xs), ys) / world).backward()
            elif r == rank:
                Fn.mse_loss(model(xs), ys).backward()
        mkor.step()
        opt.zero_grad()
    return {"params": [_full(p.detach()).clone() for p in model.parameters()],
            "factors": _factors(mkor)}


def _job(rank, world):
    return {name: _train(_shard(_model()), options, rank, world)
            for name, options in OPTIONS.items()}


@pytest.fixture(scope="module")
def ranks():
    return run(_job, 2)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_fsdp2_ranks_equal_one_process_accumulating_their_slices(ranks, name):
    reference = _train(_model(), OPTIONS[name])
    for rank, result in enumerate(ranks):
        _assert_close(result[name], reference, f"rank-k {name}, rank {rank}")
    if name == "owner":  # each factor on one rank
        for layer, pair in reference["factors"].items():
            held = [r[name]["factors"][layer][0] is not None for r in ranks]
            assert sum(held) == 1, (layer, held)
