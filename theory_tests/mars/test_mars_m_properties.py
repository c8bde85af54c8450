"""Properties of MARS-M (spec MARS.md 2.6, M15-M18, MT12) on ``torch_impl.MARSM``.

* gamma = 0 is ``torch.optim.Muon(nesterov=False, adjust_lr_fn="match_rms_adamw")`` while no
  clip fires, and Muon fed g / max(1, ||g||) when it does; gamma = 1 - beta without the clip
  is Nesterov Muon (M20 in Muon's lerp form).  Both compared bit for bit in bf16.
* (M17) the scale 0.2 sqrt(max(A, B)); (M15) the clip, ``clip_c`` and the authors' default.
* (M18) the efficient recursion: a sympy proof through the oracle's own functions.
* The AdamW backup puts eps before the bias correction (not torch AdamW's placement).
"""
import numpy as np
import pytest
import sympy as sp
import torch

from theory_tests.support.mars_property_helpers import F64, clone_params, feed, make_params
from reference.mars import mars_m_equations as R
from torch_impl import MARS_M, MARSM

MATRICES = [(16, 8), (8, 24), (12, 12)]


def _grads(t, shapes, scale):
    gen = torch.Generator().manual_seed(50 + t)
    return [torch.randn(s, generator=gen) * scale for s in shapes]


def _lockstep(opt_a, a, opt_b, b, grads_for, steps=10, feed_b=None):
    for t in range(steps):
        grads = grads_for(t)
        feed(opt_a, a, grads)
        feed(opt_b, b, grads if feed_b is None else feed_b(grads))


# ------------------------------------------------------------------ against torch.optim.Muon

@pytest.mark.parametrize("nesterov", [False, True], ids=["heavy-ball", "nesterov"])
def test_reduces_to_torch_muon_match_rms_adamw(nesterov):
    """gamma = 0: M_t is Muon's buffer lerp(M, g, 1 - beta); gamma = 1 - beta (no clip):
    M_t = (1 - beta) g + beta buf, Muon's Nesterov argument.  Small gradients (no clip)."""
    beta = 0.95
    a = make_params(MATRICES, 1, torch.float32)
    b = clone_params(a)
    opt_a = MARSM(a, lr=0.02, weight_decay=0.1, momentum=beta,
                  gamma=1 - beta if nesterov else 0.0, clip_c=not nesterov)
    opt_b = torch.optim.Muon(b, lr=0.02, weight_decay=0.1, momentum=beta, nesterov=nesterov,
                             adjust_lr_fn="match_rms_adamw")
    _lockstep(opt_a, a, opt_b, b, lambda t: _grads(t, MATRICES, 0.02))
    for p, q, p0 in zip(a, b, make_params(MATRICES, 1, torch.float32)):
        assert not torch.equal(p, p0)
        assert torch.equal(p, q)


def test_where_muon_differs_the_clip_and_muon_fed_clipped_gradients_agree():
    """With ||g|| > 1 MARS-M clips C_t = g (gamma = 0) and Muon does not: the runs differ, and
    Muon fed g / ||g|| is MARS-M again."""
    a = make_params(MATRICES, 2, torch.float32)
    b, c = clone_params(a), clone_params(a)
    opt_a = MARSM(a, lr=0.02, gamma=0.0)
    muon = dict(lr=0.02, weight_decay=0.1, nesterov=False, adjust_lr_fn="match_rms_adamw")
    opt_b, opt_c = torch.optim.Muon(b, **muon), torch.optim.Muon(c, **muon)
    def big(t):  # norms 3 to 30, alternating: the clip fires and m changes direction
        return [g * (1 + 9 * (t % 2)) for g in _grads(t, MATRICES, 0.5)]
    clipped = lambda gs: [g / max(1.0, torch.linalg.vector_norm(g).item()) for g in gs]
    _lockstep(opt_a, a, opt_b, b, big, feed_b=clipped)
    for t in range(10):
        feed(opt_c, c, big(t))
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert max((p - q).abs().max().item() for p, q in zip(a, c)) > 1e-3


# ------------------------------------------------------------------ (M17), (M15), clip_c

def test_m17_first_step_is_lr_times_match_rms_scale_times_ns():
    """Step 1 from M = 0: M_1 = (1 - beta) C~_1, O = NS(M_1); p <- p(1 - lr wd) - lr s O."""
    shapes = [(6, 10), (10, 6)]
    params = make_params(shapes, 3, F64)
    p0 = [p.detach().clone() for p in params]
    grads = _grads(0, shapes, 0.05)
    opt = MARSM(params, lr=0.01, weight_decay=0.2, gamma=0.0, ns_dtype=F64)
    feed(opt, params, grads)
    for p, x, g in zip(params, p0, grads):
        o = R.mars_m_direction(0.05 * g.double().numpy())
        s = 0.2 * max(p.shape) ** 0.5
        assert s == R.match_rms_scale(p.shape)
        expected = x.numpy() * (1 - 0.01 * 0.2) - 0.01 * s * o
        np.testing.assert_allclose(p.detach().numpy(), expected, rtol=0, atol=1e-15)


def test_m16_direction_is_cast_before_it_is_normalised_and_stays_in_ns_dtype():
    """(M16) the authors' order: M is rounded to ``ns_dtype`` first (then transposed and
    normalised there), and O is returned in ``ns_dtype``: so O depends on M only through its
    bf16 rounding, bit for bit; MARS's Newton-Schulz normalises in M's dtype and rounds once."""
    from torch_impl.mars import mars_m_equations
    M = torch.tensor(np.random.default_rng(0).normal(size=(6, 4)))
    o = mars_m_equations.mars_m_direction(M, 5, torch.bfloat16)
    assert o.dtype == torch.bfloat16 and o.shape == M.shape
    assert torch.equal(o, mars_m_equations.mars_m_direction(M.bfloat16().double(), 5,
                                                            torch.bfloat16))
    assert torch.isfinite(o).all() and o.abs().max() > 0.1


@pytest.mark.parametrize("clip_c", [True, False])
def test_m15_momentum_norm_bound_and_clip_c(clip_c):
    """With the clip ||M_t||_F <= 1 - beta^t < 1 whatever the gradients; clip_c=False lets
    large gradients through (the bound fails)."""
    params = make_params(MATRICES, 4, F64)
    opt = MARSM(params, lr=1e-3, gamma=0.3, clip_c=clip_c, ns_dtype=F64)
    worst = 0.0
    for t in range(6):
        feed(opt, params, _grads(t, MATRICES, 5.0))
        for p in params:
            norm = torch.linalg.vector_norm(opt.state[p]["momentum_buffer"]).item()
            worst = max(worst, norm / (1 - 0.95 ** (t + 1)))
    assert (worst <= 1 + 1e-12) == clip_c, worst


def test_authors_constructor_clips_whatever_clip_c_says_unless_honoured():
    """The authors' MARS_M ignores clip_c (spec B10): our MARS_M does too by default, and
    honor_clip_c=True makes clip_c=False switch the clip off."""
    w = make_params([(8, 4)], 5, F64)
    assert MARS_M(muon_params=w, clip_c=False).param_groups[0]["clip_c"] is True
    assert MARS_M(muon_params=w, clip_c=False, honor_clip_c=True).param_groups[0]["clip_c"] is False


# ------------------------------------------------------------------ (M18), MT12: the proof

def test_m18_efficient_recursion_is_unclipped_mars_m_symbolically():
    """By induction over t, with the oracle's own functions on sympy symbols: if
    M_{t-1} = gamma g_{t-1} + beta buf_{t-1}, then the unclipped (M15) momentum M_t equals
    efficient_argument(efficient_buffer(buf_{t-1}, g_t), g_t).  Base: M_0 = buf_0 = g_0 = 0."""
    g, g_prev, buf_prev = sp.symbols("g g_prev buf_prev")
    gamma, beta = sp.symbols("gamma beta", positive=True)

    def efficient(buf, grad):
        new = R.efficient_buffer(buf, grad, gamma, beta)
        return new, R.efficient_argument(new, grad, gamma, beta)

    _, base = efficient(0, g)
    assert sp.simplify(R.mars_m_momentum(0, g, 0, gamma, beta, clip=False) - base) == 0
    assert sp.simplify(base - (1 - beta + gamma * beta) * g) == 0  # MT12's step 1
    m_prev = R.efficient_argument(buf_prev, g_prev, gamma, beta)
    _, claim = efficient(buf_prev, g)
    assert sp.simplify(R.mars_m_momentum(m_prev, g, g_prev, gamma, beta, clip=False) - claim) == 0


def test_m18_numeric_over_fifty_steps():
    """The same identity on 50 random float64 steps (MT12): ~1e-16 relative."""
    rng = np.random.default_rng(0)
    gamma, beta = 0.025, 0.95
    m = buf = g_prev = np.zeros((5, 3))
    for _ in range(50):
        g = rng.normal(size=(5, 3))
        m = R.mars_m_momentum(m, g, g_prev, gamma, beta, clip=False)
        buf = R.efficient_buffer(buf, g, gamma, beta)
        np.testing.assert_allclose(R.efficient_argument(buf, g, gamma, beta), m,
                                   rtol=0, atol=2e-15 * np.abs(g).max())
        g_prev = g


# ------------------------------------------------------------------ the AdamW backup

def test_backup_puts_eps_before_the_bias_correction():
    """Step 1 with a large eps: u = m/(eps + sqrt v) * sqrt(bc2)/bc1 (the authors'), not
    torch AdamW's m/bc1 / (sqrt(v)/sqrt(bc2) + eps); the two differ, and the port is the first."""
    eps, lr = 0.1, 0.01
    p = make_params([(7,)], 6, F64)
    q = clone_params(p)
    g = [torch.full((7,), 0.05, dtype=F64)]
    opt = MARSM(p, lr=lr, weight_decay=0.0, adamw_eps=eps)
    adamw = torch.optim.AdamW(q, lr=lr, betas=(0.9, 0.95), eps=eps, weight_decay=0.0)
    x0 = p[0].detach().clone()
    feed(opt, p, g)
    feed(adamw, q, g)
    b1, b2 = 0.9, 0.95
    m, v = (1 - b1) * 0.05, (1 - b2) * 0.05**2
    ours = lr * (1 - b2) ** 0.5 / (1 - b1) * m / (eps + v**0.5)
    # the difference of O(1) iterates: a few ulps of |x0|
    torch.testing.assert_close(x0 - p[0], torch.full((7,), ours, dtype=F64), rtol=0, atol=1e-15)
    assert (x0 - q[0] - (x0 - p[0])).abs().min() > 1e-4  # torch's placement moves further
