"""Hypothesis strategies shared by the MKOR reference tests (spec MKOR.md section 7).

Random matrices come from a drawn seed (NumPy Generator), so every example is
reproducible from hypothesis's output; scalars that matter for the bounds (d, gamma,
vector norms) are drawn directly so hypothesis can push them to their extremes.
"""
import numpy as np
import pytest
from hypothesis import strategies as st

EPS = np.finfo(np.float64).eps

dims = st.integers(min_value=1, max_value=32)
gammas = st.floats(min_value=0.01, max_value=0.99)
seeds = st.integers(min_value=0, max_value=2**32 - 1)
# log10 of a vector's norm: 1e-6 ... 1e6, as the brief asks.
log_norms = st.floats(min_value=-6.0, max_value=6.0)


def spd_pair(rng, d, log_lo=-1.0, log_hi=1.0):
    """(L, J) with L = Q diag(lam) Q^T, J = Q diag(1/lam) Q^T, lam log-uniform."""
    Q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    lam = 10.0 ** rng.uniform(log_lo, log_hi, size=d)
    return (Q * lam) @ Q.T, (Q / lam) @ Q.T


def vector_with_norm(rng, d, log_norm):
    """A random direction scaled to norm 10**log_norm."""
    v = rng.normal(size=d)
    return v * (10.0**log_norm / np.linalg.norm(v))


def eig_sym(M):
    """Eigenvalues of the symmetric part, ascending (spec 2.5: symmetrise first)."""
    return np.linalg.eigvalsh((M + M.T) / 2)


def cond_spd(M):
    """Condition number of an SPD matrix from its eigenvalues."""
    ev = eig_sym(M)
    return ev[-1] / ev[0]


CUBIC = ("inv", "solve", "eigh", "eig", "eigvals", "eigvalsh", "svd", "cholesky", "pinv",
         "lstsq", "det", "slogdet", "qr")


@pytest.fixture
def no_cubic_linalg(monkeypatch):
    """Make every O(d^3) numpy.linalg routine raise, in the public namespace and in the
    private module the public functions (e.g. norm(J, 2)) call internally."""
    def forbidden(*args, **kwargs):
        raise AssertionError("O(d^3) routine called inside the factor update")
    modules = [np.linalg] + [m for m in (getattr(np.linalg, "_linalg", None),
                                         getattr(np.linalg, "linalg", None)) if m is not None]
    for module in modules:
        for name in CUBIC:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, forbidden)
