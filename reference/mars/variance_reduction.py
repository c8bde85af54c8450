r"""MARS's estimator error E||m_t - grad F(x_t)||^2 on stochastic quadratics (spec MARS.md 2.1).

Three things live here:

1. ``simulate``: Monte Carlo over many seeds at once. The estimator is the reference's own
   equations -- ``reference.mars.mars_equations.corrected_gradient`` (M1 exact / M2 approx) and
   ``reference.mars.mars.momentum`` (M4), unclipped -- run along a path x_t that is either
   prescribed (independent of the estimator: ``AffinePath``) or driven by the estimator
   (``ClosedLoop``: x_{t+1} = x_t - lr m_t, i.e. (M5) with H_t = I, via
   ``reference.mars.mars.decoupled_step``). Every configuration (gamma, mode) sees the same noise
   (common random numbers), so paired differences between configurations are sharp.

2. ``predicted_error``: the exact E||m_t - grad F(x_t)||^2 at every t, from a second-moment
   recursion. On a quadratic with the noise of ``reference.common.problems`` everything is linear in
   the state s_t = (u_t, u_{t-1}, m_{t-1}, g_{t-1}, 1), u = x - x*, driven by a noise vector
   nu_t that is conditionally mean-zero with covariance
   tau^2 (||K s_t||^2 I + K s_t s_t^T K^T) + sigma^2 I (E[W X W] = tr(X) I + X). So
   S_t = E[s_t s_t^T] obeys S_{t+1} = M S_t M^T + P Q(S_t) P^T exactly (no stationarity, no
   Gaussian approximation), including step 1 where g_prev = 0.

3. Closed forms (``*_stationary_*``) for the paths where the algebra is short; the derivations
   are in their docstrings, and the tests compare them with both 1. and 2.

Notation: beta = beta1, a = gamma beta / (1 - beta), e_t = m_t - grad F(x_t),
Delta_t = x_t - x_{t-1}.
"""
from dataclasses import dataclass

import numpy as np

from .mars_equations import correction_coefficient, corrected_gradient, decoupled_step, momentum

MODES = ("exact", "approx")


@dataclass(frozen=True)
class EstimatorConfig:
    """One MARS estimator: gamma and the mode of the correction (M1 "exact", M2 "approx")."""
    gamma: float
    mode: str

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")


def grid(gammas, modes=MODES):
    """Every (gamma, mode) pair, modes outermost."""
    return [EstimatorConfig(float(g), m) for m in modes for g in gammas]


# ---------------------------------------------------------------------- paths

@dataclass(frozen=True)
class AffinePath:
    """A prescribed path, independent of the estimator: u_{t+1} = R u_t + v, u = x - x*."""
    x1: np.ndarray
    R: np.ndarray
    v: np.ndarray

    def advance(self, x, m, problem):
        u = x - problem.x_star
        return problem.x_star + u @ self.R.T + self.v


@dataclass(frozen=True)
class ClosedLoop:
    """The estimator drives the iterate: x_{t+1} = x_t - lr m_t ((M5) with H_t = I)."""
    x1: np.ndarray
    lr: float

    def advance(self, x, m, problem):
        return decoupled_step(x, m, self.lr, 0.0)


def line_path(x1, velocity):
    """x_t = x_1 + (t - 1) v: constant drift, so grad F(x_t) - grad F(x_{t-1}) = A v."""
    d = len(x1)
    return AffinePath(np.asarray(x1, float), np.eye(d), np.asarray(velocity, float))


def rotation_path(x1, plane, theta):
    """x_t - x* rotated by theta per step in span(plane[:, 0], plane[:, 1]) (orthonormal).

    ||x_t - x*|| and ||Delta_t|| are constant; the part of x_1 - x* outside the plane stays put.
    """
    e1, e2 = plane[:, 0], plane[:, 1]
    c, s = np.cos(theta), np.sin(theta)
    R = (np.eye(len(e1)) + (c - 1) * (np.outer(e1, e1) + np.outer(e2, e2))
         + s * (np.outer(e2, e1) - np.outer(e1, e2)))
    return AffinePath(np.asarray(x1, float), R, np.zeros(len(e1)))


# ---------------------------------------------------------------------- Monte Carlo

@dataclass
class EstimatorStats:
    """Results of ``simulate`` for C configurations and S seeds.

    seed_means[c, s]: the mean of ||e_t||^2 over the last ``window`` steps of seed s; seeds are
    independent, so ``mean`` +- ``se`` (the standard error over seeds) estimates the window
    average of E||e_t||^2 without any assumption on the time correlation within a seed.
    per_step[c, t-1]: the seed average of ||e_t||^2 at each t (diagnostics).
    """
    configs: list
    seed_means: np.ndarray
    per_step: np.ndarray
    window: int

    @property
    def mean(self):
        return self.seed_means.mean(axis=1)

    @property
    def se(self):
        return self.seed_means.std(axis=1, ddof=1) / np.sqrt(self.seed_means.shape[1])

    def index(self, gamma, mode):
        return self.configs.index(EstimatorConfig(float(gamma), mode))

    def paired_difference(self, first, second):
        """(mean, se) of the per-seed difference first - second, configs given as indices."""
        diff = self.seed_means[first] - self.seed_means[second]
        return diff.mean(), diff.std(ddof=1) / np.sqrt(diff.size)


def simulate(problem, configs, beta1, path, n_steps, n_seeds, window, seed=0,
             record_errors=False):
    """Run every config in ``configs`` for ``n_steps`` steps on ``n_seeds`` seeds at once.

    Step t = 1, 2, ...: draw xi_t (one per seed, shared by the configs); g_t = grad f(x_t; xi_t);
    g_prev = grad f(x_{t-1}; xi_t) (exact, M1) or g_{t-1} (approx, M2), and 0 at t = 1 in both
    (the official first step); c_t = corrected_gradient(g_t, g_prev, gamma, beta1);
    m_t = momentum(m_{t-1}, c_t, beta1), m_0 = 0; e_t = m_t - grad F(x_t); then x_{t+1} from
    the path. No clip (the variance-reduction analysis is about the unclipped recursion).

    With ``record_errors`` the full error vectors e_t (C, S, T, d) and the noise draws are
    returned too (for pathwise identities; keep S and T small then).
    """
    configs = list(configs)
    C, S, d = len(configs), n_seeds, problem.dim
    gamma = np.array([c.gamma for c in configs]).reshape(C, 1, 1)
    exact = np.array([c.mode == "exact" for c in configs]).reshape(C, 1, 1)
    rng = np.random.default_rng(seed)
    x = np.broadcast_to(np.asarray(path.x1, float), (C, S, d)).copy()
    m = np.zeros((C, S, d))
    g_last = np.zeros((C, S, d))
    x_prev = None
    sums = np.zeros((C, S))
    per_step = np.zeros((C, n_steps))
    errors, draws = ([], []) if record_errors else (None, None)
    for t in range(1, n_steps + 1):
        xi = problem.sample(rng, S)
        g = problem.gradient(x, xi)
        if t == 1:
            g_prev = np.zeros_like(g)
        elif exact.any():
            g_prev = np.where(exact, problem.gradient(x_prev, xi), g_last)
        else:
            g_prev = g_last
        c = corrected_gradient(g, g_prev, gamma, beta1)
        m = momentum(m, c, beta1)
        e = m - problem.full_gradient(x)
        err = np.sum(e * e, axis=-1)
        per_step[:, t - 1] = err.mean(axis=1)
        if t > n_steps - window:
            sums += err
        if record_errors:
            errors.append(e)
            draws.append(xi)
        g_last, x_prev = g, x
        x = path.advance(x, m, problem)
    stats = EstimatorStats(configs, sums / window, per_step, window)
    if record_errors:
        return stats, np.stack(errors, axis=2), draws
    return stats


# ---------------------------------------------------------------------- exact moments

def _blocks(d):
    """Slices of the state s = (u_t, u_{t-1}, m_{t-1}, g_{t-1}, 1) in R^{4d+1}."""
    return {name: slice(i * d, (i + 1) * d) for i, name in enumerate(("u", "up", "m", "gp"))}


def _transition(problem, config, beta1, path, first_step):
    """(M, P, K) of s_{t+1} = M s_t + P nu_t, with nu_t the step's gradient noise.

    approx (and step 1 of both modes, where g_prev = 0 is the stored g_0 = 0):
        g_t = A u_t + b + nu_t,  nu_t = tau W_t u_t + sigma eps_t            (K s = u_t)
        c_t = (1 + a) g_t - a g_{t-1}
    exact (t >= 2): g_prev = grad f(x_{t-1}; xi_t) has the *same* W_t and eps_t, so
        c_t = (1 + a) A u_t - a A u_{t-1} + b + nu_t,
        nu_t = tau W_t ((1 + a) u_t - a u_{t-1}) + sigma eps_t     (K s = (1+a) u_t - a u_{t-1})
    then m_t = beta m_{t-1} + (1 - beta) c_t, and u_{t+1} = R u_t + v (prescribed) or
    u_t - lr m_t (closed loop).
    """
    A, b, d = problem.A, problem.b_mean, problem.dim
    n = 4 * d + 1
    blk, one = _blocks(d), n - 1
    I = np.eye(d)
    beta, a = beta1, correction_coefficient(config.gamma, beta1)
    approx = config.mode == "approx" or first_step
    M, P, K = np.zeros((n, n)), np.zeros((n, d)), np.zeros((d, n))
    # m_t row
    M[blk["m"], blk["m"]] = beta * I
    if approx:
        M[blk["m"], blk["u"]] = (1 - beta) * (1 + a) * A
        M[blk["m"], blk["gp"]] = -(1 - beta) * a * I
        M[blk["m"], one] = (1 - beta) * (1 + a) * b
        P[blk["m"]] = (1 - beta) * (1 + a) * I
        K[:, blk["u"]] = I
    else:
        M[blk["m"], blk["u"]] = (1 - beta) * (1 + a) * A
        M[blk["m"], blk["up"]] = -(1 - beta) * a * A
        M[blk["m"], one] = (1 - beta) * b
        P[blk["m"]] = (1 - beta) * I
        K[:, blk["u"]] = (1 + a) * I
        K[:, blk["up"]] = -a * I
    # g_t row (only read by approx steps): A u_t + b + nu_t in approx; unused in exact
    if approx:
        M[blk["gp"], blk["u"]] = A
        M[blk["gp"], one] = b
        P[blk["gp"]] = I
    # u_{t+1} row
    if isinstance(path, ClosedLoop):
        M[blk["u"]] = -path.lr * M[blk["m"]]
        M[blk["u"], blk["u"]] += I
        P[blk["u"]] = -path.lr * P[blk["m"]]
    else:
        M[blk["u"], blk["u"]] = path.R
        M[blk["u"], one] = path.v
    M[blk["up"], blk["u"]] = I
    M[one, one] = 1.0
    return M, P, K


def predicted_error(problem, config, beta1, path, n_steps):
    """Exact E||m_t - grad F(x_t)||^2 for t = 1..n_steps (array), for ``simulate``'s process.

    S_{t+1} = M S_t M^T + P Q(S_t) P^T with Q(S) = tau^2 (tr(K S K^T) I + K S K^T)
    + sigma^2 S_{one,one} I, the conditional covariance of nu_t averaged over s_t (it is
    mean-zero given s_t, so no cross terms); e_t = m_t - A u_t - b reads s_{t+1}.
    """
    A, b, d = problem.A, problem.b_mean, problem.dim
    n = 4 * d + 1
    blk, one = _blocks(d), n - 1
    s1 = np.zeros(n)
    s1[blk["u"]] = np.asarray(path.x1, float) - problem.x_star
    s1[one] = 1.0
    S = np.outer(s1, s1)
    E = np.zeros((d, n))
    E[:, blk["m"]] = np.eye(d)
    E[:, blk["up"]] = -A
    E[:, one] = -b
    later = _transition(problem, config, beta1, path, first_step=False)
    out = np.empty(n_steps)
    for t in range(1, n_steps + 1):
        M, P, K = _transition(problem, config, beta1, path, True) if t == 1 else later
        KSK = K @ S @ K.T
        Q = (problem.tau**2 * (np.trace(KSK) * np.eye(d) + KSK)
             + problem.sigma**2 * S[one, one] * np.eye(d))
        S = M @ S @ M.T + P @ Q @ P.T
        S = (S + S.T) / 2
        out[t - 1] = np.trace(E @ S @ E.T)
    return out


def mean_square_rate(problem, config, beta1, path):
    """Spectral radius of the homogeneous part of S -> M S M^T + P Q(S) P^T (t >= 2).

    Below 1 the second moments converge geometrically at this rate (mean-square stability),
    so a transient of size C shrinks below C rate^t after t steps.
    """
    M, P, K = _transition(problem, config, beta1, path, first_step=False)
    n = M.shape[0] - 1
    M, P, K = M[:n, :n], P[:n], K[:, :n]
    PK = P @ K
    op = np.kron(M, M) + problem.tau**2 * (np.kron(PK, PK)
                                           + np.outer((P @ P.T).ravel(), (K.T @ K).ravel()))
    return float(np.max(np.abs(np.linalg.eigvals(op))))


# ---------------------------------------------------------------------- closed forms

def ema_noise_factor(beta1):
    r"""(1 - beta) / (1 + beta): the stationary variance of an EMA of i.i.d. unit noise.

    n_t = beta n_{t-1} + (1 - beta) eps_t  =>  Var n = (1 - beta)^2 / (1 - beta^2).
    """
    return (1 - beta1) / (1 + beta1)


def approx_noise_factor(beta1, gamma):
    r"""Stationary Var(noise part of e_t) / Var(eps) in approx mode (M2), additive noise.

    c_t's noise is (1 + a) eps_t - a eps_{t-1}; unrolling m_t, eps_{t-k} has weight
    (1 - beta)(1 + a) for k = 0 and (1 - beta) beta^{k-1} ((1 + a) beta - a) for k >= 1, where
    (1 + a)(1 - beta) = 1 - beta + gamma beta and (1 + a) beta - a = beta (1 - gamma). Summing
    squares: (1 - beta + gamma beta)^2 + (1 - beta) beta^2 (1 - gamma)^2 / (1 + beta)
        = (1 - beta)/(1 + beta) + 2 gamma beta (1 - beta + gamma beta)/(1 + beta).
    gamma = 0: the EMA's (1 - beta)/(1 + beta); gamma = 1: exactly 1 (then m_t = g_t).
    """
    b = beta1
    return (1 - b) / (1 + b) + 2 * gamma * b * (1 - b + gamma * b) / (1 + b)


def line_stationary_error(beta1, gamma, mode, drift, sigma, d):
    r"""E||e_t||^2 for large t on x_t = x_1 + (t-1) v with additive noise only (tau = 0).

    Bias: grad F(x_t) - grad F(x_{t-1}) = A v =: D. In both modes E c_t = grad F(x_t) + a D, so
    E e_t = beta E e_{t-1} - beta D + (1 - beta) a D = beta E e_{t-1} - beta (1 - gamma) D,
    with fixed point -beta (1 - gamma) D / (1 - beta) (the EMA's lag, removed at gamma = 1).
    Noise: exact mode cancels sigma eps_t in the difference (same xi_t at both points), so the
    noise part is the EMA of sigma eps_t whatever gamma: (1 - beta)/(1 + beta) sigma^2 d;
    approx mode: ``approx_noise_factor`` sigma^2 d. The two parts are uncorrelated.
    """
    bias = (beta1 * (1 - gamma) / (1 - beta1)) ** 2 * float(np.sum(np.square(drift)))
    factor = ema_noise_factor(beta1) if mode == "exact" else approx_noise_factor(beta1, gamma)
    return bias + factor * sigma**2 * d


def rotation_stationary_error(beta1, gamma, mode, *, lam, radius, step, theta, sigma, tau, d):
    r"""E||e_t||^2 for large t on ``rotation_path``: x_t - x* turns by theta per step in an
    eigenplane of A (eigenvalue lam, double), r = ||x_t - x*|| (constant; a part outside the
    plane stays put), step = ||Delta_t|| = 2 r_plane sin(theta/2); additive (sigma) and
    multiplicative (tau) noise.

    Bias: E e_t = beta E e_{t-1} - beta (1 - gamma) lam Delta_t with Delta_t rotating by theta:
    the fixed point is -beta (1 - gamma) lam sum_k beta^k Delta_{t-k}, of squared norm
    beta^2 (1 - gamma)^2 lam^2 step^2 / |1 - beta e^{-i theta}|^2
    = beta^2 (1 - gamma)^2 lam^2 step^2 / (1 - 2 beta cos(theta) + beta^2).
    Noise, approx: g_t's noise zeta_t = tau W_t u_t + sigma eps_t is independent over t with
    E||zeta||^2 = tau^2 (d+1) r^2 + sigma^2 d =: V, so ``approx_noise_factor`` V.
    Noise, exact: the difference keeps tau W_t Delta_t, so c_t's noise is
    tau W_t (u_t + a Delta_t) + sigma eps_t, independent over t, with
    ||u_t + a Delta_t||^2 = r^2 + 2a u_t.Delta_t + a^2 step^2 = r^2 + a(1 + a) step^2
    (u_t.Delta_t = r_plane^2 (1 - cos theta) = step^2 / 2):
    (1 - beta)/(1 + beta) (V + tau^2 (d+1) a(1+a) step^2).
    The correction's extra noise is proportional to ||x_t - x_{t-1}||^2.
    """
    a = correction_coefficient(gamma, beta1)
    bias = (beta1 * (1 - gamma) * lam * step) ** 2 / (1 - 2 * beta1 * np.cos(theta) + beta1**2)
    V = tau**2 * (d + 1) * radius**2 + sigma**2 * d
    if mode == "exact":
        return bias + ema_noise_factor(beta1) * (V + tau**2 * (d + 1) * a * (1 + a) * step**2)
    return bias + approx_noise_factor(beta1, gamma) * V


def exact_beats_approx_on_rotation(beta1, *, radius, step, sigma, tau, d):
    r"""Whether exact mode has the smaller stationary error on ``rotation_stationary_error``'s
    circle, for every gamma in (0, 1] (the bias is the same in both modes):

    exact - approx = (1-beta)/(1+beta) tau^2 (d+1) a(1+a) step^2
                     - 2 gamma beta (1-beta+gamma beta) V/(1+beta),
    and (1 - beta) a (1 + a) = gamma beta (1 - beta + gamma beta)/(1 - beta), so
    exact < approx  <=>  tau^2 (d+1) step^2 < 2 (1 - beta) V, independent of gamma.
    With sigma = 0: step^2 / r^2 = 2(1 - cos theta) < 2(1 - beta), i.e. cos(theta) > beta.
    """
    V = tau**2 * (d + 1) * radius**2 + sigma**2 * d
    return tau**2 * (d + 1) * step**2 < 2 * (1 - beta1) * V


def storm_exact_error(beta1, sigma, d, t):
    r"""E||e_t||^2 at every t for gamma = 1, exact mode, additive noise, on *any* path.

    With gamma = 1, (1 - beta) a = beta, and the difference of gradients at the same xi_t is
    A Delta_t exactly, so e_t = beta e_{t-1} + (1 - beta) sigma eps_t with e_1 = sigma eps_1
    (c_1 = (1 + a) g_1 and (1 - beta)(1 + a) = 1): no lag term at all, whatever drives x_t.
    E||e_t||^2 = sigma^2 d (beta^{2(t-1)} + (1 - beta)^2 (1 - beta^{2(t-1)}) / (1 - beta^2)).
    """
    t = np.asarray(t, dtype=float)
    b2 = beta1 ** (2 * (t - 1))
    return sigma**2 * d * (b2 + (1 - beta1) ** 2 * (1 - b2) / (1 - beta1**2))
