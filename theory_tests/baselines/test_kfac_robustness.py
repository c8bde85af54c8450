"""K-FAC in real training loops (K19): independent factor oracles (an explicit patch loop for
Conv2d, rows with a bias column for Linear), gradient accumulation, loss scaling, non-finite
batches, failed decompositions and autocast. float64 unless the claim is about precision;
factor tolerances are relative to the factor's largest entry (1e-12: sums of at most a few
hundred O(1) products in a different order)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as Fn

from torch_impl.baselines import KFAC

from torch_impl.mkor import MKOR

from theory_tests.baselines.test_kfac_torch import Net  # conv -> fc -> norm -> out

f64 = torch.float64


def _net(seed=0):
    torch.manual_seed(seed)
    return Net().double()


def _batch(t, n=6):
    g = torch.Generator().manual_seed(t)
    return torch.randn(n, 2, 4, 4, generator=g, dtype=f64), torch.randn(n, 2, generator=g,
                                                                       dtype=f64)


def _kfac(model, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return opt, KFAC(model, opt, inv_freq=1, kl_clip=None, damping=0.1, **kwargs)


def _close(a, b, rel=1e-12):
    return torch.allclose(a, b, rtol=0, atol=rel * b.abs().max().item())


def _patches(x, k=3, stride=2, pad=1):
    """(B, L, C k k) patches by slicing, in the (c, i, j) order of weight.reshape(C_out, -1);
    an independent im2col (no F.unfold)."""
    xp = Fn.pad(x, (pad, pad, pad, pad))
    B, C, H, W = xp.shape
    rows = []
    for i0 in range(0, H - k + 1, stride):
        for j0 in range(0, W - k + 1, stride):
            rows.append(xp[:, :, i0:i0 + k, j0:j0 + k].reshape(B, -1))
    return torch.stack(rows, dim=1)


def test_factors_match_an_explicit_patch_loop_and_rows_with_a_bias():
    """A = mean over rows of [a | 1][a | 1]^T; G = N sum_i g_i g_i^T with N = B samples for
    Conv2d (L rows each, the KFC approximation) and N = B rows for Linear."""
    model = _net()
    opt, kfac = _kfac(model)
    x, y = _batch(0)
    seen = {}
    def record(name):
        def hook(module, inputs, output):
            seen["a_" + name] = inputs[0].detach()
            output.register_hook(lambda g: seen.__setitem__("g_" + name, g))
        return hook

    model.conv.register_forward_hook(record("conv"))
    model.fc.register_forward_hook(record("fc"))
    Fn.mse_loss(model(x), y).backward()
    kfac.step()
    A, G = kfac.factors()["conv"]
    P = _patches(x)  # (B, L, 18)
    B, L = P.shape[:2]
    rows = torch.cat([P.reshape(B * L, -1), torch.ones(B * L, 1, dtype=f64)], 1)
    assert _close(A, rows.T @ rows / (B * L))
    g = seen["g_conv"].flatten(2).transpose(1, 2).reshape(B * L, -1)
    assert _close(G, B * (g.T @ g))
    A, G = kfac.factors()["fc"]
    a = torch.cat([seen["a_fc"], torch.ones(B, 1, dtype=f64)], 1)
    assert _close(A, a.T @ a / B)
    assert _close(G, B * (seen["g_fc"].T @ seen["g_fc"]))


@pytest.mark.parametrize("micro", [2, 3])
def test_gradient_accumulation_gives_the_full_batch_factors(micro):
    """k micro-batches of loss/k equal one batch: G sums the micro-batches' g g^T and counts
    all their samples (dividing each micro-batch's G by k made G k^2 too small)."""
    factors = []
    for k in (1, micro):
        model = _net()
        opt, kfac = _kfac(model)
        for t in range(2):
            x, y = _batch(t)
            for xb, yb in zip(x.chunk(k), y.chunk(k)):
                (Fn.mse_loss(model(xb), yb) / k).backward()
            kfac.step()
            kfac.zero_grad()
        factors.append(kfac.factors())
    for name, (A, G) in factors[0].items():
        assert _close(factors[1][name][0], A) and _close(factors[1][name][1], G), name


@pytest.mark.parametrize("cls", [KFAC, MKOR])
def test_a_loss_scale_is_divided_out_of_the_statistics(cls):
    """K5: backward of 2^10 * loss with set_grad_scale(2^10) captures the unscaled run's
    statistics (G / s^2 for K-FAC, g_bar / s for MKOR), exactly (s is a power of two);
    without it they differ."""
    results = []
    for scale, told in ((1.0, True), (1024.0, True), (1024.0, False)):
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        pre = (KFAC(model, opt, inv_freq=1, kl_clip=None) if cls is KFAC
               else MKOR(model, opt, inv_freq=1, factor_dtype="float64"))
        if told:
            pre.set_grad_scale(scale)
        x, y = _batch(0)
        (scale * Fn.mse_loss(model(x), y)).backward()
        if cls is MKOR:
            results.append(pre.pending_vectors())
        else:
            for p in model.parameters():
                p.grad /= scale
            pre.step()
            results.append(pre.factors())
    for name in results[0]:
        for a, b, c in zip(results[0][name], results[1][name], results[2][name]):
            assert torch.equal(a, b), name
        assert not torch.equal(results[0][name][1], results[2][name][1])


def test_a_non_finite_batch_is_refused_and_counted():
    model = _net()
    opt, kfac = _kfac(model)
    x, y = _batch(0)
    Fn.mse_loss(model(x), y).backward()
    kfac.step()
    kfac.zero_grad()
    before = {n: (A.clone(), G.clone()) for n, (A, G) in kfac.factors().items()}
    x, y = _batch(1)
    x[0, 0, 0, 0] = float("nan")  # reaches every layer's statistics
    Fn.mse_loss(model(x), y).backward()
    for p in model.parameters():
        p.grad.zero_()  # as if GradScaler had unscaled and the step went on
    kfac.precondition()
    assert int(kfac.skipped_updates) == len(before)
    for n, (A, G) in kfac.factors().items():
        assert torch.equal(A, before[n][0]) and torch.equal(G, before[n][1])
    kfac.zero_grad()
    x, y = _batch(2)
    Fn.mse_loss(model(x), y).backward()
    kfac.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_failed_float32_decomposition_is_retried_in_float64(monkeypatch):
    """eigh failing in float32 (as on the low-rank layer4 factors of a ResNet-18 at 32x32)
    falls back to float64; if every attempt fails, the previous decomposition is kept and
    counted with a warning."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    kfac = KFAC(model, opt, inv_freq=1, kl_clip=None)
    real_eigh = torch.linalg.eigh
    mode = {"fail": "float32"}

    def flaky_eigh(M):
        if mode["fail"] == "all" or M.dtype == torch.float32:
            raise torch.linalg.LinAlgError("linalg.eigh: ill-conditioned (injected)")
        return real_eigh(M)

    monkeypatch.setattr(torch.linalg, "eigh", flaky_eigh)
    x = torch.randn(8, 4)
    model(x).square().mean().backward()
    kfac.step()
    assert kfac.decomposition_retries == 4 and kfac.decomposition_failures == 0
    lam, Q = kfac._state["0"]["eig_A"]
    assert lam.dtype == Q.dtype == torch.float32
    A = kfac.factors()["0"][0].double()
    assert torch.allclose((Q.double() * lam.double()) @ Q.double().T, A, atol=1e-5)
    mode["fail"] = "all"
    kfac.zero_grad()
    model(x).square().mean().backward()
    with pytest.warns(RuntimeWarning, match="keeping its previous decomposition"):
        kfac.step()
    assert kfac.decomposition_failures == 4
    assert kfac._state["0"]["eig_A"][0] is lam


def test_factors_stay_float32_under_bf16_autocast():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    kfac = KFAC(model, opt, inv_freq=1)
    x = torch.randn(32, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().square().mean()
    loss.backward()
    kfac.step()
    for A, G in kfac.factors().values():
        assert A.dtype == G.dtype == torch.float32
    # The first layer sees x itself: its A is the float32 second moment (a bf16 product,
    # 8 mantissa bits, would be off by ~4e-3 relative).
    rows = torch.cat([x, torch.ones(32, 1)], 1)
    assert _close(kfac.factors()["0"][0], rows.T @ rows / 32, rel=1e-5)
    assert all(torch.isfinite(p).all() for p in model.parameters())
