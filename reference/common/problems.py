r"""Seeded synthetic stochastic quadratics with an exact full gradient (NumPy float64).

    f(x; xi) = 1/2 (x - x*)^T A_xi (x - x*) + b_xi^T x,
    A_xi = A + tau W_xi,     b_xi = b_mean + sigma eps_xi,

with eps_xi ~ N(0, I_d) and W_xi = (Z + Z^T)/sqrt(2), Z a d x d matrix of i.i.d. N(0, 1)
entries (a symmetric Gaussian "Wigner" matrix), all independent. Since E[W] = 0 and
E[eps] = 0, the full objective and its gradient are exact:

    F(x) = E f(x; xi) = 1/2 (x - x*)^T A (x - x*) + b_mean^T x,
    grad F(x) = A (x - x*) + b_mean,
    grad f(x; xi) - grad F(x) = tau W_xi (x - x*) + sigma eps_xi.

* ``sigma`` is *additive* noise: the same vector at every x, so it cancels in
  grad f(x; xi) - grad f(y; xi) (the difference MARS's exact mode (M1) uses).
* ``tau`` is *multiplicative* (Hessian) noise: its size grows with the distance to x*, and
  grad f(x; xi) - grad f(y; xi) = (A + tau W_xi)(x - y) keeps a random part proportional to
  ||x - y||.

Second moment of the multiplicative part. E[W_ij W_kl] = delta_ik delta_jl + delta_il delta_jk
(the two ways a symmetric entry can pair up), so for any symmetric X,
E[W X W] = tr(X) I + X, and in particular E||W u||^2 = tr(E[W u u^T W]) = (d + 1) ||u||^2.
Hence the gradient noise has E||grad f - grad F||^2 = tau^2 (d + 1) ||x - x*||^2 + sigma^2 d
(``gradient_noise_second_moment``).

"Controlled conditioning": A = Q diag(lambda) Q^T with a seeded random orthogonal Q and the
eigenvalues chosen by the caller (``log_spaced_spectrum`` gives lambda_max / lambda_min =
``condition``). Every array method takes a batch of points x with shape (..., d) and a batch of
samples (one per row of the leading sample axis), so many seeds run at once.
"""
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Sample:
    """One draw of xi per row: eps (n, d); W (n, d, d) or None when tau = 0."""
    eps: np.ndarray
    W: np.ndarray | None


@dataclass(frozen=True)
class StochasticQuadratic:
    """f(x; xi) = 1/2 (x - x*)^T (A + tau W_xi)(x - x*) + (b_mean + sigma eps_xi)^T x."""
    A: np.ndarray
    x_star: np.ndarray
    b_mean: np.ndarray
    sigma: float = 0.0
    tau: float = 0.0

    @property
    def dim(self):
        return self.A.shape[0]

    @property
    def deterministic(self):
        """True when f(.; xi) = F for every xi (sigma = tau = 0)."""
        return self.sigma == 0.0 and self.tau == 0.0

    # ------------------------------------------------------------------ sampling

    def sample(self, rng, n):
        """n independent draws of xi (one per seed); W is only drawn when tau != 0."""
        d = self.dim
        eps = rng.standard_normal((n, d))
        W = None
        if self.tau != 0.0:
            Z = rng.standard_normal((n, d, d))
            W = (Z + np.swapaxes(Z, -1, -2)) / np.sqrt(2.0)
        return Sample(eps, W)

    # ------------------------------------------------------------------ the objective

    def _hessian_times(self, u, sample):
        """(A + tau W_xi) u for u with shape (..., n, d), row i of the n-axis using draw i."""
        out = u @ self.A  # A is symmetric: (A u)^T = u^T A
        if self.tau != 0.0:
            out = out + self.tau * (sample.W @ u[..., None])[..., 0]
        return out

    def _b(self, sample):
        return self.b_mean + self.sigma * sample.eps

    def loss(self, x, sample):
        """f(x; xi), shape (..., n)."""
        u = x - self.x_star
        return 0.5 * np.sum(u * self._hessian_times(u, sample), axis=-1) + np.sum(
            self._b(sample) * x, axis=-1)

    def gradient(self, x, sample):
        """grad f(x; xi) = (A + tau W_xi)(x - x*) + b_mean + sigma eps_xi, shape (..., n, d)."""
        return self._hessian_times(x - self.x_star, sample) + self._b(sample)

    def full_loss(self, x):
        """F(x) = E f(x; xi)."""
        u = x - self.x_star
        return 0.5 * np.sum(u * (u @ self.A), axis=-1) + x @ self.b_mean

    def full_gradient(self, x):
        """grad F(x) = A (x - x*) + b_mean, exact."""
        return (x - self.x_star) @ self.A + self.b_mean

    def minimiser(self):
        """argmin F = x* - A^{-1} b_mean."""
        return self.x_star - np.linalg.solve(self.A, self.b_mean)

    def gradient_noise_second_moment(self, x):
        """E||grad f(x; xi) - grad F(x)||^2 = tau^2 (d + 1) ||x - x*||^2 + sigma^2 d."""
        u = np.asarray(x) - self.x_star
        d = self.dim
        return self.tau**2 * (d + 1) * np.sum(u * u, axis=-1) + self.sigma**2 * d


def log_spaced_spectrum(d, condition, largest=1.0):
    """d eigenvalues from ``largest`` down to largest / condition, log-spaced."""
    if d == 1:
        return np.array([largest])
    return largest * condition ** (-np.arange(d) / (d - 1))


def random_orthogonal(rng, d):
    """A Haar-distributed orthogonal matrix (QR of a Gaussian with the sign fix)."""
    Q, R = np.linalg.qr(rng.standard_normal((d, d)))
    return Q * np.sign(np.diag(R))


def make_quadratic(eigenvalues, *, sigma=0.0, tau=0.0, seed=0, x_star=None, b_mean=None):
    """A StochasticQuadratic with A = Q diag(eigenvalues) Q^T, Q drawn from ``seed``.

    Returns (problem, Q): the columns of Q are A's eigenvectors, in the order of
    ``eigenvalues``, so a caller can place a path in a chosen eigenspace.
    """
    lam = np.asarray(eigenvalues, dtype=np.float64)
    d = lam.size
    rng = np.random.default_rng(seed)
    Q = random_orthogonal(rng, d)
    A = (Q * lam) @ Q.T
    A = (A + A.T) / 2
    x_star = rng.standard_normal(d) if x_star is None else np.asarray(x_star, dtype=np.float64)
    b_mean = np.zeros(d) if b_mean is None else np.asarray(b_mean, dtype=np.float64)
    return StochasticQuadratic(A, x_star, b_mean, float(sigma), float(tau)), Q
