"""The K-FAC-flavours oracle (``reference/baselines/kfac_flavours.py``, KC2–KC5) against the
brute-force curvature (``theory_tests/support/curvature.py``), float64 (issue 46 item 3): the
oracle is fed the rows and backpropagated columns of a plain-autograd capture
(``theory_tests/support/curvature_capture.py``), and kron(G, A) must equal the exact block where
the flavour is exact, and must not where it is not.

Measured (max |error| / max |entry|, this machine): type-2 expand = GGN on deep linear nets
9.2e-16 (N = 6, S ∈ {1, 5}, MSE mean and sum; column-major, weight-only and bias-only blocks
alike ≤ 1.1e-15); batch size 1 with Tanh / ReLU / Sigmoid × MSE / CE × mean / sum: type-2 =
GGN 4.4e-16 and empirical = EF 4.4e-16; reduce = GGN in the reduce setting 4.2e-16 while
expand is off by 1 − 1/S (0.667 at S = 3); mixed net: reduce exact everywhere (3.7e-16),
expand after the reduction only (2.2e-16; 0.667 before it); conv net: reduce exact for the
second conv and the head (1.8e-16), not the first (0.38); per expert 3.4e-16. MC: see
``test_mc_converges_to_the_fisher_at_its_rate`` and ``paper_notes/curvature.md``.
"""
import numpy as np
import pytest
import torch

from reference.baselines import kfac_flavours as oracle
from theory_tests.support import curvature as cv
from theory_tests.support import curvature_nets as nets
from theory_tests.support.curvature_capture import capture, flavour_factors, oracle_factors

TIGHT = 1e-13
OFF = 1e-2  # "not exact": a relative error at least this large


def rel_err(got, want):
    got, want = np.asarray(got), np.asarray(want)
    return float(np.abs(got - want).max() / np.abs(want).max())


def _setup(net, kind, reduction):
    loss_func = nets.make_loss(kind, reduction)
    with torch.no_grad():
        targets = nets.make_targets(kind, net.model(net.inputs))
    return loss_func, targets


def _block(fn, net, loss_func, targets, layer, **kw):
    return fn(net.model, loss_func, net.inputs, targets, layer, **kw).numpy()


# ---------------------------------------------------------------- expand (KC4), type-2 (KC2)

@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("S", [None, 5])
def test_type2_expand_is_the_ggn_of_a_deep_linear_net(reduction, S):
    """L = 3, N = 6, S = 1 or 5 tokens with per-token targets: kron(G, A) = GGN for each layer,
    both flattenings (kron(A, G) = the column-major block), bias joint and separate."""
    net = nets.deep_linear("mse", N=6, S=S)
    loss_func, targets = _setup(net, "mse", reduction)
    for layer in net.layers:
        A, G = oracle_factors(net.model, loss_func, net.inputs, targets, layer)
        ggn = cv.ggn_block(net.model, loss_func, net.inputs, targets, layer)
        assert rel_err(np.kron(G, A), ggn) < TIGHT
        d_out, d_in, _ = cv.layer_shape(layer)
        assert rel_err(np.kron(A, G), cv.column_major(ggn, d_out, d_in + 1)) < TIGHT
        # bias separate: the weight's block pairs G with A's weight part, the bias's with A's 1
        weight = _block(cv.ggn_block, net, loss_func, targets, layer, part="weight")
        bias = _block(cv.ggn_block, net, loss_func, targets, layer, part="bias")
        assert rel_err(np.kron(G, A[:-1, :-1]), weight) < TIGHT
        assert A[-1, -1] == 1.0 and rel_err(G, bias) < TIGHT


def test_type2_expand_is_the_ggn_without_a_bias():
    net = nets.deep_linear("mse", N=6, S=2, bias=False)
    loss_func, targets = _setup(net, "mse", "mean")
    for layer in net.layers:
        A, G = oracle_factors(net.model, loss_func, net.inputs, targets, layer)
        d_out, d_in, _ = cv.layer_shape(layer)
        assert A.shape == (d_in, d_in)
        assert rel_err(np.kron(G, A), _block(cv.ggn_block, net, loss_func, targets, layer)) < TIGHT


@pytest.mark.parametrize("activation", ["tanh", "relu", "sigmoid"])
@pytest.mark.parametrize("kind", ["mse", "ce"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_batch_size_one_type2_is_the_ggn_and_empirical_is_the_ef(activation, kind, reduction):
    """One data point: G ⊗ A = GGN (type-2) and EF (empirical columns) through a nonlinearity;
    the empirical columns are (1/R) ∂L/∂f of the training loss itself."""
    net = nets.mlp(activation, kind, N=1)
    loss_func, targets = _setup(net, kind, reduction)
    for layer in net.layers:
        cap = capture(net.model, loss_func, net.inputs, targets, layer)
        A, G = flavour_factors(cap, "type-2", "expand")
        assert rel_err(np.kron(G, A), _block(cv.ggn_block, net, loss_func, targets, layer)) < TIGHT
        A, G = flavour_factors(cap, "empirical", "expand")
        assert rel_err(np.kron(G, A), _block(cv.ef_block, net, loss_func, targets, layer)) < TIGHT
        # G = (1/R) Σ_rows ĝ ĝᵀ from the reduced loss's own gradient rows
        g = cap.loss_gradient().detach().numpy().reshape(-1, G.shape[0])
        assert rel_err(g.T @ g / cap.R, G) < TIGHT


def test_type2_is_not_the_ggn_beyond_one_data_point_with_a_nonlinearity():
    """The control for the batch-size-1 case: with N = 3 the sum over points of J Jᵀ-products
    no longer factors."""
    net = nets.mlp("tanh", "ce", N=3)
    loss_func, targets = _setup(net, "ce", "mean")
    layer = net.layers[0]
    A, G = oracle_factors(net.model, loss_func, net.inputs, targets, layer)
    assert rel_err(np.kron(G, A), _block(cv.ggn_block, net, loss_func, targets, layer)) > OFF


# ---------------------------------------------------------------- reduce (KC5)

@pytest.mark.parametrize("how", ["mean", "sum"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_reduce_is_the_ggn_in_the_reduce_setting_and_expand_is_not(how, reduction):
    """Tokens reduced (mean or sum) before an MSE loss: reduce exact for both layers, expand
    off by a relative 1 − 1/S or more."""
    net = nets.shared_reduce(how, "mse", N=4, S=3)
    loss_func, targets = _setup(net, "mse", reduction)
    for layer in net.layers:
        ggn = _block(cv.ggn_block, net, loss_func, targets, layer)
        A, G = oracle_factors(net.model, loss_func, net.inputs, targets, layer, approx="reduce")
        assert rel_err(np.kron(G, A), ggn) < TIGHT
        assert rel_err(np.kron(A, G), cv.column_major(torch.from_numpy(ggn), G.shape[0],
                                                       A.shape[0])) < TIGHT
        A, G = oracle_factors(net.model, loss_func, net.inputs, targets, layer, approx="expand")
        assert rel_err(np.kron(G, A), ggn) > 0.5


@pytest.mark.parametrize("how", ["mean", "sum"])
def test_mixed_net_reduce_is_exact_everywhere_expand_only_after_the_reduction(how):
    net = nets.mixed(how, "mse", N=4, S=3)
    loss_func, targets = _setup(net, "mse", "sum")
    for i, layer in enumerate(net.layers):
        ggn = _block(cv.ggn_block, net, loss_func, targets, layer)
        A, G = oracle_factors(net.model, loss_func, net.inputs, targets, layer, approx="reduce")
        assert rel_err(np.kron(G, A), ggn) < TIGHT
        A, G = oracle_factors(net.model, loss_func, net.inputs, targets, layer, approx="expand")
        error = rel_err(np.kron(G, A), ggn)
        assert error < TIGHT if i == 2 else error > OFF


def test_conv_net_with_a_sum_over_positions_reduce_is_exact_after_the_first_conv():
    """Conv2d's shared positions are its L patches: the second conv (whose every position
    reaches the output through the same sum) and the head are exact under reduce; the first
    conv is not (its positions reach the second conv's taps unevenly), nor is expand."""
    net = nets.conv_net("mse", N=2)
    loss_func, targets = _setup(net, "mse", "sum")
    errors = {}
    for i, layer in enumerate(net.layers):
        ggn = _block(cv.ggn_block, net, loss_func, targets, layer)
        for approx in ("reduce", "expand"):
            A, G = oracle_factors(net.model, loss_func, net.inputs, targets, layer, approx=approx)
            errors[i, approx] = rel_err(np.kron(G, A), ggn)
    assert errors[1, "reduce"] < TIGHT and errors[2, "reduce"] < TIGHT
    assert errors[0, "reduce"] > OFF and errors[1, "expand"] > OFF
    assert errors[2, "expand"] < TIGHT  # the head sees one row per sample


# ---------------------------------------------------------------- experts

@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_each_expert_s_factors_are_the_ggn_block_over_its_routed_tokens(reduction):
    """Fused experts (top-1, fixed routes, expert 1 routed nothing) and a linear head: per
    expert, kron(G_e, A_e) over its own rows = the GGN block of weight[e], bias[e]; the empty
    expert has no factors and a zero block."""
    net = nets.fused_experts("mse")
    loss_func, targets = _setup(net, "mse", reduction)
    layer = net.layers[0]
    cap = capture(net.model, loss_func, net.inputs, targets, layer)
    g = cap.backprop(oracle.kfac_columns("mse", "type-2", cap.points, cap.targets))
    factors = oracle.expert_expand_factors(cap.a.detach().numpy(), g.numpy(),
                                           layer.routes.numpy(), 3, cap.R, has_bias=True)
    assert factors[1] is None
    assert np.abs(_block(cv.ggn_block, net, loss_func, targets, layer, expert=1)).max() == 0
    for e in (0, 2):
        A, G = factors[e]
        ggn = _block(cv.ggn_block, net, loss_func, targets, layer, expert=e)
        assert rel_err(np.kron(G, A), ggn) < TIGHT
    # the control: expert 0's factors are not expert 2's block
    A, G = factors[0]
    assert rel_err(np.kron(G, A), _block(cv.ggn_block, net, loss_func, targets, layer,
                                         expert=2)) > OFF


# ---------------------------------------------------------------- KC2 and KC3 by themselves

def test_hessian_square_roots_square_to_the_closed_form_hessians():
    gen = torch.Generator().manual_seed(2)
    f = torch.randn(5, 4, generator=gen, dtype=torch.float64) * 3
    for kind in ("ce", "mse"):
        S = oracle.hessian_sqrt(kind, f.numpy())
        H = cv.loss_hessians(nets.make_loss(kind, "sum"), f).numpy()
        assert rel_err(S @ S.transpose(0, 2, 1), H) < TIGHT
    # type-2 columns are S's columns (not its rows): Σ_c col colᵀ = H
    cols = oracle.kfac_columns("ce", "type-2", f.numpy(), None)
    H = cv.loss_hessians(nets.make_loss("ce", "sum"), f).numpy()
    assert rel_err(np.einsum("kpc,kpd->pcd", cols, cols), H) < TIGHT


def test_empirical_columns_are_autograds_loss_gradients():
    gen = torch.Generator().manual_seed(4)
    f = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    for kind in ("ce", "mse"):
        loss_func = nets.make_loss(kind, "sum")
        y = cv.target_points(loss_func, nets.make_targets(kind, f), f)
        cols = oracle.kfac_columns(kind, "empirical", f.numpy(), y.numpy())
        assert rel_err(cols[0], cv.loss_gradients(loss_func, f, y)) < TIGHT


def _mc_errors(cap, fisher, samples, seeds):
    """‖kron(G_mc, A) − F‖_F / ‖F‖_F for each seed."""
    out = []
    for seed in seeds:
        A, G = flavour_factors(cap, "mc", "expand", samples=samples, seed=seed)
        out.append(np.linalg.norm(np.kron(G, A) - fisher) / np.linalg.norm(fisher))
    return np.array(out)


@pytest.mark.parametrize("kind", ["ce", "mse"])
def test_mc_converges_to_the_fisher_at_its_rate(kind):
    """MC columns are unbiased, so E‖Ĝ_M − F‖² = v/M. Over K = 150 fixed seeds the mean of
    M·e² must agree between M and 4M within 4 standard errors (a sampler from the targets
    instead of the model, or a wrong weight 1/√M, breaks it), and the RMS error halves.

    On a Tanh MLP at batch size 1 (CE) and a deep linear net at N = 6 (MSE), where type-2
    K-FAC equals the Fisher, so MC K-FAC converges to the Fisher block itself.
    """
    net = nets.mlp("tanh", "ce", N=1) if kind == "ce" else nets.deep_linear("mse", N=6)
    loss_func, targets = _setup(net, kind, "mean")
    layer = net.layers[0]
    fisher = _block(cv.fisher_block, net, loss_func, targets, layer)
    cap = capture(net.model, loss_func, net.inputs, targets, layer)
    seeds, M = range(150), 4
    z = {}
    for m in (M, 4 * M):
        e2 = _mc_errors(cap, fisher, m, seeds) ** 2
        z[m] = (m * e2.mean(), m * e2.std(ddof=1) / np.sqrt(len(e2)))
    (z1, se1), (z4, se4) = z[M], z[4 * M]
    assert abs(z1 - z4) < 4 * np.hypot(se1, se4), z
    assert 1.7 < np.sqrt(z1 / M) / np.sqrt(z4 / (4 * M)) < 2.3


def test_mc_with_many_samples_is_within_its_standard_error_of_the_fisher():
    """25,000 samples (the peers' check) on the Tanh MLP with CE: the error is within
    4·√(v/M), v = E‖X − F‖² of one sample computed exactly by enumerating the classes."""
    net = nets.mlp("tanh", "ce", N=1)
    loss_func, targets = _setup(net, "ce", "sum")
    layer = net.layers[1]
    fisher = _block(cv.fisher_block, net, loss_func, targets, layer)
    cap = capture(net.model, loss_func, net.inputs, targets, layer)
    A, _ = flavour_factors(cap, "type-2", "expand")
    p = oracle.softmax(cap.points)[0]
    grads = cap.backprop(np.eye(3)[:, None, :] - p)  # column for class c: ∇_f ℓ(c) = p − e_c
    v = sum(p[c] * np.linalg.norm(np.kron(np.outer(g, g), A) - fisher) ** 2
            for c, g in enumerate(grads.numpy().reshape(3, -1)))
    M = 25_000
    A, G = flavour_factors(cap, "mc", "expand", samples=M, seed=7)
    error = np.linalg.norm(np.kron(G, A) - fisher)
    assert error < 4 * np.sqrt(v / M)
    assert np.abs(np.kron(G, A) - fisher).max() < 5e-4 + 5e-2 * np.abs(fisher).max()


# ---------------------------------------------------------------- refusals

def test_bad_input_is_refused_by_name():
    f = np.zeros((2, 3))
    with pytest.raises(ValueError, match="fisher_type"):
        oracle.kfac_columns("ce", "type-3", f, None)
    with pytest.raises(ValueError, match="loss kind"):
        oracle.kfac_columns("bce", "type-2", f, None)
    with pytest.raises(ValueError, match="rng"):
        oracle.kfac_columns("ce", "mc", f, None)
    with pytest.raises(ValueError, match=r"\(P, C\)"):
        oracle.hessian_sqrt("ce", np.zeros(3))
    with pytest.raises(ValueError, match="reduction"):
        oracle.reduction_factor("mse", "none", 2, 6)
    with pytest.raises(ValueError, match="must be"):
        oracle.expand_factors(np.zeros((2, 3, 4)), np.zeros((1, 2, 4, 5)), 1.0)
    with pytest.raises(ValueError, match="no rows"):
        oracle.reduce_factors(np.zeros((0, 3, 4)), np.zeros((1, 0, 3, 5)), 1.0)
    with pytest.raises(ValueError, match="block"):
        oracle.best_kronecker(np.zeros((6, 6)), 2, 4)
    assert oracle.reduction_factor("ce", "mean", 4, 12) == 0.25
    assert oracle.reduction_factor("mse", "mean", 4, 12) == 1 / 12
