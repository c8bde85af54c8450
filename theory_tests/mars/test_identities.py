"""The linear identities of MARS.md (M18-M20) and MT5, on the NumPy reference, over 50 random
float64 steps: the MARS side is ``reference.mars.mars_equations.corrected_gradient`` + ``momentum`` (no clip),
the other side the reference Lion / Nesterov SGD / the MARS_M_Efficient recursion.

Tolerances are absolute, scaled by the largest gradient entry seen (every quantity compared is a
bounded combination of past gradients); the measured worst cases are quoted next to each.
"""
import numpy as np
from hypothesis import given, strategies as st

from reference.common.first_order import lion as lion_ref, sgd as sgd_ref
from reference.mars.mars_equations import correction_coefficient, corrected_gradient, momentum

seeds = st.integers(0, 2**32 - 1)
unit = st.floats(0.0, 0.95)


@given(gamma=st.floats(0.0, 1.0), b1=unit, alpha=st.floats(-3, 3), seed=seeds)
def test_mt5_correction_is_linear_in_g_and_g_prev(gamma, b1, alpha, seed):
    rng = np.random.default_rng(seed)
    g, gp, h, hp = (rng.normal(size=(3, 4)) for _ in range(4))
    a = correction_coefficient(gamma, b1)
    c = corrected_gradient(g, gp, gamma, b1)
    # standard-normal entries (|.| < ~4 here): a few roundings of terms up to (1 + a) 4
    np.testing.assert_allclose(c, (1 + a) * g - a * gp, rtol=0, atol=1e-14 * (1 + a) * 4)
    lin = corrected_gradient(g + alpha * h, gp + alpha * hp, gamma, b1)
    np.testing.assert_allclose(lin, c + alpha * corrected_gradient(h, hp, gamma, b1), rtol=0,
                               atol=1e-14 * (1 + a) * 4 * (1 + abs(alpha)))  # a few roundings


def _gradient_stream(seed, n=50, size=7):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=size) * 10.0 ** rng.uniform(-2, 2) for _ in range(n)]


@given(b1=st.floats(0.0, 0.99), b2=st.floats(0.0, 0.999), seed=seeds)
def test_mt10_lion_argument_is_unclipped_mars_momentum(b1, b2, seed):
    """(M19) beta = b2, gamma = 1 - b1 / b2: the MARS momentum equals Lion's b1 m + (1-b1) g."""
    b1, b2 = min(b1, b2), max(b1, b2)
    if b2 == 0:
        b2 = 0.5
    gamma = 1 - b1 / b2
    m, g_prev, lion_state, g_max = np.zeros(7), np.zeros(7), {}, 0.0
    for g in _gradient_stream(seed):
        g_max = max(g_max, np.abs(g).max())
        m = momentum(m, corrected_gradient(g, g_prev, gamma, b2), b2)
        argument = b1 * lion_state.get("m", np.zeros(7)) + (1 - b1) * g
        direction = -lion_ref(np.zeros(7), g, lion_state, lr=1.0, betas=(b1, b2))
        # ~4 roundings on entries bounded by max|g| (measured 4e-16): 2e-15
        np.testing.assert_allclose(m, argument, rtol=0, atol=2e-15 * g_max)
        assert np.array_equal(direction, np.sign(argument))  # Lion's step is sign of that
        g_prev = g


@given(beta=st.floats(0.0, 0.999), seed=seeds)
def test_mt11_nesterov_is_mars_with_gamma_one_minus_beta(beta, seed):
    m, g_prev, sgd_state, g_max = np.zeros(7), np.zeros(7), {}, 0.0
    for g in _gradient_stream(seed):
        g_max = max(g_max, np.abs(g).max())
        m = momentum(m, corrected_gradient(g, g_prev, 1 - beta, beta), beta)
        nesterov = -sgd_ref(np.zeros(7), g, sgd_state, lr=1.0, momentum=beta, nesterov=True)
        # entries up to max|g| / (1 - beta); ~10 roundings (measured 1.5e-15 max|g|)
        np.testing.assert_allclose(m / (1 - beta), nesterov, rtol=0,
                                   atol=1e-14 * g_max / (1 - beta))
        g_prev = g


@given(beta=st.floats(0.01, 0.999), gamma=st.floats(0.0, 1.0), seed=seeds)
def test_mt12_mars_m_efficient_recursion(beta, gamma, seed):
    """(M18) buf <- beta buf + ((1-gamma)(1-beta)/beta) g; gamma g + beta buf = MARS momentum,
    including step 1 where both are (1 - beta + gamma beta) g_1."""
    m, g_prev, buf, g_max = np.zeros(7), np.zeros(7), np.zeros(7), 0.0
    for t, g in enumerate(_gradient_stream(seed)):
        g_max = max(g_max, np.abs(g).max())
        m = momentum(m, corrected_gradient(g, g_prev, gamma, beta), beta)
        buf = beta * buf + ((1 - gamma) * (1 - beta) / beta) * g
        # entries bounded by ~max|g|; a handful of roundings (measured 3.5e-16): 2e-15
        np.testing.assert_allclose(gamma * g + beta * buf, m, rtol=0, atol=2e-15 * g_max)
        if t == 0:
            np.testing.assert_allclose(m, (1 - beta + gamma * beta) * g, rtol=1e-15, atol=0)
        g_prev = g
