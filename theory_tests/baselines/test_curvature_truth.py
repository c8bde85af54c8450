"""The brute-force curvature (``theory_tests/support/curvature.py``, KC1, KC9) checked against
independent routes, float64: it is the truth the K-FAC flavours are held to, so it is tested
first (issue 46 item 1).

Measured here (max |error| / max |entry|): closed-form loss Hessian vs
``torch.autograd.functional.hessian`` 1.7e-16; GGN vs the parameter Hessian of a deep linear
net with MSE 3.9e-16 (joint, weight, bias, column-major), and 2.4 away for a Tanh MLP's first
layer, where they differ; EF vs per-sample gradients 2.1e-16; Fisher vs GGN 2.4e-16; experts'
blocks vs the Hessian of weight[e], bias[e] 1.9e-16; KC9 recovers a Kronecker product to
4.1e-16.
"""
import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call

from reference.baselines import kfac_flavours as oracle
from theory_tests.support import curvature as cv
from theory_tests.support import curvature_nets as nets
from theory_tests.support.curvature_capture import oracle_factors

TIGHT = 1e-13  # float64 rounding of these tiny sums is ~1e-16; the anchors use 1e-5


def rel_err(got, want):
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    return float((got - want).abs().max() / want.abs().max())


def _targets(net, kind):
    with torch.no_grad():
        return nets.make_targets(kind, net.model(net.inputs))


# ---------------------------------------------------------------- the loss Hessian (KC1, KC2)

@pytest.mark.parametrize("kind", ["ce", "mse"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_closed_form_loss_hessian_is_autograds(kind, reduction):
    """R · blockdiag(H_n) (the closed form, data points per KC1) equals the Hessian of
    ``loss_func(output, targets)`` w.r.t. a multi-dim output (CE (N, C, S), MSE (N, S, C))."""
    gen = torch.Generator().manual_seed(0)
    shape = (3, 4, 2) if kind == "ce" else (3, 2, 4)
    output = torch.randn(shape, generator=gen, dtype=torch.float64)
    loss_func = nets.make_loss(kind, reduction)
    targets = nets.make_targets(kind, output)
    hess = torch.autograd.functional.hessian(lambda f: loss_func(f, targets), output)
    hess = hess.reshape(output.numel(), output.numel())
    index = cv.output_points(loss_func, torch.arange(output.numel()).reshape(shape))
    R = cv.reduction_factor(loss_func, output)
    want = torch.zeros_like(hess)
    H = cv.loss_hessians(loss_func, cv.output_points(loss_func, output))
    for p in range(index.shape[0]):
        want[index[p][:, None], index[p][None, :]] = R * H[p]
    assert R == ({"sum": 1.0, "mean": 1 / (6 if kind == "ce" else 24)})[reduction]
    assert rel_err(want, hess) < TIGHT
    # points_to_output inverts output_points
    back = cv.points_to_output(cv.output_points(loss_func, output), output.shape, loss_func)
    assert torch.equal(back, output)


# ---------------------------------------------------------------- GGN

@pytest.mark.parametrize("net, kind", [
    (lambda: nets.transformer_block("ce"), "ce"), (lambda: nets.transformer_block("mse"), "mse"),
    (lambda: nets.conv_net("ce"), "ce"), (lambda: nets.mlp("relu", "ce", N=3), "ce")],
    ids=["transformer-ce", "transformer-mse", "conv-ce", "relu-mlp-ce"])
def test_ggn_is_symmetric_positive_semidefinite(net, kind):
    net = net()
    loss_func = nets.make_loss(kind, "mean")
    targets = _targets(net, kind)
    for layer in net.layers:
        ggn = cv.ggn_block(net.model, loss_func, net.inputs, targets, layer)
        assert rel_err(ggn.T, ggn) < TIGHT
        assert torch.linalg.eigvalsh(ggn).min() > -1e-14 * ggn.abs().max()
        assert ggn.abs().max() > 0


def _param_hessian(net, loss_func, targets, layer, part, column_major=False):
    """The Hessian of the loss w.r.t. the block's parameter vector, by autograd alone."""
    name = next(n for n, m in net.model.named_modules() if m is layer)
    d_out, d_in, _ = cv.layer_shape(layer)
    W0, b0 = layer.weight.detach(), layer.bias.detach()

    def loss_of(theta):
        if part == "joint":
            M = theta.reshape(d_in + 1, d_out).T if column_major else theta.reshape(d_out, d_in + 1)
            W, b = M[:, :-1].reshape(W0.shape), M[:, -1]
        else:
            W, b = (theta.reshape(W0.shape), b0) if part == "weight" else (W0, theta)
        out = functional_call(net.model, {f"{name}.weight": W, f"{name}.bias": b}, (net.inputs,))
        return loss_func(out, targets)

    M0 = torch.cat([W0.reshape(d_out, -1), b0[:, None]], dim=1)
    theta = {"joint": (M0.T if column_major else M0).reshape(-1),
             "weight": W0.reshape(-1), "bias": b0}[part]
    return torch.autograd.functional.hessian(loss_of, theta)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("S", [None, 3])
def test_ggn_is_the_hessian_for_a_deep_linear_net_with_mse(reduction, S):
    """A deep linear net's output is linear in each layer's parameters, so its block of the
    Hessian is the GGN's: joint, weight alone, bias alone, and column-major vec."""
    net = nets.deep_linear("mse", N=4, S=S)
    loss_func = nets.make_loss("mse", reduction)
    targets = _targets(net, "mse")
    for layer in net.layers:
        for part in ("joint", "weight", "bias"):
            ggn = cv.ggn_block(net.model, loss_func, net.inputs, targets, layer, part=part)
            assert rel_err(ggn, _param_hessian(net, loss_func, targets, layer, part)) < TIGHT
        d_out, d_in, _ = cv.layer_shape(layer)
        joint = cv.ggn_block(net.model, loss_func, net.inputs, targets, layer)
        col = _param_hessian(net, loss_func, targets, layer, "joint", column_major=True)
        assert rel_err(cv.column_major(joint, d_out, d_in + 1), col) < TIGHT


def test_ggn_is_not_the_hessian_of_a_tanh_mlps_first_layer():
    """The control: with a nonlinearity after the layer the two differ (so the check above
    can fail)."""
    net = nets.mlp("tanh", "mse", N=3)
    loss_func = nets.make_loss("mse", "sum")
    targets = _targets(net, "mse")
    layer = net.layers[0]
    ggn = cv.ggn_block(net.model, loss_func, net.inputs, targets, layer)
    assert rel_err(ggn, _param_hessian(net, loss_func, targets, layer, "joint")) > 0.1


# ---------------------------------------------------------------- EF and Fisher

@pytest.mark.parametrize("kind", ["ce", "mse"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_empirical_fisher_is_the_sum_of_per_sample_gradient_outer_products(kind, reduction):
    """EF = R Σ_n ∇ℓ_n ∇ℓ_nᵀ with ∇ℓ_n from one autograd call per sample (its loss summed)."""
    net = nets.mlp("tanh", kind, N=4)
    loss_func = nets.make_loss(kind, reduction)
    targets = _targets(net, kind)
    R = cv.reduction_factor(loss_func, net.model(net.inputs))
    one = nets.make_loss(kind, "sum")
    for layer in net.layers:
        want = 0
        for n in range(net.inputs.shape[0]):
            net.model.zero_grad()
            one(net.model(net.inputs[n:n + 1]), targets[n:n + 1]).backward()
            g = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1).reshape(-1)
            want = want + R * torch.outer(g, g)
        ef = cv.ef_block(net.model, loss_func, net.inputs, targets, layer)
        assert rel_err(ef, want) < TIGHT


@pytest.mark.parametrize("kind", ["ce", "mse"])
@pytest.mark.parametrize("make", [lambda k: nets.transformer_block(k),
                                  lambda k: nets.mlp("sigmoid", k, N=3)],
                         ids=["transformer", "sigmoid-mlp"])
def test_fisher_is_the_ggn_for_ce_and_mse(kind, make):
    """The expectation over the model's targets (CE enumerated, MSE's Gaussian in closed
    form, both from autograd gradients) equals the GGN; the EF does not."""
    net = make(kind)
    loss_func = nets.make_loss(kind, "mean")
    targets = _targets(net, kind)
    for layer in net.layers[-2:]:
        ggn = cv.ggn_block(net.model, loss_func, net.inputs, targets, layer)
        fisher = cv.fisher_block(net.model, loss_func, net.inputs, targets, layer)
        assert rel_err(fisher, ggn) < TIGHT
        assert rel_err(cv.ef_block(net.model, loss_func, net.inputs, targets, layer), ggn) > 1e-2


def test_a_fused_experts_block_is_its_slice_and_zero_for_an_expert_with_no_token():
    """Expert e's block is the GGN w.r.t. weight[e], bias[e]; expert 1 is routed no token."""
    net = nets.fused_experts("mse")
    loss_func = nets.make_loss("mse", "sum")
    targets = _targets(net, "mse")
    layer = net.layers[0]
    empty = cv.ggn_block(net.model, loss_func, net.inputs, targets, layer, expert=1)
    assert empty.abs().max() == 0
    for e in (0, 2):
        ggn = cv.ggn_block(net.model, loss_func, net.inputs, targets, layer, expert=e)
        W0, b0 = layer.weight.detach(), layer.bias.detach()

        def loss_of(theta, e=e):
            M = theta.reshape(W0.shape[1], W0.shape[2] + 1)
            W = torch.cat([W0[:e], M[None, :, :-1], W0[e + 1:]])
            b = torch.cat([b0[:e], M[None, :, -1], b0[e + 1:]])
            out = functional_call(net.model, {"0.weight": W, "0.bias": b}, (net.inputs,))
            return loss_func(out, targets)

        theta = torch.cat([W0[e], b0[e][:, None]], dim=1).reshape(-1)
        assert rel_err(ggn, torch.autograd.functional.hessian(loss_of, theta)) < TIGHT


# ---------------------------------------------------------------- KC9

def _random_psd(n, gen):
    X = torch.randn(n, n, generator=gen, dtype=torch.float64)
    return X @ X.T + 0.1 * torch.eye(n, dtype=torch.float64)


def test_best_kronecker_recovers_an_exact_kronecker_product():
    gen = torch.Generator().manual_seed(3)
    G0, A0 = _random_psd(3, gen), _random_psd(4, gen)
    G, A = cv.best_kronecker(torch.kron(G0, A0), 3, 4)
    assert rel_err(torch.kron(G, A), torch.kron(G0, A0)) < TIGHT
    assert torch.trace(A) > 0 and torch.trace(G) > 0
    # the oracle's KC9 is the same decomposition
    Gn, An = oracle.best_kronecker(torch.kron(G0, A0).numpy(), 3, 4)
    assert rel_err(np.kron(Gn, An), torch.kron(G0, A0)) < TIGHT


def test_best_kronecker_is_no_farther_than_any_other_kronecker_product():
    """On a transformer block's GGN blocks: closer than K-FAC's type-2 products (expand and
    reduce), random ones and perturbations of the optimum itself."""
    net = nets.transformer_block("ce")
    loss_func = nets.make_loss("ce", "mean")
    targets = _targets(net, "ce")
    gen = torch.Generator().manual_seed(5)
    for layer in net.layers[::3]:
        d_out, d_in, _ = cv.layer_shape(layer)
        block = cv.ggn_block(net.model, loss_func, net.inputs, targets, layer)
        G, A = cv.best_kronecker(block, d_out, d_in + 1)
        best = torch.linalg.norm(block - torch.kron(G, A))
        Gn, An = oracle.best_kronecker(block.numpy(), d_out, d_in + 1)
        assert rel_err(np.kron(Gn, An), torch.kron(G, A)) < 1e-12
        others = [torch.kron(_random_psd(d_out, gen), _random_psd(d_in + 1, gen)) / 50
                  for _ in range(5)]
        for approx in ("expand", "reduce"):  # K-FAC's own, type-2
            A_k, G_k = oracle_factors(net.model, loss_func, net.inputs, targets, layer,
                                      approx=approx)
            others.append(torch.from_numpy(np.kron(G_k, A_k)))
        for eps in (1e-3, 1e-1):
            others += [torch.kron(G + eps * _random_psd(d_out, gen), A),
                       torch.kron(G, A - eps * _random_psd(d_in + 1, gen))]
        for other in others:
            assert best <= torch.linalg.norm(block - other) * (1 + 1e-12)


# ---------------------------------------------------------------- refusals

@pytest.mark.parametrize("loss_func, message", [
    (nn.CrossEntropyLoss(label_smoothing=0.1), "label_smoothing"),
    (nn.CrossEntropyLoss(weight=torch.ones(3, dtype=torch.float64)), "weight"),
    (nn.CrossEntropyLoss(reduction="none"), "reduction"),
    (nn.L1Loss(), "nn.MSELoss or nn.CrossEntropyLoss")])
def test_unsupported_losses_are_refused_by_name(loss_func, message):
    net = nets.mlp("tanh", "ce", N=2)
    targets = _targets(net, "ce")
    with pytest.raises(ValueError, match=message):
        cv.ggn_block(net.model, loss_func, net.inputs, targets, net.layers[0])


def test_ignored_targets_wrong_parts_and_foreign_layers_are_refused():
    net = nets.mlp("tanh", "ce", N=2)
    loss_func = nets.make_loss("ce", "mean")
    targets = _targets(net, "ce")
    with pytest.raises(ValueError, match="ignore_index"):
        cv.ggn_block(net.model, loss_func, net.inputs, torch.tensor([0, -100]), net.layers[0])
    with pytest.raises(ValueError, match="part"):
        cv.ggn_block(net.model, loss_func, net.inputs, targets, net.layers[0], part="both")
    with pytest.raises(ValueError, match="not a module of model"):
        cv.ggn_block(net.model, loss_func, net.inputs, targets, nn.Linear(3, 4))
    experts = nets.fused_experts("mse")
    expert_targets = _targets(experts, "mse")
    for layer, expert, message in ((experts.layers[0], None, "needs one"),
                                   (experts.layers[0], 3, "not one of"),
                                   (experts.layers[1], 0, "fused-expert")):
        with pytest.raises(ValueError, match=message):
            cv.ggn_block(experts.model, nn.MSELoss(), experts.inputs, expert_targets, layer,
                         expert=expert)
    no_bias = nets.deep_linear("mse", bias=False)
    with pytest.raises(ValueError, match="no bias"):
        cv.ggn_block(no_bias.model, nn.MSELoss(), no_bias.inputs,
                     _targets(no_bias, "mse"), no_bias.layers[0], part="bias")
