"""MKOR and K-FAC on 2 and 4 gloo CPU ranks (spec MKOR.md 2.7, KT12).

Each rank sees an equal slice of the global batch; DDP averages the weight gradients and
MKOR averages a_bar and g_bar once. With mean-reduced losses the averaged vectors are the
full-batch vectors (a_bar: mean of equal-size means; g_bar: the gradient of the full-batch
mean loss summed over rows = the mean of the ranks' sums), so every rank must hold the
factors and parameters of a single-process run on the concatenated batch, and the same
ones on every rank, bit for bit (every rank applies the same updates to the same
all-reduced buffer). The payload of a factor update is sum_m (d_in' + d_out) values plus
one count per bias-free layer (``torch_impl.kronecker.exchange``); K-FAC's is
sum_m (d_in'^2 + d_out^2) plus the same counts.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as Fn

from torch_impl.baselines import KFAC

from torch_impl.mkor import MKOR

from theory_tests.support.distributed_harness import run


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _cnn():
    """Conv2d with bias, a bias-free Linear, a Linear: every vector kind and both
    presence encodings (carried in a_bar, or an extra count)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(),
                         nn.Linear(48, 5, bias=False), nn.Tanh(), nn.Linear(5, 2))


def _mlp_batch(t):
    g = torch.Generator().manual_seed(t)
    return (torch.randn(16, 5, generator=g, dtype=torch.float64),
            torch.randn(16, 3, generator=g, dtype=torch.float64))


def _cnn_batch(t):
    g = torch.Generator().manual_seed(t)
    return torch.randn(16, 2, 6, 6, generator=g), torch.randn(16, 2, generator=g)


def _shard(x, y, rank, world):
    return (x, y) if rank is None else (x.chunk(world)[rank], y.chunk(world)[rank])


def _train(model, pre, opt, batch, steps, rank=None, world=1):
    for t in range(steps):
        x, y = _shard(*batch(t), rank, world)
        Fn.mse_loss(model(x), y).backward()
        pre.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _mkor_run(model, batch, steps, rank=None, world=1, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mkor = MKOR(model, opt, **kw)
    params = _train(model, mkor, opt, batch, steps, rank, world)
    return mkor, {"factors": mkor.inverse_factors(), "params": params,
                  "names": mkor.preconditioned_modules, "bytes": mkor.communicated_bytes,
                  "payload": mkor.payload_bytes, "counters": mkor.counters()}


def _kfac_run(model, steps, rank=None, world=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    kfac = KFAC(model, opt, inv_freq=2, damping=1e-2)
    params = _train(model, kfac, opt, _mlp_batch, steps, rank, world)
    return {"factors": kfac.factors(), "params": params, "bytes": kfac.communicated_bytes,
            "payload": kfac.payload_bytes}


def _assert_ranks_identical(results, keys=("factors", "params")):
    first = results[0]
    for res in results[1:]:
        if "factors" in keys:
            for name, pair in first["factors"].items():
                for a, b in zip(pair, res["factors"][name]):
                    assert torch.equal(a, b), name
        if "params" in keys:
            for a, b in zip(first["params"], res["params"]):
                assert torch.equal(a, b)


def _assert_close_to(result, reference, atol):
    """Entrywise within atol * max(1, max|reference|): relative to the largest entry of each
    tensor compared (K-FAC's G = N sum g g^T is not O(1)), an absolute floor below 1."""
    def close(a, b):
        torch.testing.assert_close(a, b, rtol=0, atol=atol * max(1.0, b.abs().max().item()))
    for name, pair in reference["factors"].items():
        for a, b in zip(result["factors"][name], pair):
            close(a, b)
    for a, b in zip(result["params"], reference["params"]):
        close(a, b)


# -- float64: once / double, and K-FAC ------------------------------------------------------
def _fp64_job(rank, world):
    ddp = lambda m: nn.parallel.DistributedDataParallel(m)  # noqa: E731
    out = {}
    for average in ("once", "double"):
        out[average] = _mkor_run(ddp(_mlp()), _mlp_batch, 3, rank, world, inv_freq=1,
                                 factor_dtype="float64", average=average)[1]
    out["kfac"] = _kfac_run(ddp(_mlp()), 4, rank, world)
    return out


@pytest.fixture(scope="module")
def fp64_ranks():
    return run(_fp64_job, 2)


def test_ddp_ranks_agree_with_the_single_process_run(fp64_ranks):
    """float64, 1e-12: the runs differ only in the order of summation."""
    reference = _mkor_run(_mlp(), _mlp_batch, 3, inv_freq=1, factor_dtype="float64")[1]
    results = [r["once"] for r in fp64_ranks]
    for res in results:
        assert res["names"] == ["0", "2"]  # DDP's "module." prefix is stripped
        _assert_close_to(res, reference, atol=1e-12)
    _assert_ranks_identical(results)


def test_double_average_reproduces_the_released_scaling(fp64_ranks):
    """With "double", vectors are mean/P: the factors differ from the single run and equal
    a single-process run whose vectors are divided by P."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mkor = MKOR(model, opt, inv_freq=1, factor_dtype="float64")
    original = mkor.pending_sums
    mkor.pending_sums = lambda: {k: (a / 2, n, g / 2) for k, (a, n, g) in original().items()}
    _train(model, mkor, opt, _mlp_batch, 3)
    once = fp64_ranks[0]["once"]["factors"]
    for name, (L, R) in mkor.inverse_factors().items():
        L_r, R_r = fp64_ranks[0]["double"]["factors"][name]
        torch.testing.assert_close(L_r, L, rtol=0, atol=1e-12)
        torch.testing.assert_close(R_r, R, rtol=0, atol=1e-12)
        assert not torch.allclose(L_r, once[name][0], rtol=0, atol=1e-6)


def test_kfac_all_reduces_its_factors(fp64_ranks):
    """K-FAC: full factors averaged once (float64, 1e-12 vs the concatenated batch; the
    eigendecompositions see identical factors on every rank), and its payload per factor
    update is sum_m (d_in'^2 + d_out^2) float64 values (both layers have a bias)."""
    reference = _kfac_run(_mlp(), 4)
    results = [r["kfac"] for r in fp64_ranks]
    _assert_ranks_identical(results)
    for res in results:
        _assert_close_to(res, reference, atol=1e-12)
        assert res["payload"] == (6 * 6 + 6 * 6 + 7 * 7 + 3 * 3) * 8
        assert res["bytes"] == 4 * res["payload"]  # factor_freq=1: 4 factor updates
    assert reference["bytes"] == 0  # one process sends nothing


# -- float32, 2 and 4 ranks, 30 steps; overlap; accumulation ------------------------------
STEPS, INV_FREQ = 30, 2


def _fp32_job(rank, world):
    ddp = lambda m: nn.parallel.DistributedDataParallel(m)  # noqa: E731
    out = {"plain": _mkor_run(ddp(_cnn()), _cnn_batch, STEPS, rank, world,
                              inv_freq=INV_FREQ)[1]}
    mkor, out["overlap"] = _mkor_run(ddp(_cnn()), _cnn_batch, STEPS, rank, world,
                                     inv_freq=INV_FREQ, comm_overlap=True)
    # The overlapped reduction is launched by the backward pass, before step().
    x, y = _shard(*_cnn_batch(STEPS), rank, world)
    before = mkor.communicated_bytes
    Fn.mse_loss(mkor.model(x), y).backward()
    out["launched_in_backward"] = mkor.communicated_bytes - before
    mkor.zero_grad()  # drops (after finishing) the unused launch on every rank
    # Accumulation of two micro-batches, the first under no_sync: one launch per step.
    for overlap in (False, True):
        model = ddp(_cnn())
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        mkor = MKOR(model, opt, inv_freq=1, comm_overlap=overlap)
        per_backward = []
        for t in range(4):
            x, y = _shard(*_cnn_batch(t), rank, world)
            with model.no_sync():
                (Fn.mse_loss(model(x[::2]), y[::2]) / 2).backward()
            per_backward.append(mkor.communicated_bytes)
            (Fn.mse_loss(model(x[1::2]), y[1::2]) / 2).backward()
            per_backward.append(mkor.communicated_bytes)
            mkor.step()
            mkor.zero_grad()
        out[f"accum{overlap}"] = {"factors": mkor.inverse_factors(),
                                  "params": [p.detach() for p in model.parameters()],
                                  "bytes_after_backward": per_backward,
                                  "payload": mkor.payload_bytes}
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def fp32_ranks(request):
    return request.param, run(_fp32_job, request.param)


@pytest.fixture(scope="module")
def fp32_single():
    return _mkor_run(_cnn(), _cnn_batch, STEPS, inv_freq=INV_FREQ)[1]


def test_factors_and_params_bit_identical_across_ranks(fp32_ranks):
    _, results = fp32_ranks
    for key in ("plain", "overlap", "accumFalse", "accumTrue"):
        _assert_ranks_identical([r[key] for r in results])


def test_equals_single_process_on_the_concatenated_batch(fp32_ranks, fp32_single):
    """float32, 30 steps (15 factor updates): the runs differ only in the order in which
    per-sample terms are summed (per rank, then across ranks), a relative perturbation of
    a few u = 6e-8 per step; measured 2.4e-7 on factors of size ~2, we allow 1e-5."""
    _, results = fp32_ranks
    for res in results:
        assert res["plain"]["names"] == ["0", "3", "5"]
        _assert_close_to(res["plain"], fp32_single, atol=1e-5)


def test_payload_is_one_a_bar_and_one_g_bar_per_layer(fp32_ranks, fp32_single):
    """Bytes per factor update = sum_m (d_in' + d_out) * 4 plus one count for the
    bias-free layer (a layer with a bias carries its count in a_bar's last entry)."""
    _, results = fp32_ranks
    d = [(2 * 9 + 1, 3), (48, 5), (5 + 1, 2)]  # (d_in', d_out): conv, bias-free, linear
    payload = (sum(a + b for a, b in d) + 1) * 4
    assert fp32_single["payload"] == payload and fp32_single["bytes"] == 0
    for res in results:
        for key in ("plain", "overlap"):
            assert res[key]["payload"] == payload
            assert res[key]["bytes"] == (STEPS // INV_FREQ) * payload
        assert res["launched_in_backward"] == payload


def test_overlap_changes_nothing_but_the_launch_time(fp32_ranks):
    """comm_overlap reduces the same buffer, so results are bit-identical; with
    accumulation the no_sync micro-batch launches nothing, the final one launches once."""
    _, results = fp32_ranks
    for res in results:
        _assert_ranks_identical([res["plain"], res["overlap"]])
        _assert_ranks_identical([res["accumFalse"], res["accumTrue"]])
        p = res["accumTrue"]["payload"]
        assert res["accumTrue"]["bytes_after_backward"] == [0, p, p, 2 * p, 2 * p, 3 * p,
                                                            3 * p, 4 * p]
        assert res["accumFalse"]["bytes_after_backward"] == [0, 0, p, p, 2 * p, 2 * p,
                                                             3 * p, 3 * p]
