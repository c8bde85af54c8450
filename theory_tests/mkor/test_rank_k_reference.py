"""KC7, KC8: the rank-k MKOR oracle (``reference/mkor/rank_k.py``) against statements made
independently here: group sizes by formula, group means by hand, the Woodbury identity
symbolically (sympy, on the oracle's own code) and against explicit inverses (float64), the
reduction to K8/K10 at k = 1, and the two endpoints against K-FAC's factors (K19's
``kfac_factors``) and K-FAC-reduce's (KC5, computed here from the rows)."""
import numpy as np
import pytest
import sympy as sp

from reference.baselines.kfac import kfac_factors
from reference.mkor import rank_k as RK
from reference.mkor.factors import VARIANT_OPTIONS, factor_update
from reference.mkor.preconditioner import MKORConfig, MKORReference
from reference.mkor.vectors import linear_rank1_vectors, unfold2d
from theory_tests.support.mkor_cases import no_cubic_linalg  # noqa: F401  (fixture)


def statistic(V):
    """(1/k') sum_j v_j v_j^T (KC7)."""
    return V.T @ V / V.shape[0]


# ---------------------------------------------------------------- KC7: the groups

@pytest.mark.parametrize("n", range(0, 14))
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_groups_are_contiguous_with_the_first_n_mod_k_one_row_longer(n, k):
    index = RK.group_index(n, k)
    assert (np.diff(index) >= 0).all() and (np.diff(index) <= 1).all()  # contiguous, in order
    sizes = np.bincount(index, minlength=k)
    assert sizes.tolist() == [n // k + (j < n % k) for j in range(k)]


def test_group_means_by_hand():
    rng = np.random.default_rng(0)
    a, g = rng.normal(size=(5, 2)), rng.normal(size=(5, 3))
    A, G = RK.linear_group_vectors(a, g, 2, has_bias=True)
    # 5 rows, 2 groups: rows 0-2 and rows 3-4; R_g = 5 rows (Linear, K3)
    assert np.allclose(A, [[*a[:3].mean(0), 1], [*a[3:].mean(0), 1]], rtol=0, atol=1e-15)
    assert np.allclose(G, [5 * g[:3].mean(0), 5 * g[3:].mean(0)], rtol=0, atol=1e-15)


def test_rank_one_is_the_rank_one_vectors():
    """k = 1 is K3/K6 (one group of every row), also on a 3-D input."""
    rng = np.random.default_rng(1)
    a, g = rng.normal(size=(4, 3, 5)), rng.normal(size=(4, 3, 2))
    for bias in (True, False):
        A, G = RK.linear_group_vectors(a, g, 1, bias)
        a_bar, g_bar = linear_rank1_vectors(a, g, bias)
        assert np.allclose(A[0], a_bar, rtol=0, atol=1e-15)
        assert np.allclose(G[0], g_bar, rtol=0, atol=1e-15)


def test_a_padded_row_stays_out_of_its_group_and_an_empty_group_contributes_nothing():
    """A padded row keeps its place in the cut but not in the mean; R_g counts real rows; a
    group with no real row has no mean and is not counted in k'."""
    rng = np.random.default_rng(2)
    a, g = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 3, 2))
    mask = np.array([[True, True, False], [False, False, True]])  # rows 0,1 | 2,3 | 4,5
    A, G = RK.linear_group_vectors(a, g, 3, True, mask=mask)
    rows_a, rows_g, real = a.reshape(6, 4), g.reshape(6, 2), mask.reshape(6)
    assert A.shape == (2, 5)  # group 1 (rows 2 and 3) is all padding: dropped
    assert np.allclose(A[0], [*rows_a[:2].mean(0), 1], rtol=0, atol=1e-15)
    assert np.allclose(A[1], [*rows_a[5], 1], rtol=0, atol=1e-15)
    assert np.allclose(G, [3 * rows_g[:2].mean(0), 3 * rows_g[5]], rtol=0, atol=1e-15)
    # the same statistic as the real rows alone, cut where the padding put them
    assert real.sum() == 3


# ---------------------------------------------------------------- KC7: the endpoints

@pytest.mark.parametrize("bias", [True, False])
def test_one_row_per_group_is_kfac(bias):
    """k = R: (1/R) sum a a^T and (1/R) sum (R g)(R g)^T = R sum g g^T, K-FAC's (K19)."""
    rng = np.random.default_rng(3)
    a, g = rng.normal(size=(3, 4, 5)), rng.normal(size=(3, 4, 2))
    A, G = RK.linear_group_vectors(a, g, 12, bias)
    A_kfac, G_kfac = kfac_factors(a, g, has_bias=bias)
    assert np.allclose(statistic(A), A_kfac, rtol=1e-14, atol=1e-15)
    assert np.allclose(statistic(G), G_kfac, rtol=1e-14, atol=1e-15)


def test_one_patch_per_group_is_kfac_with_G_over_L():
    """A Conv2d with k = B L: A is K-FAC's; G is K-FAC's divided by L, because the weight
    1/k averages over the B L rows where K-FAC's G averages over the B samples (K19)."""
    rng = np.random.default_rng(4)
    x, kernel = rng.normal(size=(2, 2, 4, 4)), (3, 3)
    patches = unfold2d(x, kernel, padding=1)  # (B, C k k, L), L = 16
    g_out = rng.normal(size=(2, 3, 4, 4))
    L = patches.shape[2]
    A, G = RK.conv2d_group_vectors(x, g_out, 2 * L, kernel, 1, 1, 1, True)
    a_rows = patches.transpose(0, 2, 1).reshape(-1, patches.shape[1])
    g_rows = g_out.reshape(2, 3, L).transpose(0, 2, 1).reshape(-1, 3)
    A_kfac, G_kfac = kfac_factors(a_rows, g_rows, has_bias=True, rows_per_sample=L)
    assert np.allclose(statistic(A), A_kfac, rtol=1e-14, atol=1e-15)
    assert np.allclose(statistic(G), G_kfac / L, rtol=1e-14, atol=1e-15)


def test_groups_equal_to_samples_are_kfac_reduce():
    """k = N on (N, S, d) rows: KC5 with empirical columns, computed here from the rows:
    a_bar_n = (1/S) sum_s [a_ns | 1], g_hat_n = sum_s g_ns, A = (1/N) sum_n a_bar a_bar^T,
    G = (1/R) sum_n g_hat g_hat^T with 1/R = N S (g is the gradient of the mean over the N S
    rows). MKOR's A is KC5's; its G is KC5's divided by S: g_bar_n = N S (1/S) sum_s g_ns =
    N g_hat_n, so (1/N) sum_n g_bar g_bar^T = N sum_n g_hat g_hat^T = G_KC5 / S."""
    rng = np.random.default_rng(5)
    N, S = 4, 3
    a, g = rng.normal(size=(N, S, 5)), rng.normal(size=(N, S, 2))
    A, G = RK.linear_group_vectors(a, g, N, True)
    a_bar = np.concatenate([a.mean(1), np.ones((N, 1))], axis=1)
    g_hat = g.sum(1)
    A_reduce = a_bar.T @ a_bar / N
    G_reduce = (N * S) * g_hat.T @ g_hat
    assert np.allclose(statistic(A), A_reduce, rtol=1e-14, atol=1e-15)
    assert np.allclose(statistic(G), G_reduce / S, rtol=1e-14, atol=1e-15)


# ---------------------------------------------------------------- KC8: Woodbury

def _symbolic(d, k):
    J = sp.Matrix(d, d, lambda i, j: sp.Symbol(f"j{min(i, j)}{max(i, j)}"))
    V = sp.Matrix(k, d, lambda i, j: sp.Symbol(f"v{i}{j}"))
    return J, V, np.array(J.tolist(), dtype=object), np.array(V.tolist(), dtype=object)


class _AdjugateSolve:
    """C^{-1} B as adj(C) B D, with the symbol D standing for 1/det(C): every entry of the
    oracle's result is then a polynomial in D (degree <= 1) over rationals in the rest, and
    an identity X = 0 holds iff X|_{D^0} det(C) + X|_{D^1} = 0 (no cancel of a huge fraction)."""

    D = sp.Symbol("D")

    def __init__(self):
        self.det = None

    def __call__(self, C, B):
        C = sp.Matrix(C.tolist())
        self.det = C.det()
        return np.array((C.adjugate() * sp.Matrix(B.tolist()) * self.D).tolist(), dtype=object)

    def is_zero(self, M):
        for entry in M:
            p = sp.expand(entry)
            if p.coeff(self.D, 2) != 0:
                return False
            rest = p.coeff(self.D, 0) * self.det + p.coeff(self.D, 1)
            if sp.expand(sp.numer(sp.together(rest))) != 0:
                return False
        return True


def test_woodbury_inverts_the_factor_ema_symbolically():
    """KC8 "paper", d = k = 2, generic symmetric J and V, symbolic rho: the oracle's own code
    W satisfies W (rho J^{-1} + ((1-rho)/k) V^T V) = I, checked as
    W (rho I + ((1-rho)/k) V^T V J) - J = 0 (J invertible)."""
    rho = sp.Symbol("rho", positive=True)
    J, V, J_arr, V_arr = _symbolic(2, 2)
    solve = _AdjugateSolve()
    W = sp.Matrix(RK.woodbury_ema_inverse_update(J_arr, V_arr, rho, solve=solve).tolist())
    assert solve.is_zero(W * (rho * sp.eye(2) + (1 - rho) / 2 * V.T * V * J) - J)


@pytest.mark.slow  # ~2-5 s; the float64 test below covers the default run, the mutants run it
def test_woodbury_released_inverts_symbolically(monkeypatch):
    """KC8 "released", d = k = 2: W (J'^{-1} + (1/k) V^T V) = I with J' = b J + (1 - b) I,
    b the code's 0.95 as the exact rational 19/20 (a float would leave round-off to cancel)."""
    b = sp.Rational(19, 20)
    monkeypatch.setattr(RK, "RELEASED_BLEND", b)
    J, V, J_arr, V_arr = _symbolic(2, 2)
    solve = _AdjugateSolve()
    W = sp.Matrix(RK.woodbury_released_update(J_arr, V_arr, solve=solve).tolist())
    blended = b * J + (1 - b) * sp.eye(2)
    assert solve.is_zero(W * (sp.eye(2) + V.T * V * blended / 2) - blended)


def _spd(rng, d):
    Q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    return (Q * rng.uniform(0.3, 2.0, d)) @ Q.T


@pytest.mark.parametrize("k", [2, 3, 7])
def test_woodbury_is_the_inverse_of_the_accumulated_factor_ema(k):
    """Eight paper updates from L_0 = I: J_t = inv(L_t), L_t = rho L_{t-1} + ((1-rho)/k) V^T V
    (explicit inverse here, in the test only); k = 7 > d = 6 is allowed."""
    rng = np.random.default_rng(k)
    d, rho = 6, 0.8
    J, L = np.eye(d), np.eye(d)
    for _ in range(8):
        V = rng.normal(size=(k, d))
        J = RK.woodbury_ema_inverse_update(J, V, rho)
        L = rho * L + (1 - rho) / k * V.T @ V
        assert np.allclose(J, np.linalg.inv(L), rtol=0, atol=1e-12 * np.abs(J).max())


@pytest.mark.parametrize("k", [2, 5])
def test_released_woodbury_is_the_inverse_of_the_blend_plus_the_groups(k):
    rng = np.random.default_rng(10 + k)
    d = 5
    J = _spd(rng, d)
    for _ in range(6):
        V = rng.normal(size=(k, d))
        blended = 0.95 * J + 0.05 * np.eye(d)
        expected = np.linalg.inv(np.linalg.inv(blended) + V.T @ V / k)
        J = RK.woodbury_released_update(J, V)
        assert np.allclose(J, expected, rtol=0, atol=1e-12 * np.abs(J).max())


@pytest.mark.parametrize("variant", ["paper", "released"])
@pytest.mark.parametrize("timing", ["before_sm", "deferred"])
@pytest.mark.parametrize("reset", ["blend", "identity"])
@pytest.mark.parametrize("first_update", ["sm", "identity"])
def test_one_group_is_the_rank_one_update(variant, timing, reset, first_update):
    """k' = 1: the whole factor update (stabiliser, first update) is K8/K10's."""
    rng = np.random.default_rng(6)
    options = VARIANT_OPTIONS[variant].__class__(timing, reset, first_update)
    for trial in range(10):
        J = _spd(rng, 4) * (3.0 if trial % 3 == 0 else 0.5)
        v = rng.normal(size=4)
        first, flag = trial % 4 == 1, trial % 5 == 2
        expected, fired = factor_update(J, v, variant=variant, stat_decay=0.9, zeta=0.8,
                                        options=options, first=first, reset_flag=flag)
        ours, ours_fired = RK.rank_k_factor_update(
            J, v[None], variant=variant, stat_decay=0.9, zeta=0.8, first=first,
            reset_flag=flag, stabilizer_timing=timing, stabilizer_reset=reset,
            first_update=first_update)
        assert np.allclose(ours, expected, rtol=0, atol=1e-14 * max(1, np.abs(expected).max()))
        assert ours_fired == fired


def test_the_update_solves_only_k_by_k(monkeypatch, no_cubic_linalg):  # noqa: F811
    """O(k d^2 + k^3): with every O(d^3) numpy.linalg routine forbidden, the only solve
    allowed is the k x k one."""
    seen = []

    def small_solve(C, B):
        seen.append(C.shape)
        assert C.shape == (3, 3)
        return _gauss(C, B)
    monkeypatch.setattr(RK, "_solve", small_solve)
    rng = np.random.default_rng(7)
    J = np.eye(40)
    for t in range(6):
        for variant in ("paper", "released"):
            J, _ = RK.rank_k_factor_update(J, rng.normal(size=(3, 40)), variant=variant,
                                           first=t == 0, reset_flag=t == 4)
    assert seen and set(seen) == {(3, 3)}


def _gauss(C, B):
    """A k x k solve by Gaussian elimination (the test's own: numpy's solve is forbidden)."""
    M = np.concatenate([np.array(C, dtype=float), np.array(B, dtype=float)], axis=1)
    k = M.shape[0]
    for i in range(k):
        p = i + np.argmax(np.abs(M[i:, i]))
        M[[i, p]] = M[[p, i]]
        M[i] /= M[i, i]
        for r in range(k):
            if r != i:
                M[r] -= M[r, i] * M[i]
    return M[:, k:]


# ---------------------------------------------------------------- the whole step

def test_the_whole_step_takes_rank_and_validates_it():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="rank"):
            MKORConfig(rank=bad)
    rng = np.random.default_rng(8)
    ref = MKORReference(MKORConfig(rank=3, inv_freq=1, stat_decay=0.8, threshold=1e9))
    layer = {"grad_W": rng.normal(size=(2, 4)), "grad_b": rng.normal(size=2),
             "a_bar": rng.normal(size=(3, 5)), "g_bar": rng.normal(size=(2, 2))}
    ref.step([layer])
    L_expected = np.linalg.inv(0.8 * np.eye(2) + 0.2 / 2 * layer["g_bar"].T @ layer["g_bar"])
    assert np.allclose(ref.L_inv[0], L_expected, rtol=0, atol=1e-14)
    with pytest.raises(ValueError, match="rank 3"):
        ref.step([dict(layer, a_bar=rng.normal(size=(4, 5)))])
