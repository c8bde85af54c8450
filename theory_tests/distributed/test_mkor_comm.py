"""What MKOR's all-reduce sends and how it is averaged (torch_impl.kronecker.exchange).

In-process tests simulate P ranks by summing their packed buffers (exactly what a SUM
all-reduce computes); the gloo tests check the same on real ranks: reduced-precision error
bounds, layers only some ranks capture, a stale overlapped launch, and the MKOR-H switch
taken on the same step by every rank.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as Fn
from hypothesis import given, strategies as st

from torch_impl.baselines import KFAC

from torch_impl.mkor import MKOR, LossRateSwitch
from torch_impl.kronecker.exchange import Packet

from theory_tests.support.distributed_harness import run


# -- the packet, in one process ------------------------------------------------------------
def _simulate(packet, per_rank_items, average="once"):
    """SUM of every rank's packed buffer, unpacked: what each rank gets back."""
    total = sum(packet.pack(items, "cpu").double() for items in per_rank_items)
    return packet.unpack(total.to(packet.dtype), torch.float64, average, len(per_rank_items))


@given(world=st.integers(1, 5),
       sizes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 4), st.booleans()),
                      min_size=1, max_size=4),
       seed=st.integers(0, 2 ** 16), average=st.sampled_from(["once", "double"]))
def test_each_layer_is_averaged_once_over_the_ranks_that_have_it(world, sizes, seed, average):
    g = torch.Generator().manual_seed(seed)
    packet = Packet([[(a,), (b,)] for a, b, _ in sizes], [c for *_, c in sizes], torch.float64)
    items, have = [], []
    for _ in range(world):
        rank_items, rank_have = [], []
        for a, b, carried in sizes:
            present = bool(torch.rand((), generator=g) < 0.7)
            vecs = [torch.randn(a, generator=g, dtype=torch.float64),
                    torch.randn(b, generator=g, dtype=torch.float64)]
            if carried:
                vecs[0][-1] = 1.0  # a_bar's bias entry: 1 by definition
            rank_items.append(vecs if present else None)
            rank_have.append(vecs if present else None)
        items.append(rank_items)
        have.append(rank_have)
    for m, ((a_mean, g_mean), count) in enumerate(_simulate(packet, items, average)):
        holders = [have[r][m] for r in range(world) if have[r][m] is not None]
        assert count.item() == len(holders)
        if not holders:
            assert not a_mean.any() and not g_mean.any()
            continue
        scale = len(holders) * (world if average == "double" else 1)
        torch.testing.assert_close(a_mean, sum(h[0] for h in holders) / scale,
                                   rtol=1e-14, atol=1e-15)
        torch.testing.assert_close(g_mean, sum(h[1] for h in holders) / scale,
                                   rtol=1e-14, atol=1e-15)


def test_payload_layout_is_the_vectors_plus_counts_of_bias_free_layers():
    packet = Packet([[(7,), (3,)], [(5,), (2,)]], [True, False], torch.float16)
    assert packet.numel == 7 + 3 + 5 + 2 + 1 and packet.nbytes == 2 * 18
    with pytest.raises(ValueError, match="carried"):
        Packet([[(0,), (3,)]], [True], torch.float32)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device present")
def test_pack_and_unpack_never_synchronise_with_the_host():
    packet = Packet([[(5,), (3,)], [(4,), (2,)]], [True, False], torch.bfloat16)
    items = [[torch.randn(5, device="cuda"), torch.randn(3, device="cuda")], None]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
    try:
        out = packet.unpack(packet.pack(items, "cuda"), torch.float32)
        present = [count > 0 for _, count in out]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert [bool(p) for p in present] == [True, False]


def _sample_mlp():
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))


def test_mkor_payload_is_linear_and_kfac_quadratic_in_width():
    """The O(d) vs O(d^2) claim on a 784-512-512-10 MLP (all with bias, float32):
    MKOR sends sum (d_in' + d_out), K-FAC sum (d_in'^2 + d_out^2) values."""
    model = _sample_mlp()
    dims = [(785, 512), (513, 512), (513, 10)]
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    mkor, kfac = MKOR(model, sgd), KFAC(model, sgd)
    assert mkor.payload_bytes == 4 * sum(a + b for a, b in dims) == 11_380
    assert kfac.payload_bytes == 4 * sum(a * a + b * b for a, b in dims) == 6_667_804
    assert MKOR(model, sgd, comm_dtype="bfloat16").payload_bytes == 11_380 // 2
    assert mkor.communicated_bytes == kfac.communicated_bytes == 0


# -- on gloo ranks ---------------------------------------------------------------------------
def _reduced_precision(rank, world):
    """Per wire dtype: the worst |mean_hat - mean| / bound over 3000 values spanning 6
    decades, with bound = gamma_P * mean_r |v_r| + 2^-24 (torch_impl.kronecker.exchange)."""
    g = torch.Generator().manual_seed(rank)
    v = torch.randn(3000, generator=g, dtype=torch.float64) * 10.0 ** (
        6 * torch.rand(3000, generator=g, dtype=torch.float64) - 3)
    everyone = [torch.empty_like(v) for _ in range(world)]
    dist.all_gather(everyone, v)
    exact = torch.stack(everyone).mean(0)
    magnitude = torch.stack(everyone).abs().mean(0)
    out = {}
    for dtype, u in ((torch.float16, 2 ** -11), (torch.bfloat16, 2 ** -8),
                     (torch.float32, 2 ** -24)):
        packet = Packet([[(1000,), (2000,)]], [False], dtype)
        (a, b), _ = packet.all_reduce([[v[:1000], v[1000:]]], "cpu").wait(torch.float64)[0]
        err = (torch.cat([a, b]) - exact).abs()
        bound = world * u / (1 - world * u) * magnitude + 2 ** -24
        out[dtype] = ((err / bound).max().item(), err.max().item())
    return out


def _partial_capture(rank, world):
    """Only rank 0 runs the branch (one layer with a bias, one without); nobody runs
    `unused`. lr = 0 keeps the weights fixed, so the branch's vectors depend on rank 0's
    data only."""
    model = _Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mkor = MKOR(model, opt, inv_freq=1, factor_dtype="float64")
    for t in range(3):
        x, y = _branchy_batch(t, rank)
        Fn.mse_loss(model(x, use_branch=rank == 0), y).backward()
        mkor.step()
        mkor.zero_grad()
    return {"factors": mkor.inverse_factors(), "counters": mkor.counters(),
            "bytes": mkor.communicated_bytes, "payload": mkor.payload_bytes}


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(4, 3)
        self.branch = nn.Linear(3, 3)
        self.branch_nb = nn.Linear(3, 3, bias=False)
        self.unused = nn.Linear(3, 3)
        self.double()

    def forward(self, x, use_branch):
        h = torch.tanh(self.trunk(x))
        return h + self.branch(h) * self.branch_nb(h) if use_branch else h


def _branchy_batch(t, rank):
    g = torch.Generator().manual_seed(100 * t + rank)
    return (torch.randn(6, 4, generator=g, dtype=torch.float64),
            torch.randn(6, 3, generator=g, dtype=torch.float64))


def _stale_overlap(rank, world):
    """Two backward passes per step without no_sync: the first launch goes stale and is
    finished and discarded; the result must equal the non-overlapped run."""
    out = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mkor = MKOR(model, opt, inv_freq=1, comm_overlap=overlap)
        seen = []
        for t in range(3):
            for half in range(2):
                x, y = _branchy_batch(t, rank)
                x, y = x.float()[:, :4][half::2], y.float()[:, :2][half::2]
                (Fn.mse_loss(model(x), y) / 2).backward()
                seen.append(mkor.communicated_bytes)
            mkor.step()
            mkor.zero_grad()
        out[overlap] = {"factors": mkor.inverse_factors(), "seen": seen,
                        "payload": mkor.payload_bytes}
    return out


class _Checkpointed(nn.Module):
    """A reentrant-checkpointed first layer, then a plain one: the backward reaches ``last``
    (its statistics complete) before it recomputes ``first``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 5)
        self.last = nn.Linear(5, 3)
        self.double()

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.first(t)), x,
                                              use_reentrant=True)
        return self.last(h)


def _checkpoint_overlap(rank, world):
    """comm_overlap launches when ``last``'s statistics complete, before the recompute commits
    ``first``'s: that launch is stale at the step and is discarded for a full one, so the run
    equals the non-overlapped one."""
    out = {}
    for overlap in (False, True):
        model = _Checkpointed()
        mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1), inv_freq=1,
                    factor_dtype="float64", comm_overlap=overlap)
        for t in range(3):
            x, y = _branchy_batch(t, rank)
            Fn.mse_loss(model(x.requires_grad_()), y).backward()
            mkor.step()
            mkor.zero_grad()
        out[overlap] = {"factors": mkor.inverse_factors(), "bytes": mkor.communicated_bytes,
                        "payload": mkor.payload_bytes}
    return out


def _refused_overlap(rank, world):
    """A layer whose gradient is exactly 0 at step 0 (the next layer's weight is 0, as LoRA's
    B): the self-check refuses its statistics after the early launch carried them, so that
    launch is dropped for one without them; the run equals the non-overlapped one."""
    out = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 2)).double()
        with torch.no_grad():
            model[1].weight.zero_()
        mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1), inv_freq=1,
                    factor_dtype="float64", comm_overlap=overlap)
        for t in range(3):
            x, y = _branchy_batch(t, rank)
            Fn.mse_loss(model(x), y[:, :2]).backward()
            mkor.step()
            mkor.zero_grad()
        out[overlap] = {"factors": mkor.inverse_factors(), "counters": mkor.counters()}
    return out


def _overflow(rank, world):
    """float16 wire: a g_bar beyond 65504 becomes inf, and the update is skipped."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.0), inv_freq=1,
                comm_dtype="float16")
    (model(torch.ones(4, 3)).sum() * 1e6).backward()
    mkor.step()
    return mkor.counters()[""]["non_finite"].item(), mkor.inverse_factors()[""]


def _losses(rank, t):
    return 10 * 0.5 ** t if rank == 0 else 0.99 ** t


def _hybrid(rank, world):
    model = nn.Linear(3, 2)
    mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1), hybrid_switch="loss_rate",
                switch_window=2, switch_check_every=1, switch_threshold=0.1, switch_patience=1)
    for t in range(20):
        if mkor.observe_loss(_losses(rank, t)):
            return t
    return None


def _comm_job(rank, world):
    return {"precision": _reduced_precision(rank, world),
            "partial": _partial_capture(rank, world), "stale": _stale_overlap(rank, world),
            "checkpoint": _checkpoint_overlap(rank, world),
            "refused": _refused_overlap(rank, world),
            "overflow": _overflow(rank, world), "hybrid": _hybrid(rank, world)}


@pytest.fixture(scope="module")
def comm_ranks():
    return run(_comm_job, 2)


def test_reduced_precision_error_is_within_the_stated_bound(comm_ranks):
    for res in comm_ranks:
        for dtype, (worst_ratio, worst_err) in res["precision"].items():
            assert worst_ratio <= 1.0, dtype
        assert res["precision"][torch.float16][1] > 1e-6  # the rounding did happen
        assert res["precision"][torch.bfloat16][1] > res["precision"][torch.float16][1]


def test_float16_overflow_skips_the_update_instead_of_corrupting_factors(comm_ranks):
    for res in comm_ranks:
        skipped, (L, R) = res["overflow"]
        assert skipped == 1  # g_bar overflowed; a_bar (finite) is still applied
        assert torch.isfinite(L).all() and torch.equal(L, torch.eye(2))
        assert torch.isfinite(R).all() and not torch.equal(R, torch.eye(4))


def test_a_layer_some_ranks_lack_gets_the_union_of_the_ranks_rows(comm_ranks):
    """Only rank 0 runs the branch: its factors equal one process on the union of the two
    ranks' batches (rank 0's call with the branch, rank 1's without, the loss averaged over
    the ranks as DDP averages gradients), so a_bar is the mean over rank 0's rows and g_bar
    is half rank 0's sum; with and without a bias. A layer no rank ran keeps I and counts
    one "no rows" per factor update, not a non-finite one."""
    model = _Branchy()
    mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.0), inv_freq=1,
                factor_dtype="float64")
    for t in range(3):
        (x0, y0), (x1, y1) = _branchy_batch(t, 0), _branchy_batch(t, 1)
        loss = (Fn.mse_loss(model(x0, use_branch=True), y0)
                + Fn.mse_loss(model(x1, use_branch=False), y1)) / 2
        loss.backward()
        mkor.step()
        mkor.zero_grad()
    reference = mkor.inverse_factors()
    for name in ("branch", "branch_nb"):  # the comparison has teeth: rank 0 alone differs
        alone = _Branchy()
        solo = MKOR(alone, torch.optim.SGD(alone.parameters(), lr=0.0), inv_freq=1,
                    factor_dtype="float64")
        for t in range(3):
            x, y = _branchy_batch(t, 0)
            Fn.mse_loss(alone(x, use_branch=True), y).backward()
            solo.step()
            solo.zero_grad()
        assert not torch.allclose(solo.inverse_factors()[name][0], reference[name][0])
    for res in comm_ranks:
        part = res["partial"]
        for name in ("trunk", "branch", "branch_nb"):
            for a, b in zip(part["factors"][name], reference[name]):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-12)  # float64 rounding
            assert part["counters"][name]["updates_a"].item() == 3
        for J in part["factors"]["unused"]:
            assert torch.equal(J, torch.eye(len(J), dtype=torch.float64))
        assert part["counters"]["unused"]["updates_a"].item() == 0
        assert part["counters"]["unused"]["non_finite"].item() == 0
        assert part["counters"]["unused"]["no_rows"].item() == 3
        # 4 layers, one bias-free: (5+3) + (4+3) + (3+3) + (4+3) values + 1 count, float64
        assert part["payload"] == (8 + 7 + 6 + 7 + 1) * 8 and part["bytes"] == 3 * part["payload"]
    assert mkor.counters()["unused"]["no_rows"].item() == 3  # one process counts the same
    for name in comm_ranks[0]["partial"]["factors"]:
        for a, b in zip(comm_ranks[0]["partial"]["factors"][name],
                        comm_ranks[1]["partial"]["factors"][name]):
            assert torch.equal(a, b)


def test_a_stale_overlapped_launch_is_discarded(comm_ranks):
    for res in comm_ranks:
        plain, overlap = res["stale"][False], res["stale"][True]
        for name, pair in plain["factors"].items():
            for a, b in zip(pair, overlap["factors"][name]):
                assert torch.equal(a, b)
        p = overlap["payload"]
        assert overlap["seen"] == [p, 2 * p, 3 * p, 4 * p, 5 * p, 6 * p]
        assert plain["seen"] == [0, 0, p, p, 2 * p, 2 * p]


def test_a_launch_before_a_checkpoints_recompute_is_discarded(comm_ranks):
    """Reentrant checkpointing commits the recomputed layer's statistics after the overlapped
    launch: every step launches twice (the stale early buffer, then the whole one), and the
    factors are the non-overlapped run's bit for bit."""
    for res in comm_ranks:
        plain, overlap = res["checkpoint"][False], res["checkpoint"][True]
        for name, pair in plain["factors"].items():
            assert not torch.equal(pair[1], torch.eye(len(pair[1]), dtype=torch.float64))
            for a, b in zip(pair, overlap["factors"][name]):
                assert torch.equal(a, b)
        p = overlap["payload"]
        assert (plain["bytes"], overlap["bytes"]) == (3 * p, 6 * p)


def test_statistics_refused_after_an_overlapped_launch_never_reach_a_factor(comm_ranks):
    for res in comm_ranks:
        plain, overlap = res["refused"][False], res["refused"][True]
        assert plain["counters"]["0"]["updates_g"].item() == 2  # step 0's were refused
        for name, pair in plain["factors"].items():
            for a, b in zip(pair, overlap["factors"][name]):
                assert torch.equal(a, b)


def test_mkor_h_switches_on_the_same_step_on_every_rank(comm_ranks):
    """The rule sees the mean loss over ranks; rank-local rules would disagree (and the
    ranks' collectives would then no longer match)."""
    def first_switch(losses):
        rule = LossRateSwitch(window=2, check_every=1, threshold=0.1, patience=1)
        return next((t for t, loss in enumerate(losses) if rule.observe(loss)), None)

    mean = first_switch([(_losses(0, t) + _losses(1, t)) / 2 for t in range(20)])
    local = [first_switch([_losses(r, t) for t in range(20)]) for r in (0, 1)]
    assert local[0] != local[1] and mean is not None
    assert [res["hybrid"] for res in comm_ranks] == [mean, mean]
