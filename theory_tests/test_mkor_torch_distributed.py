"""MKOR under DistributedDataParallel on 2 CPU ranks (gloo; KT12).

Each rank sees half of a batch of 16; DDP averages the weight gradients and MKOR
averages the rank-1 vectors once. With mean-reduced losses the averaged vectors are
exactly the full-batch vectors (a_bar: mean of two equal-size means; g_bar: sum over
rows of the full-batch mean loss's gradient = the mean of the two ranks' sums), so
every rank's factors and parameters must equal a single-process run on the whole
batch, to 1e-12 in float64 (summation order only). ``average="double"`` must
reproduce the released code's extra division by the world size.
"""
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as Fn

from torch_impl.mkor import MKOR


WORLD = 2


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _batch(t):
    g = torch.Generator().manual_seed(t)
    return torch.randn(16, 5, generator=g, dtype=torch.float64), \
        torch.randn(16, 3, generator=g, dtype=torch.float64)


def _train(model, mkor, opt, rank=None, steps=3):
    vectors = []
    for t in range(steps):
        x, y = _batch(t)
        if rank is not None:
            x, y = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
        Fn.mse_loss(model(x), y).backward()
        vectors.append(mkor.pending_vectors())
        mkor.step()
        opt.zero_grad()
    return vectors


def _worker(rank, store_path, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        for average in ("once", "double"):
            model = nn.parallel.DistributedDataParallel(_model())
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            mkor = MKOR(model, opt, inv_freq=1, factor_dtype="float64", average=average)
            _train(model, mkor, opt, rank)
            torch.save({"names": mkor.preconditioned_modules,
                        "factors": mkor.inverse_factors(),
                        "params": [p.detach() for p in model.parameters()]},
                       os.path.join(out_dir, f"{average}{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def single_process():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mkor = MKOR(model, opt, inv_freq=1, factor_dtype="float64")
    _train(model, mkor, opt)
    return mkor.inverse_factors(), [p.detach() for p in model.parameters()]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """One 2-rank gloo job (forked: no re-import), training once per ``average``."""
    out = tmp_path_factory.mktemp("ddp")
    ctx = mp.start_processes(_worker, args=(str(out / "store"), str(out)), nprocs=WORLD,
                             start_method="fork", join=False)
    deadline = time.monotonic() + 120  # a hung collective must fail the test, not CI
    while not ctx.join(timeout=1):  # join raises at once if a worker raised or died
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail("the 2-rank gloo job did not finish within 120 s")
    return {avg: [torch.load(out / f"{avg}{r}.pt", weights_only=False) for r in range(WORLD)]
            for avg in ("once", "double")}


def test_ddp_ranks_agree_with_the_single_process_run(ranks, single_process):
    factors, params = single_process
    results = ranks["once"]
    for res in results:
        assert res["names"] == ["0", "2"]  # no "module." prefix
        for name, (L, R) in factors.items():
            L_r, R_r = res["factors"][name]
            assert torch.allclose(L_r, L, rtol=0, atol=1e-12)
            assert torch.allclose(R_r, R, rtol=0, atol=1e-12)
        for p, q in zip(res["params"], params):
            assert torch.allclose(p, q, rtol=0, atol=1e-12)
    for name in factors:  # replicated factors: bit-identical on every rank
        for a, b in zip(results[0]["factors"][name], results[1]["factors"][name]):
            assert torch.equal(a, b)


def test_double_average_reproduces_the_released_scaling(ranks, single_process):
    """With "double", vectors are mean/P: the factors differ from the single run and
    equal a single-process run whose vectors are divided by P."""
    results = ranks["double"]
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mkor = MKOR(model, opt, inv_freq=1, factor_dtype="float64")
    original = mkor.pending_vectors
    mkor.pending_vectors = lambda: {k: (a / WORLD, g / WORLD) for k, (a, g) in original().items()}
    _train(model, mkor, opt)
    factors, _ = single_process
    for name, (L, R) in mkor.inverse_factors().items():
        L_r, R_r = results[0]["factors"][name]
        assert torch.allclose(L_r, L, rtol=0, atol=1e-12)
        assert torch.allclose(R_r, R, rtol=0, atol=1e-12)
        assert not torch.allclose(L_r, factors[name][0], rtol=0, atol=1e-6)
