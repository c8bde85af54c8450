r"""Symbolic and exact equivalences (spec MARS.md 2.1, 2.6, 2.8, MT10-MT12, MT15; MKOR.md 2.5).

Algebraic identities are proved with sympy on the reference's own functions
(``reference.mars.mars_equations.corrected_gradient``, ``momentum``: plain arithmetic, so they run on sympy
symbols unchanged), by induction: a base case and one recursion step mapping the claimed form at
t - 1 to the claimed form at t, with every coordinate independent (the recursions are
elementwise), so scalar symbols suffice. The identities whose two sides go through a
non-algebraic map (sign, Newton-Schulz) are checked as exact float64 recursions of the whole
reference optimizers.

Already proved elsewhere, and not repeated here (see ``paper_notes/claims.md``):

* the Newton-Schulz bound 1.2024 on (0, 1], derived exactly:
  ``common/test_newton_schulz.py::``
  ``test_sup_of_five_step_iterate_on_unit_interval_is_p_star_and_below_1_2024``;
* Sherman-Morrison, the corrected MKOR update as the inverse of the factor EMA, and Algorithm 1's
  printed line 7 not being one: ``mkor/test_sympy.py``;
* the numeric float64 forms of (M18)-(M20): ``mars/test_identities.py``.
"""
import numpy as np
import pytest
import sympy as sp

from reference.common.first_order import lion as lion_ref, muon as muon_ref
from reference.mars.mars import MARSConfig, MARSReference
from reference.mars.mars_equations import correction_coefficient, corrected_gradient, momentum
from reference.mkor.preconditioner import ema_inverse_update, sherman_morrison

beta, beta1, beta2, gamma = sp.symbols("beta beta1 beta2 gamma", positive=True)
g, g_prev, m_prev, buf_prev = sp.symbols("g g_prev m_prev buf_prev", real=True)


def mars_step(m, g_t, g_p, gam, b):
    """One unclipped MARS momentum step through the reference: (M2) then (M4)."""
    return momentum(m, corrected_gradient(g_t, g_p, gam, b), b)


def is_zero(expr):
    return sp.simplify(sp.expand(expr)) == 0


# ---------------------------------------------------------------------- MARS, algebraic

def test_unclipped_momentum_is_the_storm_form():
    """m_t = beta1 m + (1 - beta1) c_t with c_t = g + a (g - g_prev), a = gamma beta1/(1-beta1),
    expands to beta1 m + (1 - beta1) g + gamma beta1 (g - g_prev): gamma = 0 is the EMA,
    gamma = 1 is STORM's m_t = g_t + beta1 (m_{t-1} - g_prev)."""
    m = mars_step(m_prev, g, g_prev, gamma, beta1)
    assert is_zero(m - (beta1 * m_prev + (1 - beta1) * g + gamma * beta1 * (g - g_prev)))
    assert is_zero(correction_coefficient(gamma, beta1) * (1 - beta1) - gamma * beta1)
    assert is_zero(m.subs(gamma, 0) - (beta1 * m_prev + (1 - beta1) * g))
    assert is_zero(m.subs(gamma, 1) - (g + beta1 * (m_prev - g_prev)))


def test_lion_is_mars_approx_with_beta2_and_gamma_one_minus_ratio():
    """(M19), MT10, by induction. Lion: L_t = beta2 L_{t-1} + (1-beta2) g_t, argument
    Lambda_t = beta1 L_{t-1} + (1-beta1) g_t. Claim: MARS-approx with beta = beta2,
    gamma = 1 - beta1/beta2 (no clip) has m_t = Lambda_t. Base t = 1 (m_0 = L_0 = g_0 = 0):
    m_1 = (1 - beta1) g_1 = Lambda_1. Step: m_{t-1} = Lambda_{t-1} gives m_t = Lambda_t."""
    gam = 1 - beta1 / beta2
    L_before = sp.Symbol("L_before")  # L_{t-2}
    assert is_zero(mars_step(0, g, 0, gam, beta2) - (1 - beta1) * g)
    lambda_prev = beta1 * L_before + (1 - beta1) * g_prev       # Lambda_{t-1}
    L_prev = beta2 * L_before + (1 - beta2) * g_prev             # L_{t-1}
    assert is_zero(mars_step(lambda_prev, g, g_prev, gam, beta2)
                   - (beta1 * L_prev + (1 - beta1) * g))


def test_nesterov_and_muon_momentum_are_mars_approx_with_gamma_one_minus_beta():
    """(M20), MT11, by induction, with gamma = 1 - beta.

    SGD-Nesterov (torch: buf_1 = g_1, buf_t = beta buf_{t-1} + g_t, direction g_t + beta buf_t):
    m_t = (1 - beta)(g_t + beta buf_t). Muon's lerp buffer (``reference.common.first_order.muon``:
    B_t = beta B_{t-1} + (1 - beta) g_t, direction (1 - beta) g_t + beta B_t): m_t equals that
    direction exactly. Both bases at t = 1 use m_0 = g_0 = 0."""
    gam = 1 - beta
    # Nesterov: base (buf_1 = g_1) and step (m_{t-1} = (1-beta)(g_{t-1} + beta buf_{t-1}))
    assert is_zero(mars_step(0, g, 0, gam, beta) - (1 - beta) * (g + beta * g))
    nesterov_prev = (1 - beta) * (g_prev + beta * buf_prev)
    buf = beta * buf_prev + g
    assert is_zero(mars_step(nesterov_prev, g, g_prev, gam, beta) - (1 - beta) * (g + beta * buf))
    # Muon: base (B_0 = 0) and step (m_{t-1} = (1-beta) g_{t-1} + beta B_{t-1})
    assert is_zero(mars_step(0, g, 0, gam, beta) - ((1 - beta) * g + beta * (1 - beta) * g))
    muon_prev = (1 - beta) * g_prev + beta * buf_prev
    B = beta * buf_prev + (1 - beta) * g
    assert is_zero(mars_step(muon_prev, g, g_prev, gam, beta) - ((1 - beta) * g + beta * B))


def test_mars_m_efficient_recursion_is_unclipped_mars_m():
    """(M18), MT12, by induction: buf_t = beta buf_{t-1} + ((1-gamma)(1-beta)/beta) g_t and
    gamma g_t + beta buf_t = m_t. Base t = 0 (buf_0 = m_0 = g_0 = 0) is trivial, and t = 1 gives
    (1 - beta + gamma beta) g_1; step: m_{t-1} = gamma g_{t-1} + beta buf_{t-1} gives m_t."""
    def buf_step(b_prev, g_t):
        return beta * b_prev + ((1 - gamma) * (1 - beta) / beta) * g_t

    assert is_zero(mars_step(0, g, 0, gamma, beta) - (gamma * g + beta * buf_step(0, g)))
    assert is_zero(mars_step(0, g, 0, gamma, beta) - (1 - beta + gamma * beta) * g)
    m_prev_claim = gamma * g_prev + beta * buf_prev
    assert is_zero(mars_step(m_prev_claim, g, g_prev, gamma, beta)
                   - (gamma * g + beta * buf_step(buf_prev, g)))


def test_bias_corrected_momentum_for_constant_gradients_by_induction():
    """MT15: with g_t = g for all t (g_0 = 0), m_k = g ((1 - beta1^k) + a (1-beta1) beta1^(k-1)),
    so m_k / (1 - beta1^k) = g (1 + a (1-beta1) beta1^(k-1) / (1 - beta1^k)), and = g at gamma=0.
    Base k = 1: c_1 = (1 + a) g. Step k -> k + 1 (symbolic k): c = g, the correction vanishes."""
    k = sp.Symbol("k", positive=True, integer=True)
    a = correction_coefficient(gamma, beta1)

    def closed(kk):
        return g * ((1 - beta1**kk) + a * (1 - beta1) * beta1 ** (kk - 1))

    assert is_zero(mars_step(0, g, 0, gamma, beta1) - closed(1))
    assert sp.simplify(mars_step(closed(k), g, g, gamma, beta1) - closed(k + 1)) == 0
    m_hat = closed(k) / (1 - beta1**k)
    assert sp.simplify(m_hat - g * (1 + a * (1 - beta1) * beta1 ** (k - 1) / (1 - beta1**k))) == 0
    assert sp.simplify(m_hat.subs(gamma, 0) - g) == 0


# ---------------------------------------------------------------------- MARS, exact float64

def _gradient_stream(seed, n, shape):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=shape) * 10.0 ** rng.uniform(-1, 1) for _ in range(n)]


@pytest.mark.parametrize("betas", [(0.9, 0.99), (0.95, 0.98), (0.5, 0.9)])
def test_mars_lion_optimizer_is_lion(betas):
    """MARSReference("mars-lion", beta = beta2, gamma = 1 - beta1/beta2, clip_scope="none",
    wd 0) moves exactly like reference Lion(beta1, beta2): both step by -lr sign(.) of
    arguments equal to ~4 roundings (MT10), so the trajectories are bit-identical unless an
    argument entry is within rounding of 0 (not the case for these seeded Gaussian streams);
    lr = 2^-6 keeps p - lr sign exact."""
    b1, b2 = betas
    lr, shape = 2.0**-6, (5, 3)
    p_mars = [np.zeros(shape)]
    opt = MARSReference(p_mars, MARSConfig(lr=lr, betas=(b2, 0.999), gamma=1 - b1 / b2,
                                           mars_type="mars-lion", clip_scope="none"))
    p_lion, state = np.zeros(shape), {}
    for t, grad in enumerate(_gradient_stream(7, 60, shape)):
        p_mars = opt.step([grad])
        p_lion = lion_ref(p_lion, grad, state, lr=lr, betas=(b1, b2))
        assert np.array_equal(p_mars[0], p_lion), f"step {t + 1}"


@pytest.mark.parametrize("beta_, shape, eps, wd", [(0.95, (6, 4), 1e-8, 0.0),
                                                  (0.9, (3, 7), 1e-7, 0.01),
                                                  (0.5, (5, 5), 0.0, 0.1)])
def test_mars_shampoo_approx_is_muon(beta_, shape, eps, wd):
    """MARS-Shampoo-approx (official M12: s NS(m/(1-beta), eps), Newton-Schulz, no clip) with
    gamma = 1 - beta is Muon (``reference.common.first_order.muon``, Nesterov) with momentum beta and
    Newton-Schulz eps' = (1 - beta) eps: m_t = Muon's direction (proved above) and
    NS(m/(1-beta), eps) = NS(m, (1-beta) eps) because X_0 = m / (||m||_F + (1-beta) eps).

    Tolerance: the two NS inputs agree to delta ~ 1e-15 relative (a few roundings of each
    recursion), NS amplifies by <= 1100 (``common/test_newton_schulz.py``), the outputs are O(1), and the
    gradients do not depend on p, so differences add over T steps: |dp| <= T lr s (1100 delta +
    1e-12) + rounding of the decay forms; we allow T lr s 1e-11. Measured: 2.2e-14 T lr, one
    ulp of p ~ 1; the wrong eps' = eps would move each step by ~lr 1e-8 and fail."""
    lr, T = 0.01, 40
    scale = max(1.0, shape[0] / shape[1]) ** 0.5
    opt = MARSReference([np.ones(shape)], MARSConfig(
        lr=lr, betas=(beta_, 0.99), eps=eps, gamma=1 - beta_, weight_decay=wd,
        mars_type="mars-shampoo", clip_scope="none", orthogonalizer="newton_schulz"))
    p_muon, state = np.ones(shape), {}
    for t, grad in enumerate(_gradient_stream(8, T, shape)):
        p_mars = opt.step([grad])[0]
        p_muon = muon_ref(p_muon, grad, state, lr=lr, momentum=beta_, nesterov=True,
                          eps=(1 - beta_) * eps, weight_decay=wd)
        np.testing.assert_allclose(p_mars, p_muon, rtol=0, atol=(t + 1) * lr * scale * 1e-11)


# ---------------------------------------------------------------------- MKOR, Lemma 3.1

def _generic_psd(d, name="b"):
    """J = B B^T with a generic real B: every positive semi-definite J has this form."""
    B = sp.Matrix(d, d, lambda i, k: sp.Symbol(f"{name}{i}{k}", real=True))
    return B * B.T, B


def _generic_symmetric(d):
    """A generic symmetric J (entries j_ik = j_ki), a generic v, and their object arrays."""
    J = sp.Matrix(d, d, lambda i, k: sp.Symbol(f"j{min(i, k)}{max(i, k)}"))
    v = sp.Matrix(sp.symbols(f"v0:{d}", real=True))
    return J, v, np.array(J.tolist(), dtype=object), np.array(list(v), dtype=object)


def _denominators_of_the_code(d):
    """The denominators the reference's updates divide by, read off their outputs (not
    retyped): a rank-1 update J_t = (J - c J v v^T J / D) / gamma maps v to
    J_t v = J v (D - c q) / (gamma D), q = v^T J v, which is J v / D exactly when the code's
    D and c are the Lemma's (D = gamma + (1-gamma) q, c = 1 - gamma); so
    D_paper = q / (v^T ema_inverse_update(J, v, gamma) v). Likewise SM(J, v) v = J v / (1 + q),
    so the Sherman-Morrison denominator is 1 / (1 - v^T sherman_morrison(J, v) v).
    Generic symmetric J; returns (D_paper, D_sm, J, v) with J's entries free symbols."""
    J, v, J_arr, v_arr = _generic_symmetric(d)
    q = (v.T * J * v)[0, 0]
    D_paper = sp.cancel(q / (v_arr @ ema_inverse_update(J_arr, v_arr, gamma) @ v_arr))
    D_sm = sp.cancel(1 / (1 - v_arr @ sherman_morrison(J_arr, v_arr) @ v_arr))
    return D_paper, D_sm, J, v


@pytest.mark.parametrize("d", [2, 3])
def test_lemma_3_1_sm_denominator_is_at_least_one(d):
    """Lemma 3.1 / KT2 with a sum-of-squares certificate, on the code's own denominators
    (``_denominators_of_the_code``: a sign flip or a wrong weight in ``ema_inverse_update``
    fails here). For J = B B^T and gamma = 1/(1+s), s > 0 (i.e. gamma in (0, 1)), the "paper"
    update's D satisfies D / gamma - 1 = s ||B^T v||^2, a positive multiple of a sum of
    squares, so D / gamma = 1 + (1-gamma) gamma^-1 v^T J v >= 1 and the division is never by
    ~0. The "released" update is SM(J', v) with J' = 0.95 J + 0.05 I (the blend is K10's,
    retyped here with exact rationals; ``released_inverse_update`` itself uses float weights,
    tested numerically in ``mkor/test_torch_factors.py::``
    ``test_released_update_is_sm_of_the_blended_inverse_and_stays_in_its_bounds``): its SM
    denominator exceeds 1 by 0.95||B^T v||^2 + 0.05||v||^2."""
    D_paper, D_sm, J, v = _denominators_of_the_code(d)
    B_J, B = _generic_psd(d)
    s = sp.Symbol("s", positive=True)
    as_psd = {J[i, k]: B_J[i, k] for i in range(d) for k in range(d)}
    certificate = s * sum(x**2 for x in (B.T * v))
    D_over_gamma = D_paper.subs(as_psd).subs(gamma, 1 / (1 + s)) * (1 + s)
    assert sp.simplify(D_over_gamma - 1 - certificate) == 0
    assert certificate.is_nonnegative
    blend = sp.Rational(95, 100) * B_J + sp.Rational(5, 100) * sp.eye(d)
    released = (sp.Rational(95, 100) * sum(x**2 for x in (B.T * v))
                + sp.Rational(5, 100) * sum(x**2 for x in v))
    as_blend = {J[i, k]: blend[i, k] for i in range(d) for k in range(d)}
    assert sp.expand(D_sm.subs(as_blend) - 1 - released) == 0 and released.is_nonnegative


def test_lemma_3_1_denominator_is_the_determinant_ratio(d=2):
    """The matrix determinant lemma on the reference's output: det(J_t) gamma^(d-1) D = det(J),
    D = gamma + (1-gamma) v^T J v, the denominator the code divides by
    (``_denominators_of_the_code``: checked equal here, so a sign flip in
    ``ema_inverse_update`` fails). With D >= gamma > 0 (above), det J_t > 0 whenever
    det J > 0, and together with J_t = (gamma J^{-1} + (1-gamma) v v^T)^{-1}
    (``mkor/test_sympy.py``), a PD-plus-PSD inverse, J_t stays SPD with no damping. The
    Sherman-Morrison step under "released" (applied to J' = 0.95 J + 0.05 I) likewise divides
    by 1 + v^T J v and has det(SM(J, v)) (1 + v^T J v) = det J.
    Generic symmetric 2 x 2 J (the 3 x 3 determinant of the rational output takes minutes in
    sympy; the inverse identities themselves are proved for 3 x 3 in ``mkor/test_sympy.py``)."""
    D_code, D_sm_code, J, v = _denominators_of_the_code(d)
    J_arr, v_arr = np.array(J.tolist(), dtype=object), np.array(list(v), dtype=object)
    q = (v.T * J * v)[0, 0]
    D = gamma + (1 - gamma) * q
    assert sp.expand(D_code - D) == 0 and sp.expand(D_sm_code - (1 + q)) == 0
    J_t = sp.Matrix(ema_inverse_update(J_arr, v_arr, gamma).tolist())
    assert sp.cancel(J_t.det() * gamma ** (d - 1) * D - J.det()) == 0
    J_sm = sp.Matrix(sherman_morrison(J_arr, v_arr).tolist())
    assert sp.cancel(J_sm.det() * (1 + q) - J.det()) == 0
