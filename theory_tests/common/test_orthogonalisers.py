r"""Issue 32's orthogonalisers, next to their equations: coefficient schedules (M13a), Gram
Newton-Schulz (M13b), Polar Express's minimax quintics (M13c) and the same-shape batching.

Closed forms tested here:

* A schedule maps every singular value s of X_0 = M / (||M||_F + eps) through the composition
  p_{K-1} o ... o p_0 of its quintics and keeps the singular vectors (each step is a
  polynomial in X X^T applied to X).
* The Gram iteration with shift delta maps s through the scalar recursion of its own
  definition: first block y = s^2 + delta ||Y_0||_F, r = 1; per step h = a + b y + c y^2,
  r <- h r, y <- h^2 y; at a restart s <- r s, y <- s^2, r <- 1; out r s.  At delta = 0 that is
  the standard map, so Gram(shift 0) = Newton-Schulz in exact arithmetic.
* ``optimal_quintic`` is the minimax odd quintic on [l, u] iff 1 - p equioscillates at four
  points (Chebyshev's alternation theorem, three coefficients): checked on a dense grid and
  against perturbations of the coefficients; Polar Express's greedy recentring makes the
  K-step image of [l, 1] an interval centred on 1.
"""
import numpy as np
import pytest
import torch

from reference.common import matrix_functions as R
from torch_impl.common import matrix_functions as T
from torch_impl.common.sharding import BATCH_NUMEL, orthogonalize_by_shape

F64 = torch.float64


def _with_singular_values(rows, cols, s, seed=0):
    rng = np.random.default_rng(seed)
    n = min(rows, cols)
    U, _ = np.linalg.qr(rng.standard_normal((rows, n)))
    V, _ = np.linalg.qr(rng.standard_normal((cols, n)))
    return (U * np.asarray(s)) @ V.T


def _composite(schedule, s):
    for triple in schedule:
        s = R.quintic(s, triple)
    return s


SCHEDULES = ["authors", "polar_express", (3.0, -3.2, 1.2),
             [(3.4445, -4.7750, 2.0315), (2.0, -1.5, 0.5), (1.875, -1.25, 0.375)]]


# ------------------------------------------------------------------ M13a: schedules

@pytest.mark.parametrize("coefficients", SCHEDULES, ids=str)
@pytest.mark.parametrize("shape", [(6, 11), (11, 6)])
def test_singular_values_map_through_the_schedules_polynomials(coefficients, shape):
    s = np.geomspace(1.0, 1e-3, min(shape))
    M = _with_singular_values(*shape, 7 * s)
    out = R.newton_schulz(M, steps=6, coefficients=coefficients)
    Um, sm, Vtm = np.linalg.svd(M, full_matrices=False)  # M's vectors, each value mapped
    expected = _composite(R.ns_schedule(coefficients, 6), sm / (np.linalg.norm(M) + 1e-7))
    np.testing.assert_allclose(Um.T @ out @ Vtm.T, np.diag(expected), rtol=0, atol=1e-12)


def test_a_sequence_repeats_its_last_triple_and_one_triple_is_every_step():
    seq = [(1.0, 2.0, 3.0), (4.0, 5.0, 6.0)]
    for ns_schedule in (R.ns_schedule, T.ns_schedule):
        assert ns_schedule(seq, 4) == (seq[0], seq[1], seq[1], seq[1])
        assert ns_schedule((1, 2, 3), 3) == ((1.0, 2.0, 3.0),) * 3
        assert ns_schedule("authors", 2) == (R.NS_COEFFICIENTS,) * 2


@pytest.mark.parametrize("bad", ["chebyshev", [], [(1, 2)], (1, 2), [(1, 2, 3), (4, 5)]],
                         ids=str)
def test_a_bad_schedule_is_refused_naming_ns_coefficients(bad):
    for ns_schedule in (R.ns_schedule, T.ns_schedule):
        with pytest.raises(ValueError, match="ns_coefficients"):
            ns_schedule(bad, 5)


# ------------------------------------------------------------------ M13c: Polar Express

@pytest.mark.parametrize("lower,upper", [(1e-3, 1.0), (0.024, 1.0), (0.3, 1.2), (0.9, 1.05)])
def test_optimal_quintic_equioscillates_and_no_perturbation_beats_it(lower, upper):
    a, b, c = R.optimal_quintic(lower, upper)
    x = np.linspace(lower, upper, 200001)
    err = 1 - R.quintic(x, (a, b, c))
    E = np.abs(err).max()
    # four alternation points: l (+E), an interior max of p (-E), an interior min (+E), u (-E)
    roots = np.roots([5 * c, 0, 3 * b, 0, a])
    crit = np.sort([r.real for r in roots if abs(r.imag) < 1e-12 and lower < r.real < upper])
    assert len(crit) == 2
    signed = [err[0], 1 - R.quintic(crit[0], (a, b, c)), 1 - R.quintic(crit[1], (a, b, c)),
              err[-1]]
    np.testing.assert_allclose(signed, [E, -E, E, -E], rtol=1e-9, atol=1e-13)
    rng = np.random.default_rng(0)
    for _ in range(200):  # the alternation theorem, checked directly
        d = rng.standard_normal(3) * 1e-4 * np.abs([a, b, c])
        assert np.abs(1 - R.quintic(x, (a + d[0], b + d[1], c + d[2]))).max() >= E * (1 - 1e-12)


def test_the_ports_table_is_the_paper_schedule_derived_from_its_definition():
    derived = R.polar_express_coefficients(8, safety=1.0)  # the paper lists them unsafetied
    np.testing.assert_allclose(derived, T.POLAR_EXPRESS_COEFFICIENTS, rtol=1e-10, atol=0)
    np.testing.assert_allclose(R.polar_express_coefficients(10), T.ns_schedule("polar_express", 10),
                               rtol=1e-10, atol=0)
    assert T.ns_schedule("polar_express", 10)[7:] == ((1.875, -1.25, 0.375),) * 3


def test_polar_express_images_are_centred_on_one_and_beat_the_authors_at_five_steps():
    x = np.geomspace(R.PE_LOWER, 1.0, 400001)
    for k in range(1, 6):  # safety 1: each step maps [l, 1] onto [p(l), 2 - p(l)]
        image = _composite(R.polar_express_coefficients(k, safety=1.0), x)
        assert image.min() == pytest.approx(image[0], rel=1e-12)
        assert image.max() == pytest.approx(2 - image[0], rel=1e-6)
    pe = _composite(R.ns_schedule("polar_express", 5), x / R.PE_SAFETY)  # 1.01 ||M|| headroom
    authors = _composite(R.ns_schedule("authors", 5), x)
    assert np.abs(1 - pe).max() < 0.2 < np.abs(1 - authors).max()  # 0.12 against 0.36


# ------------------------------------------------------------------ M13b: Gram Newton-Schulz

def _gram_scalar_map(s, coefficients, steps, restarts, shift):
    """The Gram iteration on one singular value (module docstring), for the vector s."""
    y, r = s**2 + shift * np.sqrt(np.sum(s**4)), np.ones_like(s)  # Y_0 + shift ||Y_0||_F I
    for k, triple in enumerate(R.ns_schedule(coefficients, steps)):
        if k in restarts:  # Y + shift * rms(eigenvalues of Y) I
            s, r = r * s, np.ones_like(s)
            y = s**2 + shift * np.sqrt(np.mean(s**4))
        h = R.quintic(np.sqrt(y), triple) / np.sqrt(y)  # a + b y + c y^2
        r, y = h * r, h * h * y
    return r * s


@pytest.mark.parametrize("coefficients", ["authors", "polar_express"])
@pytest.mark.parametrize("restarts", [None, (), (1, 3), (3,)], ids=str)
@pytest.mark.parametrize("shift", [0.0, 1e-2])
def test_gram_singular_values_follow_its_scalar_recursion(coefficients, restarts, shift):
    s = np.geomspace(1.0, 1e-2, 5)
    M = _with_singular_values(5, 17, 3 * s, seed=1)
    out = R.gram_newton_schulz(M, steps=5, coefficients=coefficients, restarts=restarts,
                               shift=shift)
    rs = R.gram_restarts(5) if restarts is None else restarts
    expected = _gram_scalar_map(3 * s / (np.linalg.norm(M) + 1e-7), coefficients, 5, rs, shift)
    np.testing.assert_allclose(np.sort(np.linalg.svd(out, compute_uv=False)),
                               np.sort(np.abs(expected)), rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("coefficients", SCHEDULES, ids=str)
@pytest.mark.parametrize("shape", [(4, 13), (13, 4), (9, 20)])
@pytest.mark.parametrize("restarts", [None, (), (1, 3, 5)], ids=str)
def test_gram_at_shift_zero_is_newton_schulz(coefficients, shape, restarts):
    M = np.random.default_rng(2).standard_normal(shape)
    np.testing.assert_allclose(
        R.gram_newton_schulz(M, 7, coefficients=coefficients, restarts=restarts, shift=0.0),
        R.newton_schulz(M, 7, coefficients=coefficients), rtol=0, atol=1e-12)


def test_gram_flops_and_when_the_gram_form_pays():
    # 5 steps, restart before step 2: blocks of 2 and 3 -> (2a + 5) + (2a + 9) vs 5 (2a + 1)
    for rows, cols in [(256, 1024), (1024, 256), (300, 200), (7, 7)]:
        alpha = max(rows, cols) / min(rows, cols)
        for flops in (R.gram_flops, T.gram_flops):
            assert flops(rows, cols, 5) == pytest.approx((10 * alpha + 5, 4 * alpha + 14))
        assert R.gram_pays(rows, cols, 5) == T.gram_pays(rows, cols, 5) == (alpha > 1.5)
    assert R.gram_flops(10, 40, 4, restarts=()) == pytest.approx((36, 8 + 13))  # one block
    assert not R.gram_pays(0, 5, 5) and not T.gram_pays(0, 5, 5)


def test_a_nearly_square_matrix_takes_the_standard_iteration():
    M = torch.randn(12, 16, dtype=F64)  # aspect 1.33: the Gram form costs more
    assert torch.equal(T.gram_newton_schulz(M, dtype=F64), T.newton_schulz(M, dtype=F64))
    np.testing.assert_array_equal(R.gram_newton_schulz(M.numpy()), R.newton_schulz(M.numpy()))


# ------------------------------------------------------------------ the port against the oracle

@pytest.mark.parametrize("coefficients", SCHEDULES, ids=str)
@pytest.mark.parametrize("shape", [(5, 17), (17, 5), (8, 8), (3, 40)])
def test_port_float64_matches_the_oracle(coefficients, shape):
    M = torch.randn(shape, dtype=F64, generator=torch.Generator().manual_seed(3))
    for cast_first in (False, True):
        np.testing.assert_allclose(
            T.newton_schulz(M, 6, dtype=F64, coefficients=coefficients, cast_first=cast_first),
            R.newton_schulz(M.numpy(), 6, coefficients=coefficients), rtol=0, atol=1e-12)
        np.testing.assert_allclose(
            T.gram_newton_schulz(M, 6, dtype=F64, coefficients=coefficients,
                                 cast_first=cast_first),
            R.gram_newton_schulz(M.numpy(), 6, coefficients=coefficients), rtol=0, atol=1e-12)
    np.testing.assert_allclose(  # a large shift, to see it placed as the oracle places it
        T.gram_newton_schulz(M, 6, dtype=F64, coefficients=coefficients, shift=1e-2),
        R.gram_newton_schulz(M.numpy(), 6, coefficients=coefficients, shift=1e-2),
        rtol=0, atol=1e-12)


def _distance(O, P):
    return (torch.linalg.norm(O.double() - P) / torch.linalg.norm(P)).item()


@pytest.mark.parametrize("seed", range(3))
def test_port_float32_and_bfloat16_near_the_oracle_and_the_polar_factor(seed):
    """float32: rounding stays ~ a few hundred eps_f32 per O(1) entry (bound 1e-4).  bfloat16
    (u = 2^-8): the standard iteration stays within 0.05 of the exact iterate (Frobenius,
    relative; measured 0.013-0.018).  The Gram form rounds its n x n products R <- H R and
    Y <- H Y H too, which moves it ~0.1 from the exact iterate (measured 0.09-0.14), but
    along the directions NS has not converged: its distance to the polar factor U V^T stays
    within 0.05 of the exact iteration's (measured +0.003 to +0.04), and Polar Express
    through the Gram form in bf16 is closer to U V^T than the authors' standard bf16 default
    (0.08-0.09 against 0.22): issue 32's accuracy condition, on Gaussian matrices."""
    M = torch.randn(24, 96, dtype=F64, generator=torch.Generator().manual_seed(4 + seed))
    P = T.orthogonalize_svd(M)
    bf16 = {}
    for name, fn, ref in (("ns", T.newton_schulz, R.newton_schulz),
                          ("gram", T.gram_newton_schulz, R.gram_newton_schulz)):
        for coefficients in ("authors", "polar_express"):
            exact = torch.from_numpy(ref(M.numpy(), coefficients=coefficients))
            f32 = fn(M.float(), dtype=torch.float32, coefficients=coefficients).double()
            assert (f32 - exact).abs().max() < 1e-4
            low = bf16[name, coefficients] = fn(M.float(), dtype=torch.bfloat16,
                                                coefficients=coefficients)
            if name == "ns":
                assert _distance(low, exact) < 0.05
            assert abs(_distance(low, P) - _distance(exact, P)) < 0.05
    assert _distance(bf16["gram", "polar_express"], P) < _distance(bf16["ns", "authors"], P)


def _stress_matrices():
    """bf16's hard cases: low rank, ill-conditioned, near-duplicate rows, a huge dynamic range."""
    g = torch.Generator().manual_seed(5)
    for rows, cols in [(8, 64), (16, 256), (32, 1024)]:
        for rank in (1, 2, 4):
            yield torch.randn(rows, rank, generator=g) @ torch.randn(rank, cols, generator=g)
        U, _ = torch.linalg.qr(torch.randn(rows, rows, generator=g, dtype=F64))
        V, _ = torch.linalg.qr(torch.randn(cols, rows, generator=g, dtype=F64))
        yield ((U * torch.logspace(0, -6, rows, dtype=F64)) @ V.T).float()
        X = torch.randn(rows, cols, generator=g)
        X[1:] = X[0] + 1e-3 * torch.randn(cols, generator=g)
        yield X
        yield torch.randn(rows, cols, generator=g) * torch.logspace(-4, 4, cols)


def _spectral(O):
    return torch.linalg.matrix_norm(O.double(), 2).item() if torch.isfinite(O).all() else np.inf


@pytest.mark.parametrize("coefficients", ["authors", "polar_express"])
def test_gram_in_bfloat16_stays_bounded_and_each_guard_alone_suffices(coefficients):
    """The rounded X X^T of a low-rank matrix has eigenvalues ~ -eps |Y| that the first steps'
    slopes a_k^2 (11.9 for the authors', 65 for Polar Express) blow up when nothing bounds
    them (measured: 1e3 to 1e30).  The shift (positive definite Y_0) and the restarts (the
    blow-up reset after two steps) each keep every singular value below 1.5 (standard NS:
    1.2024 exactly, ~1.21 in bf16)."""
    unguarded = []
    for M in _stress_matrices():
        for shift, restarts in ((None, None), (None, ()), (0.0, None)):
            O = T.gram_newton_schulz(M, coefficients=coefficients, shift=shift, restarts=restarts)
            assert _spectral(O) < 1.5, (tuple(M.shape), shift, restarts)
        unguarded.append(_spectral(T.gram_newton_schulz(M, coefficients=coefficients,
                                                        shift=0.0, restarts=())))
    assert max(unguarded) > 1e3  # the guards are needed: without both it diverges


def _conditioned(rows, cols, decades, seed):
    """A rows x cols float32 matrix with singular values log-spaced over ``decades``."""
    g = torch.Generator().manual_seed(seed)
    n = min(rows, cols)
    U, _ = torch.linalg.qr(torch.randn(rows, n, generator=g, dtype=F64))
    V, _ = torch.linalg.qr(torch.randn(cols, n, generator=g, dtype=F64))
    return ((U * torch.logspace(0, -decades, n, dtype=F64)) @ V.T).float()


@pytest.mark.parametrize("coefficients", ["authors", "polar_express"])
def test_gram_in_bfloat16_stays_bounded_at_every_step_count(coefficients):
    """Past five steps the restarts' own X X^T rounds as Y_0 does, and its negative
    eigenvalues blow up in the next block unless that Gram matrix is lifted too: with Y_0
    lifted alone the authors' bf16 Gram iteration reached 246 at 7 steps and inf at 9 on
    matrices of condition 10^2 to 10^8 (Polar Express with one restart: 3e5).  Lifted at
    every restart, every singular value stays below 1.5 through 12 steps."""
    mats = list(_stress_matrices()) + [_conditioned(64, 256, d, seed=d) for d in (2, 4, 8)]
    worst = {steps: max(_spectral(T.gram_newton_schulz(M, steps, coefficients=coefficients))
                        for M in mats) for steps in range(5, 13)}
    assert max(worst.values()) < 1.5, worst


# ------------------------------------------------------------------ batching by shape

def _mixed(dtype):
    g = torch.Generator().manual_seed(6)
    shapes = [(8, 32), (32, 8), (8, 32), (3, 8, 32), (5, 5), (8, 32), (0, 4), (16, 8), (16, 8)]
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fn", ["newton_schulz", "gram_newton_schulz", "orthogonalize_svd"])
@pytest.mark.parametrize("max_numel", [BATCH_NUMEL, 600])
def test_batched_by_shape_is_the_per_matrix_result_bit_for_bit(dtype, fn, max_numel):
    """CPU matmuls of a batch equal the per-slice ones bit for bit (measured, torch 2.13), so
    the batched call is asserted equal, not close."""
    if fn == "orthogonalize_svd" and dtype == torch.bfloat16:
        pytest.skip("the SVD takes float32 and up")
    f = getattr(T, fn)
    ms = _mixed(dtype)
    calls = []

    def counted(M):
        calls.append(tuple(M.shape))
        return f(M)
    batched = orthogonalize_by_shape(counted, ms, max_numel=max_numel)
    for M, out in zip(ms, batched):
        assert out.shape == M.shape
        assert torch.equal(out, f(M)) if fn != "orthogonalize_svd" else \
            torch.allclose(out, f(M), atol=1e-5)
    if max_numel == BATCH_NUMEL:  # (8, 32) x 6 matrices in one call, (16, 8) x 2 in one
        assert sorted(calls) == sorted([(6, 8, 32), (32, 8), (5, 5), (0, 4), (2, 16, 8)])
    else:  # at most 600 elements a call (a bigger tensor alone)
        assert all(np.prod(c) <= 600 or len(c) == 3 and c[0] <= 3 for c in calls)
