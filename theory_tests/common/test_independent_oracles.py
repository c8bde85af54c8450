"""Independent oracles (issue 12). Where the NumPy oracle (reference/) and the torch port share
a formula, a differential test between the two cannot see a bug they share (LAMB's bias
correction, K-FAC's G scaling, the loss scale). Each test here checks the oracle and the port
against a second computation, written differently:

* LAMB (K15): closed forms at steps 1 and 2, and LAMB assembled from ``torch.optim.Adam``'s
  direction (Adam's own bias correction and eps placement) with the trust ratio on top;
* K-FAC factors (K19): G from per-sample losses, each through its own one-sample forward and
  backward (not N times the mean-loss gradient), A from a Python loop over output positions;
* the loss scale (K5): MKOR's a_bar, g_bar and K-FAC's A, G after backward of s * loss, s a
  power of two and not, by ``set_grad_scale`` and by ``torch.amp.GradScaler``, against the
  statistics of the unscaled loss: the input, the bias gradient / s, the analytic MSE gradient.

float64 throughout. Tolerances are relative to the largest entry compared: each side is a few
roundings of sums of at most ~100 O(1) terms (~1e-15 relative), so 1e-12 leaves 1000x room,
while every bug these tests are for changes entries by 1e-3 or more.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as Fn

from reference.common import first_order
from reference.baselines.kfac import kfac_factors
from reference.mkor.vectors import conv2d_rank1_vectors, linear_rank1_vectors, unfold2d
from torch_impl.baselines import KFAC, LAMB
from torch_impl.mkor import MKOR

from theory_tests.baselines.test_kfac_torch import Net  # conv(2->3, k3, s2, p1) -> fc(12->5) -> LayerNorm -> out(5->2)

f64 = torch.float64
REL = 1e-12


def _close(ours, expected, rel=REL):
    """max |ours - expected| <= rel * max |expected| (so exact zeros must match exactly)."""
    ours, expected = (np.asarray(x.detach().cpu() if torch.is_tensor(x) else x, dtype=np.float64)
                      for x in (ours, expected))
    assert ours.shape == expected.shape
    return np.abs(ours - expected).max() <= rel * np.abs(expected).max()


# ------------------------------------------------------------------------------ LAMB (K15)
BETAS, EPS, LR = (0.8, 0.99), 1e-6, 0.02


def _lamb_by_hand(p, grads, wd):
    """LAMB's first one or two steps, by hand. Step 1: m_hat = g, v_hat = g^2. Step 2:
    m_hat = (b1 g1 + g2) / (1 + b1), v_hat = (b2 g1^2 + g2^2) / (1 + b2) (the bias
    corrections 1 - b^2 = (1 - b)(1 + b) cancel the EMAs' (1 - b)). Then
    r = m_hat / (sqrt(v_hat) + eps) + wd p, p <- p - lr (||p|| / ||r||) r."""
    b1, b2 = BETAS
    if len(grads) == 1:
        (g,) = grads
        m_hat, v_hat = g, g * g
    else:
        g1, g2 = grads
        m_hat, v_hat = (b1 * g1 + g2) / (1 + b1), (b2 * g1 * g1 + g2 * g2) / (1 + b2)
    r = m_hat / (np.sqrt(v_hat) + EPS) + wd * p
    return p - LR * np.linalg.norm(p) / np.linalg.norm(r) * r


def _lamb_runs(params, stream, wd):
    """Yield (oracle, port) parameters after each step of the same gradient stream."""
    torch_params = [torch.tensor(p, requires_grad=True) for p in params]
    port = LAMB(torch_params, lr=LR, betas=BETAS, eps=EPS, weight_decay=wd)
    ref, states = [p.copy() for p in params], [{} for _ in params]
    for grads in stream:
        ref = [first_order.lamb(p, g, s, lr=LR, betas=BETAS, eps=EPS, weight_decay=wd)
               for p, g, s in zip(ref, grads, states)]
        for p, g in zip(torch_params, grads):
            p.grad = torch.tensor(g)
        port.step()
        yield ref, [p.detach().numpy() for p in torch_params]


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("constant", [True, False])
def test_lamb_first_two_steps_match_the_closed_form(wd, constant):
    """Steps 1 and 2 of the oracle and the port equal the closed form (a constant gradient
    has m_hat = g, v_hat = g^2 at both steps). A bias correction off by one step, or
    dropped, changes the scale of m_hat / sqrt(v_hat) and so, with weight decay, the
    direction of r (without weight decay the trust ratio hides a uniform scale)."""
    rng = np.random.default_rng(0)
    p0 = rng.normal(size=(4, 3))
    g1 = rng.normal(size=(4, 3))
    g2 = g1 if constant else rng.normal(size=(4, 3))
    expected = [_lamb_by_hand(p0, [g1], wd)]
    expected.append(_lamb_by_hand(expected[0], [g1, g2], wd))
    for k, (ref, port) in enumerate(_lamb_runs([p0], [[g1], [g2]], wd)):
        assert _close(ref[0], expected[k]) and _close(port[0], expected[k]), k


def _lamb_from_adam(params, stream, wd):
    """LAMB assembled from torch.optim.Adam: Adam(lr=1, weight_decay=0) stepping a tensor
    reset to 0 lands on -d, d = (m / (1 - b1^k)) / (sqrt(v) / sqrt(1 - b2^k) + eps), Adam's
    direction with torch's bias corrections and eps (added to sqrt(v_hat), as in LAMB). Then
    r = d + wd p, trust = ||p|| / ||r|| (1 if either is 0), p <- p - lr trust r."""
    shadows = [torch.zeros(p.shape, dtype=f64, requires_grad=True) for p in params]
    adam = torch.optim.Adam(shadows, lr=1.0, betas=BETAS, eps=EPS, weight_decay=0.0,
                            foreach=False)
    ps = [p.copy() for p in params]
    for grads in stream:
        with torch.no_grad():
            for s, g in zip(shadows, grads):
                s.zero_()
                s.grad = torch.tensor(g)
        adam.step()
        for i, s in enumerate(shadows):
            r = -s.detach().numpy() + wd * ps[i]
            p_norm, r_norm = np.linalg.norm(ps[i]), np.linalg.norm(r)
            trust = p_norm / r_norm if p_norm > 0 and r_norm > 0 else 1.0
            ps[i] = ps[i] - LR * trust * r
        yield [p.copy() for p in ps]


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lamb_matches_lamb_built_from_torch_adam(wd):
    """Oracle and port against the Adam-built LAMB: 8 steps, three tensors (one all-zero at
    the start: trust 1, one with entries ~10), gradients of mixed scale."""
    rng = np.random.default_rng(1)
    params = [rng.normal(size=(4, 3)), np.zeros(5), 10 * rng.normal(size=7)]
    stream = [[rng.normal(size=p.shape) * 10.0 ** rng.uniform(-2, 1) for p in params]
              for _ in range(8)]
    for t, ((ref, port), built) in enumerate(zip(_lamb_runs(params, stream, wd),
                                                 _lamb_from_adam(params, stream, wd))):
        for i in range(len(params)):
            assert _close(ref[i], built[i]) and _close(port[i], built[i]), (t, i)


# ----------------------------------------------------------------- K-FAC factors (K19)
def _batch(seed, n=5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 2, 4, 4, generator=g, dtype=f64),
            torch.randn(n, 2, generator=g, dtype=f64))


def _net(seed=0):
    torch.manual_seed(seed)
    return Net().double()


def _layer_io(model, names=("conv", "fc", "out")):
    """Forward hooks recording each layer's input and output (the output kept in the graph)."""
    seen = {}
    for name in names:
        getattr(model, name).register_forward_hook(
            lambda m, inp, out, n=name: seen.update({("a", n): inp[0], ("o", n): out}))
    return seen


def _patch_rows(x, k=3, stride=2, pad=1):
    """Conv2d input rows, one per (sample, output position), by Python loops over the output
    positions in NumPy; entries in the (c, i, j) order of weight.reshape(C_out, -1)."""
    x = np.pad(x.detach().numpy(), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    B, C, H, W = x.shape
    out = []
    for b in range(B):
        for i0 in range(0, H - k + 1, stride):
            for j0 in range(0, W - k + 1, stride):
                out.append([x[b, c, i0 + i, j0 + j] for c in range(C) for i in range(k)
                            for j in range(k)])
    return np.array(out)


def _per_sample_factors(model, x, y):
    """K-FAC's factors from their definition, one sample at a time: A = mean over rows of
    [a | 1][a | 1]^T; G = (1/B) sum_b sum_l grad_{o_bl} l_b grad_{o_bl} l_b^T, where
    l_b = mean_j (f(x_b)_j - y_bj)^2 is sample b's own loss, differentiated through a
    one-sample forward (the batch's loss is the mean of the l_b, and nothing in the net couples
    samples: its LayerNorm normalises each one). Conv2d: L rows per sample, the KFC
    approximation; Linear: one row per sample."""
    B = x.shape[0]
    seen = _layer_io(model)
    G = {}
    for b in range(B):
        loss_b = Fn.mse_loss(model(x[b:b + 1]), y[b:b + 1])
        grads = torch.autograd.grad(loss_b, [seen["o", n] for n in ("conv", "fc", "out")])
        for n, g in zip(("conv", "fc", "out"), grads):
            rows = (g.flatten(2).transpose(1, 2) if n == "conv" else g).reshape(-1, g.shape[1])
            G[n] = G.get(n, 0) + rows.T.numpy() @ rows.numpy() / B
    model(x)
    a = {"conv": _patch_rows(x), "fc": seen["a", "fc"].detach().numpy(),
         "out": seen["a", "out"].detach().numpy()}
    A = {}
    for n, rows in a.items():
        if n != "out":  # conv and fc have a bias: the input 1 of the bias column
            rows = np.column_stack([rows, np.ones(len(rows))])
        A[n] = sum(np.outer(r, r) for r in rows) / len(rows)
    return A, G


def test_kfac_factors_match_their_per_sample_definition():
    """The port's first factors (the batch factors) and the oracle's ``kfac_factors`` (fed
    the Linear layers' inputs and mean-loss output gradients) equal A and G built one sample
    at a time. A G scaled by the rows B L of a Conv2d instead of its B samples (L = 4 times
    too large) fails, as does a G missing the factor N that undoes the mean-reduction. The
    oracle's Conv2d takes the unfolded patches (``unfold2d``, itself checked against an
    explicit loop in KT8) with ``rows_per_sample`` = L."""
    x, y = _batch(0)
    expected_A, expected_G = _per_sample_factors(_net(), x, y)
    model = _net()
    seen = _layer_io(model)
    kfac = KFAC(model, torch.optim.SGD(model.parameters(), lr=0.05), inv_freq=1,
                kl_clip=None)
    out = model(x)
    for n in ("conv", "fc", "out"):
        seen["o", n].retain_grad()
    Fn.mse_loss(out, y).backward()
    kfac.step()
    assert set(kfac.factors()) == {"conv", "fc", "out"}
    for n, (A, G) in kfac.factors().items():
        assert _close(A, expected_A[n]) and _close(G, expected_G[n]), n
    for n, bias in (("fc", True), ("out", False)):
        A, G = kfac_factors(seen["a", n].detach().numpy(), seen["o", n].grad.numpy(),
                            has_bias=bias)
        assert _close(A, expected_A[n]) and _close(G, expected_G[n]), n
    patches = unfold2d(x.numpy(), 3, padding=1, stride=2).transpose(0, 2, 1)  # (B, L, C k k)
    g_conv = seen["o", "conv"].grad.flatten(2).transpose(1, 2).numpy()      # (B, L, C_out)
    A, G = kfac_factors(patches, g_conv, has_bias=True, rows_per_sample=patches.shape[1])
    assert _close(A, expected_A["conv"]) and _close(G, expected_G["conv"]), "conv (oracle)"


# --------------------------------------------------------------------- loss scale (K5)
SCALES = [1024.0, 1000.0, 3.7]  # a power of two (exact) and two that are not


def _scaled_statistics(cls, scale, path):
    """Backward of scale * loss, the scale told by ``set_grad_scale`` or handed over by
    ``GradScaler.step``. Returns (statistics, seen, x, y, scaled bias gradients, the scale
    used): MKOR's (a_bar, g_bar) from the sums ``pending_sums`` gives inside the step, or
    K-FAC's (A, G). GradScaler keeps its scale in float32 (3.7 becomes 3.700000047...)."""
    x, y = _batch(1)
    model = _net()
    seen = _layer_io(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    pre = (MKOR(model, opt, inv_freq=1, factor_dtype="float64") if cls is MKOR
           else KFAC(model, opt, inv_freq=1, kl_clip=None))
    captured = {}
    if cls is MKOR:
        original = pre.pending_sums
        pre.pending_sums = lambda: captured.setdefault("s", original())
    out = model(x)
    for n in ("conv", "fc", "out"):
        seen["o", n].retain_grad()
    loss = Fn.mse_loss(out, y)
    if path == "set_grad_scale":
        pre.set_grad_scale(scale)
        (scale * loss).backward()
        bias = {n: getattr(model, n).bias.grad.clone() for n in ("conv", "fc")}
        pre.step()
    else:
        scaler = torch.amp.GradScaler("cpu", init_scale=scale)
        scaler.scale(loss).backward()
        bias = {n: getattr(model, n).bias.grad.clone() for n in ("conv", "fc")}
        scaler.step(pre)
        assert scaler.get_scale() == np.float32(scale)  # no overflow: the step ran
        scale = scaler.get_scale()
    stats = ({n: (a / rows, g) for n, (a, rows, g) in captured["s"].items()} if cls is MKOR
             else pre.factors())
    return stats, seen, x, y, bias, scale


@pytest.mark.parametrize("path", ["set_grad_scale", "GradScaler"])
@pytest.mark.parametrize("scale", SCALES)
def test_mkor_vectors_under_a_loss_scale_are_the_unscaled_ones(scale, path):
    """K5: g_bar is the bias gradient of the unscaled loss (autograd's bias.grad / s; / L
    more for a Conv2d, L = 4 positions), and for the bias-free output layer the sum over
    rows of the analytic MSE gradient (f - y) / B; a_bar is the mean over rows of the
    input, with a 1 for a bias. The oracle's rank-1 vectors, fed the inputs and the
    output gradients / s, give the same. Dropping the scale, or rounding it to a power of
    two, fails (s = 1000, 3.7)."""
    vectors, seen, x, y, bias, scale = _scaled_statistics(MKOR, scale, path)
    B, L = x.shape[0], 4
    rows = {"conv": _patch_rows(x), "fc": seen["a", "fc"].detach().numpy(),
            "out": seen["a", "out"].detach().numpy()}
    expected_a = {n: np.append(r.mean(0), 1.0) if n != "out" else r.mean(0)
                  for n, r in rows.items()}
    expected_g = {"conv": bias["conv"].numpy() / scale / L, "fc": bias["fc"].numpy() / scale,
                  "out": ((seen["o", "out"] - y).sum(0) / B).detach().numpy()}
    assert set(vectors) == {"conv", "fc", "out"}
    for n, (a_bar, g_bar) in vectors.items():
        assert _close(a_bar, expected_a[n]) and _close(g_bar, expected_g[n]), n
    conv = conv2d_rank1_vectors(x.numpy(), seen["o", "conv"].grad.numpy() / scale, 3, 2, 1, 1,
                                True)
    oracle = {"conv": conv}
    for n, has_bias in (("fc", True), ("out", False)):
        oracle[n] = linear_rank1_vectors(rows[n], seen["o", n].grad.numpy() / scale, has_bias)
    for n, (a_bar, g_bar) in oracle.items():
        assert _close(a_bar, expected_a[n]) and _close(g_bar, expected_g[n]), n


# GradScaler's scale is a float32 0-d tensor: a factor N / s^2 computed from it alone would
# be rounded to float32 (G off by ~7e-8 relative in float64) unless s is a power of two; the
# 1000 and 3.7 cases through GradScaler caught exactly that in KFAC._batch_factors.
KFAC_CASES = [(s, path) for path in ("set_grad_scale", "GradScaler") for s in SCALES]


@pytest.mark.parametrize("scale,path", KFAC_CASES)
def test_kfac_factors_under_a_loss_scale_are_the_unscaled_ones(scale, path):
    """K5 for K-FAC: A and G after backward of s * loss equal the per-sample factors of the
    unscaled loss (G is divided by s^2)."""
    factors, _, x, y, _, _ = _scaled_statistics(KFAC, scale, path)
    expected_A, expected_G = _per_sample_factors(_net(), x, y)
    assert set(factors) == {"conv", "fc", "out"}
    for n, (A, G) in factors.items():
        assert _close(A, expected_A[n]) and _close(G, expected_G[n]), n
