"""Rank-k MKOR on 2 gloo CPU ranks (KC7, KC8): every rank all-reduces its k group sums and
counts per factor, so group j of the step is the union of the ranks' j-th pieces. That is by
construction one process *accumulating* the ranks' batches as micro-batches (each micro-batch
loss divided by the number of micro-batches, as DDP's averaging divides each rank's): the
ranks must hold that run's factors and parameters (float64, 1e-12; only the order of
summation differs) and the same ones on every rank, bit for bit; with ``comm_overlap`` too.
(One process on the union batch as *one* call cuts it into k groups of its own, a different
statistic for k > 1: the pooled definition is what makes the exchange an all-reduce.)"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as Fn

from theory_tests.distributed.test_mkor import (_assert_close_to, _assert_ranks_identical,
                                                _cnn, _cnn_batch, _mlp, _mlp_batch)
from theory_tests.support.distributed_harness import run
from torch_impl.mkor import MKOR

RANK = 3
MODELS = {"mlp": (_mlp, _mlp_batch), "cnn": (lambda: _cnn().double(), _cnn_batch)}


def _run(model, batch, steps, rank=None, world=2, **kw):
    """DDP ranks (``rank`` given) each step on their shard; one process (``rank`` None)
    accumulates the ``world`` shards as micro-batches, each loss divided by ``world``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mkor = MKOR(model, opt, inv_freq=1, factor_dtype="float64", rank=RANK, **kw)
    for t in range(steps):
        x, y = batch(t)
        shards = list(zip(x.double().chunk(world), y.double().chunk(world)))
        for r, (xs, ys) in enumerate(shards):
            if rank is None:
                (Fn.mse_loss(model(xs), ys) / world).backward()
            elif r == rank:
                Fn.mse_loss(model(xs), ys).backward()
        mkor.step()
        opt.zero_grad()
    return {"factors": mkor.inverse_factors(), "params": [p.detach().clone()
                                                          for p in model.parameters()],
            "payload": mkor.payload_bytes, "bytes": mkor.communicated_bytes}


def _job(rank, world):
    out = {}
    for kind, (make, batch) in MODELS.items():
        for overlap in (False, True):
            model = nn.parallel.DistributedDataParallel(make())
            out[kind, overlap] = _run(model, batch, 3, rank, world, comm_overlap=overlap)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run(_job, 2)


@pytest.mark.parametrize("overlap", [False, True], ids=["step", "comm_overlap"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_ddp_equals_one_process_accumulating_the_ranks_batches(ranks, kind, overlap):
    make, batch = MODELS[kind]
    reference = _run(make(), batch, 3)
    results = [r[kind, overlap] for r in ranks]
    for res in results:
        _assert_close_to(res, reference, atol=1e-12)
        assert res["bytes"] == 3 * res["payload"]  # one all-reduce per factor update
    _assert_ranks_identical(results)


def test_the_payload_is_k_group_sums_per_factor(ranks):
    """MLP Linear(5, 6), Linear(6, 3), both with a bias: k (d_in + 1 + d_out) values per
    layer plus one count each, float64 (the compute dtype of float64 factors)."""
    assert ranks[0]["mlp", False]["payload"] == (RANK * (5 + 1 + 6) + 1 + RANK * (6 + 1 + 3) + 1) * 8
