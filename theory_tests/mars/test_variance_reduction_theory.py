"""Variance reduction, the theory behind the measurements in ``mars/test_variance_reduction.py``:
the seeded quadratics have the gradient moments they claim, the simulator is the reference's
MARS momentum, and the predicted noise weights, the exact-versus-approx criterion and the
closed forms follow from the reference recursion (sympy where algebraic)."""
import numpy as np
import pytest
import sympy as sp

from reference.mars.mars import MARSConfig, MARSReference
from reference.mars.mars_equations import corrected_gradient, momentum
from reference.common.problems import log_spaced_spectrum, make_quadratic
from reference.mars import variance_reduction as vr
from theory_tests.mars.test_variance_reduction import CONFIGS, D, BETA_PATH, config_id, assert_within


def test_quadratic_gradients_and_noise_moments():
    """grad f is the derivative of f (central differences are exact on a quadratic, up to
    rounding), grad f - grad F = tau W u + sigma eps, and E||W u||^2 = (d+1)||u||^2 (K SE)."""
    problem, _ = make_quadratic(log_spaced_spectrum(D, 100.0), sigma=0.7, tau=0.4, seed=5,
                                b_mean=np.arange(D) / D)
    rng = np.random.default_rng(0)
    xi = problem.sample(rng, 3)
    x = rng.normal(size=(3, D))
    h = 1e-3
    fd = np.stack([(problem.loss(x + h * e, xi) - problem.loss(x - h * e, xi)) / (2 * h)
                   for e in np.eye(D)], axis=-1)
    # f is quadratic: the central difference is exact; rounding of f (|f| < 50) over 2h: 1e-9
    np.testing.assert_allclose(fd, problem.gradient(x, xi), rtol=0, atol=1e-9)
    u = x - problem.x_star
    noise = problem.gradient(x, xi) - problem.full_gradient(x)
    expected = 0.4 * np.einsum("nij,nj->ni", xi.W, u) + 0.7 * xi.eps
    np.testing.assert_allclose(noise, expected, rtol=0, atol=1e-13)
    np.testing.assert_allclose(problem.full_gradient(problem.minimiser()), 0, atol=1e-13)
    # E||grad f - grad F||^2 over many draws at one point
    draws = problem.sample(rng, 20000)
    x0 = problem.x_star + np.array([1.0, -0.5, 0.25, 2.0])
    sq = np.sum((problem.gradient(np.broadcast_to(x0, (20000, D)), draws)
                 - problem.full_gradient(x0)) ** 2, axis=-1)
    assert_within(sq.mean(), sq.std(ddof=1) / np.sqrt(sq.size),
                  problem.gradient_noise_second_moment(x0), "E||grad f - grad F||^2")


def test_simulator_is_the_mars_reference_momentum():
    """The simulator's m_t is ``MARSReference``'s exp_avg (clip_scope="none") bit for bit, in
    both modes, when the optimizer is fed the same gradients (exact mode: prev_grads =
    grad f(x_{t-1}; xi_t))."""
    problem, Q = make_quadratic([1.0, 1.0, 0.3, 0.1], sigma=0.5, tau=0.5, seed=12)
    path = vr.rotation_path(problem.x_star + Q[:, 0], Q[:, :2], 0.3)
    configs = [vr.EstimatorConfig(0.3, "exact"), vr.EstimatorConfig(0.3, "approx")]
    _, errors, draws = vr.simulate(problem, configs, 0.9, path, 12, 5, 1, seed=3,
                                   record_errors=True)
    for ci, cfg in enumerate(configs):
        x = np.broadcast_to(path.x1, (5, D)).copy()
        opt = MARSReference([x], MARSConfig(betas=(0.9, 0.99), gamma=0.3, clip_scope="none",
                                            is_approx=cfg.mode == "approx"))
        x_prev = None
        for t, xi in enumerate(draws):
            prev = None if cfg.mode == "approx" or t == 0 else [problem.gradient(x_prev, xi)]
            opt.step([problem.gradient(x, xi)], prev)
            assert np.array_equal(opt.exp_avg[0] - problem.full_gradient(x), errors[ci, :, t])
            x_prev, x = x, path.advance(x, None, problem)


# ---------------------------------------------------------------------- derivations, symbolically

def test_noise_weights_and_factors_by_unrolling_the_reference_recursion():
    """Unroll corrected_gradient/momentum on symbols eps_1..eps_n (approx mode, additive noise):
    eps_{n-k} has weight (1-beta)(1+a) for k = 0 and (1-beta) beta^(k-1) ((1+a) beta - a) for
    k >= 1; summing their squares gives ``approx_noise_factor``; gamma = 0 gives the EMA's
    (1-beta)/(1+beta) and gamma = 1 gives 1."""
    beta, gamma = sp.symbols("beta gamma", positive=True)
    n = 6
    eps = sp.symbols(f"eps1:{n + 1}")
    a = gamma * beta / (1 - beta)
    m, g_prev = 0, 0
    for e in eps:
        m = momentum(m, corrected_gradient(e, g_prev, gamma, beta), beta)
        g_prev = e
    m = sp.expand(m)
    for k in range(n):
        if k == 0:
            weight = (1 - beta) * (1 + a)
        else:
            weight = (1 - beta) * beta ** (k - 1) * ((1 + a) * beta - a)
        assert sp.simplify(m.coeff(eps[n - 1 - k]) - weight) == 0
    w0 = (1 - beta) * (1 + a)
    # sum over k >= 1 of beta^(2(k-1)) = 1/(1 - beta^2)
    tail = ((1 - beta) * ((1 + a) * beta - a)) ** 2 / (1 - beta**2)
    assert sp.simplify(w0**2 + tail - vr.approx_noise_factor(beta, gamma)) == 0
    assert sp.simplify(vr.approx_noise_factor(beta, 0) - (1 - beta) / (1 + beta)) == 0
    assert sp.simplify(vr.approx_noise_factor(beta, 1) - 1) == 0


def test_exact_versus_approx_criterion_on_the_circle_symbolically():
    """exact - approx = gamma beta (1-beta+gamma beta) / ((1+beta)(1-beta)) (tau^2 (d+1) step^2
    - 2 (1-beta) V): its sign is ``exact_beats_approx_on_rotation``'s, for every gamma > 0."""
    beta, gamma, lam, r, step, sigma, tau, d = sp.symbols("beta gamma lam r step sigma tau d",
                                                          positive=True)
    kw = dict(lam=lam, radius=r, step=step, theta=0.3, sigma=sigma, tau=tau, d=d)
    diff = (vr.rotation_stationary_error(beta, gamma, "exact", **kw)
            - vr.rotation_stationary_error(beta, gamma, "approx", **kw))
    V = tau**2 * (d + 1) * r**2 + sigma**2 * d
    factored = gamma * beta * (1 - beta + gamma * beta) / ((1 + beta) * (1 - beta)) * (
        tau**2 * (d + 1) * step**2 - 2 * (1 - beta) * V)
    assert sp.simplify(diff - factored) == 0


def test_closed_forms_are_the_stationary_limit_of_the_exact_recursion():
    """Two independent derivations agree: the hand-derived stationary formulas and the
    mechanical second-moment recursion at t = 800 (transient ~ beta^1600 = 1e-36), every config,
    both paths, relative 1e-9."""
    problem, Q = make_quadratic(log_spaced_spectrum(D, 10.0), sigma=1.0, seed=11)
    path = vr.line_path(problem.x_star + Q[:, 1], 0.02 * Q[:, 0] + 0.05 * Q[:, 3])
    for cfg in CONFIGS:
        rec = vr.predicted_error(problem, cfg, BETA_PATH, path, 800)[-1]
        closed = vr.line_stationary_error(BETA_PATH, cfg.gamma, cfg.mode, problem.A @ path.v,
                                          1.0, D)
        assert rec == pytest.approx(closed, rel=1e-9), config_id(cfg)
    for theta, sigma, tau in [(0.1, 0.5, 0.5), (0.6, 0.0, 0.5), (1.3, 0.2, 0.1)]:
        problem, Q = make_quadratic([1.0, 1.0, 0.3, 0.1], sigma=sigma, tau=tau, seed=12)
        path = vr.rotation_path(problem.x_star + Q[:, 0] + 0.5 * Q[:, 2], Q[:, :2], theta)
        geometry = dict(lam=1.0, radius=np.sqrt(1.25), step=2 * np.sin(theta / 2), theta=theta,
                        sigma=sigma, tau=tau, d=D)
        for cfg in CONFIGS:
            rec = vr.predicted_error(problem, cfg, BETA_PATH, path, 800)[-1]
            closed = vr.rotation_stationary_error(BETA_PATH, cfg.gamma, cfg.mode, **geometry)
            assert rec == pytest.approx(closed, rel=1e-9), (theta, config_id(cfg))


def test_exact_beats_approx_criterion_is_the_sign_of_the_closed_forms():
    """``exact_beats_approx_on_rotation`` against the two closed forms it summarises
    (``rotation_stationary_error``, exact minus approx), at random geometries placed within 1%
    of the threshold tau^2 (d+1) step^2 = 2 (1-beta) V on either side, V = tau^2 (d+1) r^2 +
    sigma^2 d, and far from it; any gamma > 0 (the bias is the same in both modes)."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        beta, gamma = rng.uniform(0.5, 0.99), rng.uniform(0.01, 1.0)
        d, tau, radius = int(rng.integers(1, 10)), rng.uniform(0.1, 1.0), rng.uniform(0.5, 2.0)
        sigma = rng.choice([0.0, rng.uniform(0.0, 1.0)])
        V = tau**2 * (d + 1) * radius**2 + sigma**2 * d
        step = np.sqrt(2 * (1 - beta) * V / (tau**2 * (d + 1))) * rng.choice([0.99, 1.01, 0.3, 3])
        kw = dict(lam=1.0, radius=radius, step=step, theta=0.3, sigma=sigma, tau=tau, d=d)
        diff = (vr.rotation_stationary_error(beta, gamma, "exact", **kw)
                - vr.rotation_stationary_error(beta, gamma, "approx", **kw))
        verdict = vr.exact_beats_approx_on_rotation(beta, radius=radius, step=step, sigma=sigma,
                                                    tau=tau, d=d)
        assert verdict == (diff < 0), (beta, gamma, d, tau, radius, sigma, step)


@pytest.mark.parametrize("sigma, tau", [(1.0, 0.0), (0.5, 0.3)], ids=["additive", "multiplicative"])
def test_mean_square_rate_is_the_spectral_radius_of_the_moment_map(sigma, tau):
    """``mean_square_rate`` (a Kronecker-product operator) against the map it stands for,
    S -> M S M^T + P Q(S) P^T with Q(S) = tau^2 (tr(K S K^T) I + K S K^T) on the non-constant
    block, applied to every basis matrix and diagonalised; both modes, closed loop."""
    problem, Q = make_quadratic(log_spaced_spectrum(D, 10.0), sigma=sigma, tau=tau, seed=13)
    path = vr.ClosedLoop(problem.x_star + Q.sum(axis=1), 0.1)
    for cfg in (vr.EstimatorConfig(0.5, "exact"), vr.EstimatorConfig(0.5, "approx")):
        M, P, K = vr._transition(problem, cfg, 0.9, path, first_step=False)
        n = M.shape[0] - 1
        M, P, K = M[:n, :n], P[:n], K[:, :n]
        columns = []
        for j in range(n * n):
            S = np.zeros(n * n)
            S[j] = 1.0
            S = S.reshape(n, n)
            KSK = K @ S @ K.T
            columns.append((M @ S @ M.T + tau**2 * P @ (np.trace(KSK) * np.eye(D) + KSK)
                            @ P.T).ravel())
        rate = np.max(np.abs(np.linalg.eigvals(np.array(columns).T)))
        # two evaluations of one 256 x 256 eigenproblem's radius: rounding-level agreement
        assert vr.mean_square_rate(problem, cfg, 0.9, path) == pytest.approx(rate, rel=1e-9)
        assert rate < 1
