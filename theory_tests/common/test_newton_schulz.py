r"""Newton-Schulz (M13) and the SVD polar factor (M11): the bounds are derived, then checked on
matrices, for the NumPy reference and the torch port (float64, float32, bfloat16).

Derivation (MT13).  One step maps X = U diag(s) V^T to U diag(p(s)) V^T with the quintic
p(s) = a s + b s^3 + c s^5, (a, b, c) = (3.4445, -4.7750, 2.0315), and X_0 = M / (||M||_F + eps)
has every singular value in [0, 1].  So the output singular values are p^5(s_i).

* p(s) / s = a + b x + c x^2 (x = s^2) has discriminant b^2 - 4ac < 0 and a > 0: p > 0 on
  (0, inf), so singular values stay positive and are exactly the iterates (no |.| folding).
* p' = a + 3b s^2 + 5c s^4 has two positive roots s1 = 0.5545 < s2 = 1.0501: p rises to
  P* = p(s1) = 1.2023686..., falls to p(s2) = 0.6818..., then rises.  p(P*) = 0.9465 < P*, so
  p maps [0, P*] into [0, P*]; (0, 1] lies inside, so p^5((0, 1]) is in (0, P*].
* The image of an interval under a continuous p is the interval spanned by p at the endpoints
  and the interior critical points.  Iterating that rule with exact algebraic numbers (sympy)
  gives the exact images p^5([0, 1]) = [0, P*], p^5([0.0014, 1]) = [0.64005..., P*] and
  p^5([0.01, 1]) = [0.681831..., 1.134357...].  These are exact, hence both certified and tight.

Note for MARS.md MT13 (d): the spec's [0.682, 1.134] for s >= 0.01 is rounded *inward*; the
attained extremes are 0.681831 and 1.134357, so the certified band is [0.6818, 1.1344].
"""
import functools

import numpy as np
import pytest
import sympy as sp
import torch
from hypothesis import given, strategies as st

from reference.common.matrix_functions import NS_COEFFICIENTS, newton_schulz as ns_ref, \
    orthogonalize_svd as svd_ref, quintic
from torch_impl.common import matrix_functions as tmf

# ------------------------------------------------------------------ exact scalar analysis

S = sp.Symbol("s", real=True)
A_, B_, C_ = (sp.Rational(str(k)) for k in NS_COEFFICIENTS)  # the decimals, exactly
P = A_ * S + B_ * S**3 + C_ * S**5


def p_exact(value):
    return sp.expand(P.subs(S, value))


@functools.lru_cache(maxsize=None)
def critical_points():
    """Positive roots of p' = a + 3b s^2 + 5c s^4 (a quadratic in x = s^2), ascending."""
    x = sp.Symbol("x")
    roots = sp.solve(A_ + 3 * B_ * x + 5 * C_ * x**2, x)
    assert all(r.is_real and r > 0 for r in roots) and len(roots) == 2
    return tuple(sorted((sp.sqrt(r) for r in roots), key=lambda r: sp.N(r, 50)))


def p_star():
    return p_exact(critical_points()[0])


def _by_value(v):
    # exact algebraic numbers; the 60-digit evaluation only orders distinct candidates
    return sp.N(v, 60)


def exact_image(lo, hi, k=1):
    """The exact image p^k([lo, hi]): endpoints plus interior critical points, k times."""
    for _ in range(k):
        points = [lo, hi] + [q for q in critical_points() if lo <= q <= hi]
        values = [p_exact(q) for q in points]
        lo, hi = min(values, key=_by_value), max(values, key=_by_value)
    return lo, hi


P_STAR = float(sp.N(p_star(), 30))  # 1.2023686051632128
BAND_0014 = (0.640, 1.2024)         # MT13 (d), certified below
BAND_001 = (0.6818, 1.1344)         # MT13 (d), outward-rounded exact image (see module doc)
# bf16 iteration: p is flat at its maximiser s1 (p' = 0), so only the last step's roundings
# (three terms <= 2.8, 2^-9 each, and the final cast) can lift a value above P*: <= 0.02;
# measured 0.012 over 2e4 random inputs.
BF16_EXCESS = 0.03


def iterate_quintic(s, steps=5):
    for _ in range(steps):
        s = quintic(s)
    return s


def test_torch_and_reference_use_the_same_coefficients():
    assert tuple(tmf.NS_COEFFICIENTS) == tuple(NS_COEFFICIENTS)
    s = np.linspace(0, 1.3, 101)
    np.testing.assert_allclose(quintic(s), [float(P.subs(S, sp.Float(v, 30))) for v in s],
                               rtol=1e-14, atol=1e-15)  # float64 evaluation of a degree-5 poly


def test_quintic_is_positive_on_the_positive_axis():
    assert A_ > 0 and B_**2 - 4 * A_ * C_ < 0  # p(s)/s = a + b x + c x^2 > 0 for all x = s^2


def test_quintic_shape_rises_falls_rises():
    s1, s2 = critical_points()
    dp = sp.diff(P, S)
    assert sp.N(s1, 20) < 0.5546 < sp.N(s2, 20)
    for probe, sign in ((s1 / 2, 1), ((s1 + s2) / 2, -1), (s2 + 1, 1)):  # leading coeff 5c > 0
        assert sp.sign(dp.subs(S, probe)) == sign


def test_sup_of_five_step_iterate_on_unit_interval_is_p_star_and_below_1_2024():
    s1, s2 = critical_points()
    star = p_star()
    # [0, P*] is invariant: p(P*) < P* and the local max of p on [0, P*] is p(s1) = P*.
    assert s2 < star and p_exact(star) < star
    assert exact_image(sp.Integer(0), star) == (0, star)
    lo, hi = exact_image(sp.Integer(0), sp.Integer(1), k=5)
    assert lo == 0 and sp.simplify(hi - star) == 0  # attained: the supremum is a maximum
    assert 1.2023 < P_STAR <= 1.2024


def test_certified_bands_for_small_singular_values():
    lo, hi = exact_image(sp.Rational("0.0014"), sp.Integer(1), k=5)
    assert BAND_0014[0] <= lo and hi <= BAND_0014[1]
    assert lo < 0.6401  # tight: the band cannot start higher
    lo, hi = exact_image(sp.Rational("0.01"), sp.Integer(1), k=5)
    assert BAND_001[0] <= lo and hi <= BAND_001[1]
    # MARS.md rounds this band inward to [0.682, 1.134]; both extremes are attained beyond it.
    assert lo < 0.682 and hi > 1.134


def test_grid_cross_check_with_lipschitz_bound():
    """Independent numeric check: the grid max of p^5 on [0, 1] is within L h of P*, where
    L = (max |p'| on [0, P*])^5 bounds the slope of p^5 (all iterates stay in [0, P*])."""
    x = sp.Symbol("x")  # |p'| on [0, P*] peaks at an endpoint or the vertex of the quadratic in x
    dpx = A_ + 3 * B_ * x + 5 * C_ * x**2
    vertex = -3 * B_ / (10 * C_)
    slope = max(abs(float(dpx.subs(x, v))) for v in (0, vertex, p_star() ** 2))
    lipschitz = slope**5
    grid = np.linspace(0.0, 1.0, 400_001)
    h = grid[1] - grid[0]
    values = iterate_quintic(grid)
    assert values.max() <= P_STAR * (1 + 1e-15)  # float64 evaluation error only
    assert values.max() >= P_STAR - lipschitz * h
    mask = grid >= 0.01
    assert values[mask].min() >= BAND_001[0] - 1e-15 and values[mask].max() <= BAND_001[1]


# ------------------------------------------------------------------ matrices

def random_orthogonal(rng, n):
    q, r = np.linalg.qr(rng.normal(size=(n, n)))
    return q * np.sign(np.diag(r))


@st.composite
def svd_matrices(draw, min_ratio=1e-3):
    """M = U diag(sigma) V^T with chosen singular values (log-uniform in [min_ratio, 1] times a
    random scale), returned with its factors."""
    rows, cols = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    k = min(rows, cols)
    sigma = np.sort(np.exp(rng.uniform(np.log(min_ratio), 0.0, size=k)))[::-1]
    sigma = sigma * 10.0 ** draw(st.floats(-3, 3))
    U = random_orthogonal(rng, rows)[:, :k]
    V = random_orthogonal(rng, cols)[:, :k]
    return (U * sigma) @ V.T, U, sigma, V, rng


def _ns_torch(dtype, in_dtype=torch.float64):
    def run(M, eps=1e-7):
        return tmf.newton_schulz(torch.tensor(M, dtype=in_dtype), eps=eps, dtype=dtype) \
            .double().numpy()
    return run


# Tolerances (absolute, on outputs whose singular values are <= 1.21):
# float64: matmul rounding ~1e-16 per step, amplified by at most L = max|p'|^5 ~ 1e3 -> 1e-12.
# float32: unit roundoff 6e-8; each step sums terms up to |a|+|b|+|c| ~ 10 into a value >= 0.6
#   (x15 cancellation), over 5 steps -> ~1e-5; measured 1.4e-6.
IMPLS = {
    "numpy-f64": (lambda M, eps=1e-7: ns_ref(M, eps=eps), 1e-12),
    "torch-f64": (_ns_torch(torch.float64), 1e-12),
    "torch-f32": (_ns_torch(torch.float32, torch.float32), 2e-5),
}
impls = pytest.mark.parametrize("impl", list(IMPLS))


@impls
@given(data=svd_matrices(), log_k=st.floats(-3, 3))
def test_scale_invariance(impl, data, log_k):
    ns, tol = IMPLS[impl]
    M, k = data[0], 10.0**log_k
    np.testing.assert_allclose(ns(k * M, eps=0.0), ns(M, eps=0.0), rtol=0, atol=tol)
    # with eps > 0, X_0 changes by a factor 1 + delta, delta <= eps max(1, 1/k) / ||M||_F; the
    # output moves by at most L delta with L = max|p'|^5 < 1100 (test_grid_cross_check...)
    eps = 1e-7
    delta = eps * max(1.0, 1.0 / k) / np.linalg.norm(M)
    np.testing.assert_allclose(ns(k * M, eps=eps), ns(M, eps=eps), rtol=0,
                               atol=tol + 1100 * delta)


@impls
@given(data=svd_matrices())
def test_transpose_rule(impl, data):
    ns, tol = IMPLS[impl]
    M = data[0]
    np.testing.assert_allclose(ns(M.T), ns(M).T, rtol=0, atol=tol)


@impls
@given(data=svd_matrices())
def test_orthogonal_equivariance(impl, data):
    ns, tol = IMPLS[impl]
    M, rng = data[0], data[4]
    U2, V2 = random_orthogonal(rng, M.shape[0]), random_orthogonal(rng, M.shape[1])
    np.testing.assert_allclose(ns(U2 @ M @ V2.T), U2 @ ns(M) @ V2.T, rtol=0, atol=tol)


@impls
@given(data=svd_matrices())
def test_singular_vectors_kept_and_values_follow_the_quintic(impl, data):
    """U^T NS(M) V = diag(p^5(sigma_i / (||M||_F + eps))): diagonal, with the scalar orbit."""
    ns, tol = IMPLS[impl]
    M, U, sigma, V, _ = data
    eps = 1e-7
    expected = np.diag(iterate_quintic(sigma / (np.linalg.norm(M) + eps)))
    np.testing.assert_allclose(U.T @ ns(M, eps=eps) @ V, expected, rtol=0, atol=tol)


def _check_bands(ns, tol, M, sigma):
    """Every output singular value <= P*; the MT13 (d) bands wherever they apply; returns which
    bands applied."""
    out = np.linalg.svd(ns(M), compute_uv=False)
    assert out.max() <= P_STAR + tol
    ratio = sigma / np.linalg.norm(M)  # eps = 1e-7 shrinks s by < 1e-7 / ||M||_F relative:
    slack = tol + 1100 * 1e-7 / np.linalg.norm(M)  # the output moves by < L times that
    applied = []
    for band, threshold in ((BAND_0014, 0.0014), (BAND_001, 0.01)):
        if ratio.min() >= threshold:
            assert out.min() >= band[0] - slack and out.max() <= band[1] + slack
            applied.append(threshold)
    return applied


@impls
@given(data=svd_matrices(min_ratio=1e-4))
def test_output_singular_values_within_certified_bounds(impl, data):
    ns, tol = IMPLS[impl]
    _check_bands(ns, tol, data[0], data[2])


@impls
@given(data=svd_matrices(min_ratio=0.03))
def test_well_spread_singular_values_land_in_both_bands(impl, data):
    ns, tol = IMPLS[impl]  # min sigma / ||sigma|| >= 0.03 / sqrt(7) > 0.01: both bands apply
    assert _check_bands(ns, tol, data[0], data[2]) == [0.0014, 0.01]


@pytest.mark.parametrize("impl", list(IMPLS) + ["torch-bf16"])
@pytest.mark.parametrize("shape", [(3, 5), (5, 3), (4, 4), (1, 1)])
def test_zero_in_zero_out(impl, shape):
    ns = _ns_torch(torch.bfloat16) if impl == "torch-bf16" else IMPLS[impl][0]
    out = ns(np.zeros(shape))
    assert out.shape == shape and np.all(out == 0)


@given(data=svd_matrices())
def test_torch_float64_matches_reference(data):
    M = data[0]
    # same operations, only summation order may differ: a few ulps, amplified by L < 1100
    np.testing.assert_allclose(_ns_torch(torch.float64)(M), ns_ref(M), rtol=0, atol=1e-12)


@given(data=svd_matrices(), batch=st.integers(1, 3))
def test_torch_batched_equals_per_matrix(data, batch):
    M, rng = data[0], data[4]
    stack = torch.tensor(np.stack([M * rng.uniform(0.5, 2) for _ in range(batch)]))
    out = tmf.newton_schulz(stack, dtype=torch.float64)
    for i in range(batch):  # a batched matmul may sum in another order: same 1e-12 as above
        torch.testing.assert_close(out[i], tmf.newton_schulz(stack[i], dtype=torch.float64),
                                   rtol=0, atol=1e-12)


def _bf16(x):
    return torch.tensor(x).to(torch.bfloat16).double().numpy()


def ns_bf16_emulated(M, steps=5, eps=1e-7):
    """The reference iteration with every intermediate rounded to bfloat16, as the torch port
    rounds them (normalise in float64, round once; each addmm accumulates in float32 and
    rounds its result once: B = bQ + cQ^2, then X = aX + BX)."""
    a, b, c = NS_COEFFICIENTS
    X = _bf16(M / (np.linalg.norm(M) + eps))
    tall = M.shape[0] > M.shape[1]
    X = X.T if tall else X
    for _ in range(steps):
        Q = _bf16(X @ X.T)
        B = _bf16(b * Q + c * (Q @ Q))
        X = _bf16(a * X + B @ X)
    return X.T if tall else X


@given(data=svd_matrices())
def test_torch_bfloat16_matches_bf16_emulation(data):
    M = data[0]
    out, emu = _ns_torch(torch.bfloat16)(M), ns_bf16_emulated(M)
    # identical roundings; only the matmul accumulation order may differ (bit-equal on CPU
    # in practice): 2e-2 relative leaves room for a flipped bf16 ulp amplified by p'.
    assert np.linalg.norm(out - emu) <= 2e-2 * max(np.linalg.norm(emu), 1e-30)


@given(data=svd_matrices(min_ratio=0.05))
def test_torch_bfloat16_close_to_float64(data):
    M = data[0]
    out, ref = _ns_torch(torch.bfloat16)(M), ns_ref(M)
    # bf16 rounds to 2^-9 relative; a quintic step sums terms up to |a|s+|b|s^3+|c|s^5 <= 10.3
    # into p(s) >= 0.6 (x15), so ~3e-2 per step, compounded over 5 steps; measured median
    # 3.3e-2, max 0.148 over 2e4 random inputs with sigma_i / sigma_1 >= 0.05: 0.25 relative.
    assert np.linalg.norm(out - ref) <= 0.25 * np.linalg.norm(ref)
    assert np.linalg.svd(out, compute_uv=False).max() <= P_STAR + BF16_EXCESS


# ------------------------------------------------------------------ SVD polar factor (M11)

def _svd_torch(dtype):
    return lambda M: tmf.orthogonalize_svd(torch.tensor(M, dtype=dtype)).double().numpy()


# float64: LAPACK SVD backward error ~1e-15 relative, amplified by 1 / (sigma_min / sigma_max)
# <= 1e3 in the polar factor -> 1e-11; float32: 6e-8 x 1e3 -> 1e-4 (singular values: 1e-5).
SVD_IMPLS = {"numpy-f64": (lambda M: svd_ref(M), 1e-11, 1e-12),
             "torch-f64": (_svd_torch(torch.float64), 1e-11, 1e-12),
             "torch-f32": (_svd_torch(torch.float32), 1e-4, 1e-5)}
svd_impls = pytest.mark.parametrize("impl", list(SVD_IMPLS))


@svd_impls
@given(data=svd_matrices())
def test_svd_polar_factor_is_u_vt(impl, data):
    orth, tol, sv_tol = SVD_IMPLS[impl]
    M, U, sigma, V, _ = data
    Q = orth(M)
    np.testing.assert_allclose(Q, U @ V.T, rtol=0, atol=tol)
    np.testing.assert_allclose(np.linalg.svd(Q, compute_uv=False), 1.0, rtol=0, atol=sv_tol)
    H = Q.T @ M  # polar decomposition M = Q H with H symmetric positive semidefinite
    np.testing.assert_allclose(H, H.T, rtol=0, atol=tol * np.abs(M).max())


@svd_impls
@pytest.mark.parametrize("shape", [(3, 5), (5, 3), (4, 4)])
def test_svd_zero_in_zero_out(impl, shape):
    out = SVD_IMPLS[impl][0](np.zeros(shape))
    assert out.shape == shape and np.all(out == 0)


@svd_impls
@given(rows=st.integers(2, 6), cols=st.integers(2, 6), seed=st.integers(0, 2**32 - 1))
def test_svd_rank_deficient_gives_partial_isometry(impl, rows, cols, seed):
    orth, _, sv_tol = SVD_IMPLS[impl]
    rng = np.random.default_rng(seed)
    M = np.zeros((rows, cols))  # an exact rank-1 block: the null singular values are exact 0s
    M[: rows - 1, : cols - 1] = np.outer(rng.integers(1, 9, rows - 1),
                                         rng.integers(-9, 9, cols - 1))
    M[0, 0] += 0.5  # rank 2 unless the block had one row/col
    rank = np.linalg.matrix_rank(M)
    out = np.sort(np.linalg.svd(orth(M), compute_uv=False))[::-1]
    np.testing.assert_allclose(out[:rank], 1.0, rtol=0, atol=sv_tol)
    np.testing.assert_allclose(out[rank:], 0.0, rtol=0, atol=sv_tol)


@given(data=svd_matrices())
def test_svd_torch_float64_matches_reference(data):
    M = data[0]
    np.testing.assert_allclose(_svd_torch(torch.float64)(M), svd_ref(M), rtol=0, atol=1e-11)


@pytest.mark.parametrize("shape", [(0, 3), (3, 0)])
def test_svd_zero_size_matches_reference(shape):
    """The reference returns an empty (A, B) array; a zero-size 2-D parameter (CONVENTIONS 2.3)
    reaches this function through MARS-Shampoo with orthogonalizer="svd"."""
    expected = svd_ref(np.zeros(shape))
    out = tmf.orthogonalize_svd(torch.zeros(shape, dtype=torch.float64))
    assert tuple(out.shape) == expected.shape == shape
