r"""The float64 oracle of MKOR's factor recursion with the factor itself formed explicitly, the
error measures of a kept (16-bit) inverse against it, and the bound LP5 states
(issue 47 item 3; ``paper_notes/low_precision_factors.md``).

**The explicit factor.** MKOR keeps only J = L^{-1}; here L is formed and updated as the
equations define it, in float64:

* the stabiliser's blend J <- zeta J + (1-zeta) I (K11) is, on the factor,
  L <- (zeta L^{-1} + (1-zeta) I)^{-1}; its ``"identity"`` reset is L <- I;
* "paper" (K8): L_t = rho L_{t-1} + (1-rho) v v^T (rho = ``stat_decay``);
* "released" (K10): L_t = (0.95 L_{t-1}^{-1} + 0.05 I)^{-1} + v v^T.

The caller says which of these a step applied (the run under measurement decides when its
stabiliser fires; the oracle follows the same decisions, so the error measured is the
arithmetic's and the storage's, not a different schedule's).

**Error measures** of a kept inverse \hat J against L (both d x d, L SPD):

.. math::
    e = \|\hat J L - I\|_2, \qquad
    \varepsilon = \|L^{1/2} \hat J L^{1/2} - I\|_2 = \max_i |\lambda_i(\hat J L) - 1|,

e the spectral norm the issue names, epsilon its symmetric (energy) form: (1 - epsilon) L^{-1}
<= \hat J <= (1 + epsilon) L^{-1} in the Loewner order, the preconditioner's relative error;
epsilon <= e (\hat J L - I is similar to the symmetric matrix).

**The bound** (first order in the unit roundoff; the derivation is in the notes page). With
S_t = \hat J_t - (its value computed in float32 before the write), |S_t| <= w |\hat J_t|
entrywise (w = u = 2^-8 for bf16 round-to-nearest, 2u for a stochastic write: less than one
ulp), so the write adds at most w kappa_t to epsilon, kappa_t = \|\hat J_t\|_\infty
\|L_t\|_2 (max row sum of |\hat J_t| times the factor's largest eigenvalue). The EMA
(K8) and the SM step (K10) never increase epsilon (rho L_{t-1} <= L_t, resp. L' <= L_t), and a
blend with weight zeta multiplies it by at most c = zeta lambda / (zeta lambda + 1 - zeta),
lambda = lambda_max(L^{-1}) before the blend (an identity reset: c = 0). Hence

.. math:: \varepsilon_t \le B_t = c_t B_{t-1} + w\,\kappa_t, \qquad B_0 = 0,

c_t = 1 on a step without a blend (and a ``float32_unit`` term per write covers the float32
arithmetic of the update).
"""
import numpy as np

__all__ = ["blend_factor", "explicit_factor_step", "factor_spectrum", "energy_error",
           "inverse_error", "blend_contraction", "write_error_scale", "error_bound_step"]

RELEASED_BLEND = 0.95  # K10's blend of the inverse with I (hard-coded in the released code)


def blend_factor(L, weight):
    """The factor after the inverse's blend J <- weight J + (1 - weight) I (K11, K10)."""
    d = L.shape[0]
    return np.linalg.inv(weight * np.linalg.inv(L) + (1 - weight) * np.eye(d))


def explicit_factor_step(L, v, *, variant, stat_decay, zeta, reset=None, update=True):
    """L_t from L_{t-1} (module docstring): ``reset`` None, "blend" (weight ``zeta``) or
    "identity" first, then the variant's update with ``v`` if ``update``."""
    L = np.asarray(L, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    if reset == "blend":
        L = blend_factor(L, zeta)
    elif reset == "identity":
        L = np.eye(L.shape[0])
    elif reset is not None:
        raise ValueError(f"reset must be None, 'blend' or 'identity', got {reset!r}")
    if not update:
        return L
    if variant == "paper":
        return stat_decay * L + (1 - stat_decay) * np.outer(v, v)
    if variant == "released":
        return blend_factor(L, RELEASED_BLEND) + np.outer(v, v)
    raise ValueError(f"variant must be 'paper' or 'released', got {variant!r}")


def factor_spectrum(L):
    """(eigenvalues ascending, eigenvectors) of the SPD factor L (symmetrised): what the
    measures below read; pass it to them to decompose L once per step."""
    return np.linalg.eigh((L + L.T) / 2)


def energy_error(J_hat, L, spectrum=None):
    """epsilon = ||L^{1/2} J_hat L^{1/2} - I||_2 (J_hat symmetrised first: a stored factor is
    symmetric; the oracle's L to round-off)."""
    w, U = factor_spectrum(L) if spectrum is None else spectrum
    root = (U * np.sqrt(np.clip(w, 0, None))) @ U.T
    J = (np.asarray(J_hat, dtype=np.float64) + np.asarray(J_hat, dtype=np.float64).T) / 2
    M = root @ J @ root - np.eye(L.shape[0])
    return float(np.abs(np.linalg.eigvalsh((M + M.T) / 2)).max())


def inverse_error(J_hat, L):
    """e = ||J_hat L - I||_2, the spectral norm."""
    return float(np.linalg.norm(np.asarray(J_hat, dtype=np.float64) @ L - np.eye(L.shape[0]), 2))


def blend_contraction(L, weight, spectrum=None):
    """c = weight lambda / (weight lambda + 1 - weight), lambda = lambda_max(L^{-1}) =
    1 / lambda_min(L): the most a blend of the inverse with weight ``weight`` keeps of
    epsilon."""
    lam = 1.0 / (factor_spectrum(L) if spectrum is None else spectrum)[0].min()
    return float(weight * lam / (weight * lam + 1 - weight))


def write_error_scale(J_hat, L, spectrum=None):
    """kappa = ||J_hat||_inf ||L||_2: a write with entrywise relative error w adds at most
    w kappa to epsilon."""
    row_sums = np.abs(np.asarray(J_hat, dtype=np.float64)).sum(axis=1).max()
    return float(row_sums * (factor_spectrum(L) if spectrum is None else spectrum)[0].max())


def error_bound_step(bound, contraction, unit, kappa):
    """B_t = c_t B_{t-1} + w kappa_t (module docstring)."""
    return contraction * bound + unit * kappa
