"""Where MKOR's rank-1 statistic sits among K-FAC's flavours (issue 46 item 5, KC6).

MKOR keeps ā = the mean of all rows [a | 1] and ḡ = the sum of all rows of ∂L/∂y (K3, K6).
For ONE data point (a sequence) of S rows, K-FAC-reduce with empirical columns (KC5) has
A = ā āᵀ and G = (1/R) ĝ ĝᵀ with ĝ = Σ_s ∂L/∂y_s = ḡ, so

    ḡ ḡᵀ ⊗ ā āᵀ = R · (G ⊗ A)_reduce,empirical,

R the loss's reduction factor (KC1). For a loss over the S rows as per-row data points
(per-token targets), R = S^-1 when it averages the rows and S^0 when it sums them: the power of
S is −1 (mean) or 0 (sum). (A loss over the sequence as one data point, the reduce setting,
has R = 1 at N = 1: S^0 either way.) The sympy proofs derive the power; the float64 checks
run MKOR's own ``linear_rank1_vectors`` against the KC5 oracle; for N > 1 sequences MKOR is
the reduce over the whole batch, and ``test_mkor_departs_from_reduce_for_several_sequences``
measures how far that is from K-FAC-reduce and the GGN.
"""
import numpy as np
import pytest
import sympy as sp
import torch

from reference.baselines import kfac_flavours as oracle
from reference.mkor.vectors import linear_rank1_vectors
from theory_tests.support import curvature as cv
from theory_tests.support import curvature_nets as nets
from theory_tests.support.curvature_capture import capture, flavour_factors

S = sp.Symbol("S", positive=True, integer=True)
RHO = {"mean": 1 / S, "sum": sp.Integer(1)}  # L = ρ Σ_s ℓ_s over the S rows; R = ρ (KC1)


def power_of_S(ratio):
    """p with ratio = S^p (sympy), or a failure if the ratio is not a power of S."""
    p = sp.simplify(sp.expand_log(sp.log(ratio), force=True) / sp.log(S))
    assert p.free_symbols == set(), f"{ratio} is not a power of S"
    return p


@pytest.mark.parametrize("reduction, power", [("mean", -1), ("sum", 0)])
def test_mkor_is_reduce_up_to_a_power_of_S_for_any_S(reduction, power):
    """Entry ((j, i), (l, k)) of both Kronecker products for a symbolic number S of rows,
    generic rows a_s and per-row loss gradients h_s = ∇ℓ_s (so ∂L/∂y_s = ρ h_s):

    MKOR (K3): ā = (1/S) Σ_s a_s, ḡ = (1/S) Σ_s S (ρ h_s)   (rows times the row count, averaged);
    KC5 (empirical, N = 1): ā_1 = (1/S) Σ_s a_s, G = R Σ_c ĝ ĝᵀ with ĝ = Σ_s h_s (one column,
    the data's own ∇ℓ per row), R = ρ.
    """
    s = sp.Symbol("s", integer=True)
    a, h = sp.IndexedBase("a"), sp.IndexedBase("h")
    i, k, j, l = sp.symbols("i k j l", integer=True)
    rho = RHO[reduction]

    def mean_rows(x, c):
        return sp.Sum(x[s, c], (s, 1, S)) / S

    def mkor_g(c):
        return sp.Sum(S * rho * h[s, c], (s, 1, S)) / S

    mkor = mkor_g(j) * mkor_g(l) * mean_rows(a, i) * mean_rows(a, k)
    R = rho
    reduce = R * sp.Sum(h[s, j], (s, 1, S)) * sp.Sum(h[s, l], (s, 1, S)) \
        * mean_rows(a, i) * mean_rows(a, k)
    assert power_of_S(sp.simplify(mkor / reduce)) == power


@pytest.mark.parametrize("rows", [2, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mkor_is_reduce_up_to_a_power_of_S_as_matrices(rows, reduction):
    """The whole matrices for S = 2, 3 rows (d_in = 2 with a bias, d_out = 2): the loss a
    generic function ℓ_s(y_s) per row, L = ρ Σ ℓ_s, its gradient taken by sympy; MKOR's
    product equals S^p times K-FAC-reduce's with the p derived above."""
    d_in, d_out = 2, 2
    a = sp.Matrix(rows, d_in, lambda r, c: sp.Symbol(f"a{r}{c}"))
    y = sp.Matrix(rows, d_out, lambda r, c: sp.Symbol(f"y{r}{c}"))
    ells = [sp.Function(f"l{r}")(*y.row(r)) for r in range(rows)]
    rho = RHO[reduction].subs(S, rows)
    L = rho * sum(ells)
    g_rows = sp.Matrix(rows, d_out, lambda r, c: sp.diff(L, y[r, c]))       # ∂L/∂y
    h_rows = sp.Matrix(rows, d_out, lambda r, c: sp.diff(ells[r], y[r, c]))  # ∇ℓ_r
    a1 = a.row_join(sp.ones(rows, 1))
    a_bar = (sp.ones(1, rows) * a1 / rows).T
    g_bar = (sp.ones(1, rows) * (rows * g_rows) / rows).T                   # K3
    mkor = sp.kronecker_product(g_bar * g_bar.T, a_bar * a_bar.T)
    g_hat = (sp.ones(1, rows) * h_rows).T
    reduce = sp.kronecker_product(rho * g_hat * g_hat.T, a_bar * a_bar.T)  # R = ρ, N = 1
    power = {"mean": -1, "sum": 0}[reduction]
    assert (mkor - sp.Integer(rows) ** power * reduce).applyfunc(sp.simplify) == sp.zeros(*mkor.shape)


# ---------------------------------------------------------------- float64, the code itself

def _one_sequence(kind, reduction, S_rows=4):
    net = nets.deep_linear(kind, N=1, S=S_rows, dims=(3, 4, 3))
    loss_func = nets.make_loss(kind, reduction)
    with torch.no_grad():
        targets = nets.make_targets(kind, net.model(net.inputs))
    return net, loss_func, targets


@pytest.mark.parametrize("kind", ["ce", "mse"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mkor_vectors_give_R_times_kfac_reduce_for_one_sequence(kind, reduction):
    """One sequence of S = 4 tokens with per-token targets: MKOR's ``linear_rank1_vectors``
    (fed ∂L/∂y, MKOR's own g) give kron(ḡḡᵀ, āāᵀ) = R kron(G, A) of the KC5 oracle with
    empirical columns; R = 1/S (CE mean), 1/(S·C) (MSE mean: torch divides by every element),
    1 (sum). The oracle's ``mkor_rank1_factors`` is the same statistic."""
    net, loss_func, targets = _one_sequence(kind, reduction)
    for layer in net.layers:
        cap = capture(net.model, loss_func, net.inputs, targets, layer)
        a, g = cap.a.detach().numpy(), cap.loss_gradient().detach().numpy()
        a_bar, g_bar = linear_rank1_vectors(a, g, has_bias=True)
        mkor = np.kron(np.outer(g_bar, g_bar), np.outer(a_bar, a_bar))
        A, G = flavour_factors(cap, "empirical", "reduce")
        want = {("ce", "mean"): 1 / 4, ("mse", "mean"): 1 / (4 * 3)}.get((kind, reduction), 1.0)
        assert cap.R == want
        assert np.abs(mkor - cap.R * np.kron(G, A)).max() < 1e-13 * np.abs(mkor).max()
        A_m, G_m = oracle.mkor_rank1_factors(a, g, has_bias=True)
        assert np.abs(np.kron(G_m, A_m) - mkor).max() < 1e-13 * np.abs(mkor).max()
        if reduction == "mean":  # the control: without R they differ by the power of S
            assert np.abs(mkor - np.kron(G, A)).max() > 0.5 * np.abs(mkor).max()


def _distance(x, y):
    return np.linalg.norm(x - y) / np.linalg.norm(y)


def _shape_distance(x, y):
    """min_c ‖c x − y‖ / ‖y‖ = sin∠(x, y): the distance with the scale left out."""
    cos = np.sum(x * y) / (np.linalg.norm(x) * np.linalg.norm(y))
    return float(np.sqrt(max(0.0, 1 - cos * cos)))


# measured with this test (mean over 3 seeds and both layers of a deep linear net with S = 4
# tokens reduced by a mean before an MSE-sum loss): N, then sin∠(MKOR, KC5-empirical),
# sin∠(MKOR, GGN), sin∠(KC5-empirical, GGN), ‖MKOR/(NR) − KC5‖/‖KC5‖
DEPARTURES = {1: (0.000, 0.300, 0.300, 0.000), 2: (0.377, 0.389, 0.220, 0.417),
              4: (0.359, 0.430, 0.315, 0.434), 16: (0.432, 0.497, 0.162, 0.853)}


def test_mkor_departs_from_reduce_for_several_sequences():
    """For N sequences MKOR reduces over all N·S rows, K-FAC-reduce within each sequence:
    exact at N = 1, and from N = 2 on the product points elsewhere (sin∠ 0.36–0.43 from KC5's,
    0.39–0.50 from the GGN's, where KC5-empirical's own is 0.16–0.32).
    With the scale that makes N = 1 exact, MKOR/(N R) (independent of the loss's reduction),
    the relative distance to KC5 is 0.42–0.85 for N = 2–16."""
    measured = {}
    for N in DEPARTURES:
        rows = []
        for seed in range(3):
            net = nets.shared_reduce("mean", "mse", N=N, S=4, dims=(3, 4, 3, 2), seed=seed)
            loss_func = nets.make_loss("mse", "sum")
            with torch.no_grad():
                targets = nets.make_targets("mse", net.model(net.inputs), seed=seed + 1)
            for layer in net.layers[:2]:
                cap = capture(net.model, loss_func, net.inputs, targets, layer)
                A_m, G_m = oracle.mkor_rank1_factors(cap.a.detach().numpy(),
                                                     cap.loss_gradient().detach().numpy(), True)
                mkor = np.kron(G_m, A_m) / (N * cap.R)
                A, G = flavour_factors(cap, "empirical", "reduce")
                kc5 = np.kron(G, A)
                ggn = cv.ggn_block(net.model, loss_func, net.inputs, targets, layer).numpy()
                A2, G2 = flavour_factors(cap, "type-2", "reduce")
                assert _distance(np.kron(G2, A2), ggn) < 1e-13  # the reduce setting: exact
                rows.append((_shape_distance(mkor, kc5), _shape_distance(mkor, ggn),
                             _shape_distance(kc5, ggn), _distance(mkor, kc5)))
        measured[N] = np.mean(rows, axis=0)
    assert measured[1][0] < 1e-7 and measured[1][3] < 1e-13
    for N, want in DEPARTURES.items():
        assert np.allclose(measured[N], want, atol=5e-4), (N, measured[N])
        if N > 1:
            assert measured[N][0] > 0.3
