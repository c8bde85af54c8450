r"""Variance reduction, measured: MARS's estimator error E||m_t - grad F(x_t)||^2 (spec MARS.md
2.1, 2.7) on the seeded stochastic quadratics of ``reference/common/problems.py``.

The estimator is the reference's unclipped recursion (``corrected_gradient`` (M1)/(M2) and
``momentum`` (M4)), simulated by ``reference.mars.variance_reduction.simulate`` for
gamma in {0, 0.025, 0.1, 0.5, 1} (0 = plain EMA, 1 = STORM) in exact and approx mode, every
configuration on the same noise. e_t = m_t - grad F(x_t), beta = beta1, a = gamma beta/(1-beta).

What is predicted (derivations in ``reference/mars/variance_reduction.py``, summarised here):

* Additive noise, g_t = grad F(x_t) + sigma eps_t, on the prescribed line x_t = x_1 + (t-1) v:
    E e_t -> -beta (1 - gamma) A v / (1 - beta)      (the EMA's lag, gone at gamma = 1),
    noise  = (1-beta)/(1+beta) sigma^2 d                       (exact, any gamma: eps cancels),
           = [(1-beta)/(1+beta) + 2 gamma beta (1-beta+gamma beta)/(1+beta)] sigma^2 d   (approx).
  So gamma = 1 in exact mode removes the lag and keeps the EMA's variance, and exact beats
  approx by 2 gamma beta (1-beta+gamma beta)/(1+beta) sigma^2 d for every gamma > 0.
* Multiplicative noise, grad f = (A + tau W_xi)(x - x*) + sigma eps, on a circle about x*: the
  exact difference keeps tau W_t Delta_t, which adds (1-beta)/(1+beta) tau^2 (d+1) a(1+a)
  ||Delta||^2; exact beats approx iff tau^2 (d+1) ||Delta||^2 < 2 (1-beta) E||g - grad F||^2
  (for sigma = 0: iff cos(theta) > beta), whatever gamma > 0. Both sides are tested.
* Closed loop x_{t+1} = x_t - lr m_t: the exact second-moment recursion
  (``predicted_error``) gives E||e_t||^2 at every t; for gamma = 1 in exact mode with additive
  noise e_t is the EMA of sigma eps_t *pathwise*, whatever the feedback.
* Deterministic loss: exact and approx coincide bit for bit (MT7).

Statistics. Each seed contributes the mean of ||e_t||^2 over the last ``WINDOW`` steps; seeds are
independent, so the mean over seeds has standard error SE = sd / sqrt(seeds) with no assumption
on the time correlation inside a seed. Every statistical assertion is
|measured - predicted| <= K SE with K = 5: under the CLT a correct prediction fails with
probability 5.7e-7 per assertion (about 1e-4 for the ~100 assertions here), and the seeds are
fixed, so the outcome is reproducible. Differences between two configurations use the per-seed
(paired) differences and their own SE. Where a comparison is meant to discriminate, the test
also asserts the predicted effect exceeds 2 K SE, so the test has power against "no effect".
A closed form is only compared with the simulation after checking that the exact recursion's
window average equals it to 1e-3 SE (the transient is gone).
"""
import numpy as np
import pytest

from reference.common.problems import log_spaced_spectrum, make_quadratic
from reference.mars import variance_reduction as vr

K = 5.0                      # standard errors allowed between measurement and prediction
GAMMAS = (0.0, 0.025, 0.1, 0.5, 1.0)
CONFIGS = vr.grid(GAMMAS)
POSITIVE = GAMMAS[1:]
D = 4
EPS = np.finfo(np.float64).eps

# Prescribed paths: beta = 0.95 (the MARS default). Transient ~ beta^(2 * 300) = 4e-14.
BETA_PATH, STEPS_PATH, WINDOW, SEEDS = 0.95, 600, 300, 800
# Closed loop: beta = 0.9; the exact recursion covers the transient, so no burn-in is needed.
BETA_LOOP, STEPS_LOOP, LR = 0.9, 600, 0.1


def config_id(c):
    return f"{c.mode}-gamma{c.gamma:g}"


def assert_within(measured, se, predicted, what):
    z = (measured - predicted) / se
    assert abs(measured - predicted) <= K * se, (
        f"{what}: measured {measured:.6g} +- {se:.2g} (SE), predicted {predicted:.6g}, z = {z:.2f}")


class Case:
    """A simulation shared by the tests of one problem class (run once per module)."""

    def __init__(self, problem, beta, path, steps, seeds=SEEDS, seed=0):
        self.problem, self.beta, self.path, self.steps = problem, beta, path, steps
        self.stats = vr.simulate(problem, CONFIGS, beta, path, steps, seeds, WINDOW, seed=seed)
        self._exact = {}

    def exact_window(self, config):
        """The exact window average of E||e_t||^2 (second-moment recursion)."""
        if config not in self._exact:
            pred = vr.predicted_error(self.problem, config, self.beta, self.path, self.steps)
            self._exact[config] = pred[-WINDOW:].mean()
        return self._exact[config]

    def measured(self, config):
        i = self.stats.index(config.gamma, config.mode)
        return self.stats.mean[i], self.stats.se[i]

    def paired(self, first, second):
        return self.stats.paired_difference(self.stats.index(first.gamma, first.mode),
                                            self.stats.index(second.gamma, second.mode))


# ---------------------------------------------------------------------- problem classes

def _additive_line(seeds=SEEDS):
    problem, Q = make_quadratic(log_spaced_spectrum(D, 10.0), sigma=1.0, seed=11)
    velocity = 0.02 * Q[:, 0] + 0.05 * Q[:, 3]  # A v = 0.02 q0 + 0.005 q3
    path = vr.line_path(problem.x_star + Q[:, 1], velocity)
    return Case(problem, BETA_PATH, path, STEPS_PATH, seeds)


def _rotation(theta, sigma, tau, seeds=SEEDS):
    lam = 1.0
    problem, Q = make_quadratic([lam, lam, 0.3, 0.1], sigma=sigma, tau=tau, seed=12)
    x1 = problem.x_star + Q[:, 0] + 0.5 * Q[:, 2]  # r_plane = 1, plus a fixed out-of-plane part
    case = Case(problem, BETA_PATH, vr.rotation_path(x1, Q[:, :2], theta), STEPS_PATH, seeds)
    case.geometry = dict(lam=lam, radius=np.sqrt(1.25), step=2 * np.sin(theta / 2), theta=theta,
                         sigma=sigma, tau=tau, d=D)
    return case


def _closed_loop(sigma, tau, seeds=SEEDS):
    problem, Q = make_quadratic(log_spaced_spectrum(D, 10.0), sigma=sigma, tau=tau, seed=13)
    path = vr.ClosedLoop(problem.x_star + Q.sum(axis=1), LR)
    return Case(problem, BETA_LOOP, path, STEPS_LOOP, seeds)


# theta = 0.1: cos(theta) = 0.995 > beta, exact should win; theta = 0.6: cos = 0.825 < beta.
ROTATIONS = {"small-step": (0.1, 0.5, 0.5), "large-step": (0.6, 0.0, 0.5)}


@pytest.fixture(scope="module")
def additive_line():
    return _additive_line()


@pytest.fixture(scope="module", params=list(ROTATIONS))
def rotation(request):
    return _rotation(*ROTATIONS[request.param])


@pytest.fixture(scope="module", params=["additive", "multiplicative"])
def closed_loop(request):
    return _closed_loop(*{"additive": (1.0, 0.0), "multiplicative": (0.5, 0.3)}[request.param])


def line_closed_form(case, config):
    return vr.line_stationary_error(case.beta, config.gamma, config.mode,
                                    case.problem.A @ case.path.v, case.problem.sigma, D)


def rotation_closed_form(case, config):
    return vr.rotation_stationary_error(case.beta, config.gamma, config.mode, **case.geometry)


def assert_closed_form_applies(case, config, closed_form):
    """The stationary formula equals the exact window average (transient gone) to 1e-3 SE."""
    _, se = case.measured(config)
    assert abs(case.exact_window(config) - closed_form) <= 1e-3 * se


# ---------------------------------------------------------------------- additive noise, line

@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_additive_line_error_matches_the_closed_form(additive_line, config):
    closed = line_closed_form(additive_line, config)
    assert_closed_form_applies(additive_line, config, closed)
    assert_within(*additive_line.measured(config), closed, config_id(config))


def test_additive_gamma_one_removes_the_lag_and_keeps_the_ema_variance(additive_line):
    """Exact mode: gamma = 1 error = (1-beta)/(1+beta) sigma^2 d (no bias), gamma = 0 (EMA) adds
    exactly the lag (beta/(1-beta))^2 ||A v||^2, which is far above the noise of the test."""
    case, beta = additive_line, BETA_PATH
    ema_variance = vr.ema_noise_factor(beta) * D
    storm, ema = vr.EstimatorConfig(1.0, "exact"), vr.EstimatorConfig(0.0, "exact")
    assert_within(*case.measured(storm), ema_variance, "STORM error = EMA variance")
    lag = (beta / (1 - beta)) ** 2 * np.sum((case.problem.A @ case.path.v) ** 2)
    diff, se = case.paired(ema, storm)
    assert_within(diff, se, lag, "EMA - STORM = lag bias")
    assert lag > 2 * K * se


@pytest.mark.parametrize("gamma", POSITIVE)
def test_additive_exact_beats_approx_by_the_predicted_margin(additive_line, gamma):
    """approx - exact = 2 gamma beta (1 - beta + gamma beta)/(1 + beta) sigma^2 d > 0."""
    beta = BETA_PATH
    predicted = 2 * gamma * beta * (1 - beta + gamma * beta) / (1 + beta) * D
    diff, se = additive_line.paired(vr.EstimatorConfig(gamma, "approx"),
                                    vr.EstimatorConfig(gamma, "exact"))
    assert_within(diff, se, predicted, f"approx - exact at gamma={gamma}")
    assert predicted > 2 * K * se


def test_gamma_zero_is_the_same_estimator_in_both_modes(additive_line):
    """a = 0: both corrections vanish, so the two modes are bit-identical (MT1's premise)."""
    s = additive_line.stats
    assert np.array_equal(s.seed_means[s.index(0.0, "exact")], s.seed_means[s.index(0.0, "approx")])


# ---------------------------------------------------------------------- multiplicative, circle

@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_rotation_error_matches_the_closed_form(rotation, config):
    closed = rotation_closed_form(rotation, config)
    assert_closed_form_applies(rotation, config, closed)
    assert_within(*rotation.measured(config), closed, f"theta={rotation.geometry['theta']} "
                  + config_id(config))


@pytest.mark.parametrize("gamma", POSITIVE)
def test_exact_beats_approx_iff_the_step_is_small(rotation, gamma):
    """The winner is the one ``exact_beats_approx_on_rotation`` predicts (for sigma = 0: exact
    iff cos(theta) > beta), and the measured gap matches the predicted one."""
    exact, approx = vr.EstimatorConfig(gamma, "exact"), vr.EstimatorConfig(gamma, "approx")
    predicted = rotation_closed_form(rotation, exact) - rotation_closed_form(rotation, approx)
    g = rotation.geometry
    exact_wins = vr.exact_beats_approx_on_rotation(BETA_PATH, radius=g["radius"], step=g["step"],
                                                   sigma=g["sigma"], tau=g["tau"], d=D)
    assert exact_wins == (predicted < 0)
    assert exact_wins == (g["theta"] < 0.3)  # the two fixtures sit on either side
    if g["sigma"] == 0:
        assert exact_wins == (np.cos(g["theta"]) > BETA_PATH)
    diff, se = rotation.paired(exact, approx)
    assert_within(diff, se, predicted, f"exact - approx at gamma={gamma}")
    assert abs(predicted) > 2 * K * se


def test_exact_correction_noise_grows_with_the_step(rotation):
    """In exact mode the correction's extra variance is (1-beta)/(1+beta) tau^2 (d+1) a(1+a)
    ||Delta||^2: measured as the gamma = 1 error minus its bias-free, Delta-free part."""
    g, beta = rotation.geometry, BETA_PATH
    a = 1.0 * beta / (1 - beta)
    V = g["tau"] ** 2 * (D + 1) * g["radius"] ** 2 + g["sigma"] ** 2 * D
    extra = vr.ema_noise_factor(beta) * g["tau"] ** 2 * (D + 1) * a * (1 + a) * g["step"] ** 2
    mean, se = rotation.measured(vr.EstimatorConfig(1.0, "exact"))
    assert_within(mean - vr.ema_noise_factor(beta) * V, se, extra, "extra exact-mode noise")
    assert extra > 2 * K * se


# ---------------------------------------------------------------------- closed loop

@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_closed_loop_error_matches_the_exact_moment_recursion(closed_loop, config):
    assert vr.mean_square_rate(closed_loop.problem, config, BETA_LOOP, closed_loop.path) < 1
    assert_within(*closed_loop.measured(config), closed_loop.exact_window(config),
                  config_id(config))


@pytest.mark.parametrize("gamma", POSITIVE)
def test_closed_loop_exact_beats_approx(closed_loop, gamma):
    exact, approx = vr.EstimatorConfig(gamma, "exact"), vr.EstimatorConfig(gamma, "approx")
    predicted = closed_loop.exact_window(exact) - closed_loop.exact_window(approx)
    diff, se = closed_loop.paired(exact, approx)
    assert predicted < -2 * K * se
    assert_within(diff, se, predicted, f"exact - approx at gamma={gamma}")


def test_closed_loop_storm_error_is_the_ema_of_the_noise_whatever_the_feedback():
    """Additive noise, gamma = 1. Exact mode: e_t = beta e_{t-1} + (1-beta) sigma eps_t with
    e_1 = sigma eps_1, pathwise, although x_t depends on the noise; the recursion and
    ``storm_exact_error`` agree at every t. Approx mode: m_t = g_t, so e_t = sigma eps_t.

    Rounding: with M >= max |g|, each step rounds c_t = (1+a) g - a g_prev at ~4 (1+a) eps M;
    (1-beta) of it enters m and decays by beta, so m carries <= 4 (1+a) eps M, plus eps M for
    m - grad F: tolerance 16 (1+a) eps M (measured: 0.4 eps M). M = 5 (1 + max|eps|) bounds |g|
    here: |grad F(x_t)| <= ||A|| ||x_t - x*|| starts at 2 and the loop contracts."""
    sigma, beta, steps = 1.0, BETA_LOOP, 120
    problem, Q = make_quadratic(log_spaced_spectrum(D, 10.0), sigma=sigma, seed=13)
    path = vr.ClosedLoop(problem.x_star + Q.sum(axis=1), LR)
    configs = [vr.EstimatorConfig(1.0, "exact"), vr.EstimatorConfig(1.0, "approx")]
    _, errors, draws = vr.simulate(problem, configs, beta, path, steps, 64, 1, seed=4,
                                   record_errors=True)
    eps = np.stack([xi.eps for xi in draws], axis=1)  # (S, T, d)
    ema = np.empty_like(eps)
    ema[:, 0] = sigma * eps[:, 0]
    for t in range(1, steps):
        ema[:, t] = beta * ema[:, t - 1] + (1 - beta) * sigma * eps[:, t]
    a = beta / (1 - beta)
    M = 5 * (1 + np.abs(eps).max())
    np.testing.assert_allclose(errors[0], ema, rtol=0, atol=16 * (1 + a) * EPS * M)
    np.testing.assert_allclose(errors[1], sigma * eps, rtol=0, atol=16 * (1 + a) * EPS * M)
    t = np.arange(1, steps + 1)
    np.testing.assert_allclose(vr.predicted_error(problem, configs[0], beta, path, steps),
                               vr.storm_exact_error(beta, sigma, D, t), rtol=1e-12)


def test_closed_loop_storm_statistics(closed_loop):
    """gamma = 1, exact: the window average of E||e_t||^2 from ``storm_exact_error`` (additive
    noise, exact at every t) or the recursion (multiplicative: the W_t Delta_t term remains)."""
    storm = vr.EstimatorConfig(1.0, "exact")
    mean, se = closed_loop.measured(storm)
    if closed_loop.problem.tau == 0:
        t = np.arange(STEPS_LOOP - WINDOW + 1, STEPS_LOOP + 1)
        predicted = vr.storm_exact_error(BETA_LOOP, closed_loop.problem.sigma, D, t).mean()
        assert predicted == pytest.approx(closed_loop.exact_window(storm), rel=1e-12)
    else:
        predicted = closed_loop.exact_window(storm)
        ema_only = vr.ema_noise_factor(BETA_LOOP) * closed_loop.problem.sigma**2 * D
        assert predicted - ema_only > 2 * K * se  # multiplicative noise survives the correction
    assert_within(mean, se, predicted, "STORM closed loop")


@pytest.mark.parametrize("gamma", GAMMAS)
def test_deterministic_loss_exact_equals_approx(gamma):
    """MT7 for the estimator: with sigma = tau = 0, grad f(x_{t-1}; xi_t) = g_{t-1} recomputed,
    so both modes give the same m_t bit for bit, on the closed loop (where x_t depends on m)."""
    problem, Q = make_quadratic(log_spaced_spectrum(D, 10.0), seed=14, b_mean=np.ones(D))
    path = vr.ClosedLoop(problem.x_star + Q.sum(axis=1), LR)
    configs = [vr.EstimatorConfig(gamma, "exact"), vr.EstimatorConfig(gamma, "approx")]
    _, errors, _ = vr.simulate(problem, configs, BETA_LOOP, path, 200, 2, 1, record_errors=True)
    assert np.array_equal(errors[0], errors[1])
    assert np.all(np.isfinite(errors))


# ---------------------------------------------------------------------- more seeds

@pytest.mark.slow
def test_all_cases_with_ten_times_the_seeds():
    """The same predictions with 8000 seeds: SE ~3x smaller, same K."""
    cases = [(_additive_line(8000), line_closed_form)]
    cases += [(_rotation(*spec, seeds=8000), rotation_closed_form) for spec in ROTATIONS.values()]
    for case, closed_form in cases:
        for cfg in CONFIGS:
            closed = closed_form(case, cfg)
            assert_closed_form_applies(case, cfg, closed)
            assert_within(*case.measured(cfg), closed, config_id(cfg))
    for sigma, tau in [(1.0, 0.0), (0.5, 0.3)]:
        case = _closed_loop(sigma, tau, seeds=8000)
        for cfg in CONFIGS:
            assert_within(*case.measured(cfg), case.exact_window(cfg), config_id(cfg))
