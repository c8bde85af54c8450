"""K-FAC in every flavour in the port (issue 46, items 2-3; claims rows KC4-PORT, KFAC-FLAVOURS):
``torch_impl.kfac_factors`` against the exact curvature of its loss, in float64, where the
flavour is exact (the "KFAC from scratch" cases): type-2 expand = GGN on deep linear nets
(any batch, MSE mean and sum, per-token targets), type-2 = GGN and empirical = EF at batch
size 1 with nonlinearities (MSE and CE), reduce = GGN in the reduce setting where expand is
not, both flattenings, bias joint and separate, per expert of a fused stack at one token;
MC converges to the Fisher at the rate 1/sqrt(M). The brute force (explicit Jacobians and the
loss Hessian from autograd, no Kronecker code) is ``_exact`` below. The brute force is helper A's
``theory_tests/support/curvature.py`` (explicit Jacobians and the loss Hessian, no Kronecker
code); relative errors are to the block's largest entry. And the port equals the numpy oracle
``reference/baselines/kfac_flavours.py`` (fed by plain hooks, ``curvature_capture.py``) to
1e-12 on every test network of ``curvature_nets.py``, every flavour.

The optimizer's flavours (``KFAC(fisher_type=, kfac_approx=)`` with ``curvature_backward``)
are in ``test_kfac_flavours_optimizer.py``.
"""
import gc
import math
import weakref

import numpy as np
import pytest
import torch
import torch.nn as nn

from reference.baselines import kfac_flavours as oracle
from theory_tests.support import curvature
from theory_tests.support import curvature_nets as nets
from theory_tests.support.curvature_capture import capture, oracle_factors
from torch_impl import kfac_factors
from torch_impl.baselines import kfac_flavours as kf

f64 = torch.float64
TOL = 1e-12


def _rel(K, T):
    return ((K - T).abs().max() / T.abs().max()).item()


def _exact(model, loss_func, inputs, targets, name, kind):
    """The KC1 block of layer ``name`` by brute force (``theory_tests/support/curvature.py``:
    explicit Jacobians, no Kronecker code): "ggn" or "ef"."""
    layer = dict(model.named_modules())[name]
    block = curvature.ggn_block if kind == "ggn" else curvature.ef_block
    return block(model, loss_func, inputs, targets, layer)


def _deep_linear(L, bias=True, d=(3, 4, 5, 2)):
    return nn.Sequential(*[nn.Linear(d[i], d[i + 1], bias=bias) for i in range(L)]).double()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# -- type-2 expand = GGN on deep linear nets ---------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("S", [None, 5], ids=["rows", "per-token"])
@pytest.mark.parametrize("N", [1, 6])
def test_type2_expand_is_the_ggn_of_a_deep_linear_net(N, S, reduction):
    """Any batch size, MSE mean and sum, one output per sample or per token (the expand
    setting): kron(G, A) = the GGN block of every layer, bias joint."""
    model = _deep_linear(3)
    shape = (N, 3) if S is None else (N, S, 3)
    x = torch.randn(*shape, dtype=f64)
    y = torch.randn(*shape[:-1], 2, dtype=f64)
    lf = nn.MSELoss(reduction=reduction)
    for name, (A, G) in kfac_factors(model, lf, x, y).items():
        err = _rel(torch.kron(G, A), _exact(model, lf, x, y, name, "ggn"))
        print(f"type-2 expand deep linear N={N} S={S} {reduction} {name}: {err:.2e}")
        assert err < TOL


@pytest.mark.parametrize("act", [nn.Tanh, nn.Sigmoid, nn.ReLU])
@pytest.mark.parametrize("loss", ["mse", "ce"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_batch_size_one_type2_is_the_ggn_and_empirical_the_ef(act, loss, reduction):
    """One data point, nonlinear MLP: type-2 = GGN and empirical = EF, every layer."""
    model = nn.Sequential(nn.Linear(3, 4), act(), nn.Linear(4, 5), act(),
                          nn.Linear(5, 3)).double()
    x = torch.randn(1, 3, dtype=f64)
    if loss == "mse":
        lf, y = nn.MSELoss(reduction=reduction), torch.randn(1, 3, dtype=f64)
    else:
        lf, y = nn.CrossEntropyLoss(reduction=reduction), torch.tensor([2])
    for fisher, kind in (("type-2", "ggn"), ("empirical", "ef")):
        for name, (A, G) in kfac_factors(model, lf, x, y, fisher_type=fisher).items():
            err = _rel(torch.kron(G, A), _exact(model, lf, x, y, name, kind))
            print(f"{fisher} N=1 {act.__name__} {loss} {reduction} {name}: {err:.2e}")
            assert err < TOL


class _ReduceNet(nn.Module):
    """L linear layers on (N, S, d) tokens, the S outputs averaged (or summed) before the loss
    (the reduce setting), then ``after`` linear layers on the reduced features."""

    def __init__(self, L, after=0, how="mean"):
        super().__init__()
        self.before = nn.Sequential(*[nn.Linear(3, 3) for _ in range(L)])
        self.after = nn.Sequential(*[nn.Linear(3, 3) for _ in range(after)])
        self.how = how

    def forward(self, x):
        h = self.before(x)
        return self.after(h.mean(1) if self.how == "mean" else h.sum(1))


@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("how", ["mean", "sum"])
def test_reduce_is_the_ggn_in_the_reduce_setting_and_expand_is_not(L, how):
    """Weight sharing over S = 5 tokens reduced before an MSE loss: type-2 reduce equals the
    GGN of every shared layer; expand misses it by far (printed)."""
    model = _ReduceNet(L, how=how).double()
    x, y = torch.randn(6, 5, 3, dtype=f64), torch.randn(6, 3, dtype=f64)
    lf = nn.MSELoss()
    reduce = kfac_factors(model, lf, x, y, kfac_approx="reduce")
    expand = kfac_factors(model, lf, x, y, kfac_approx="expand")
    for name in reduce:
        T = _exact(model, lf, x, y, name, "ggn")
        err_r = _rel(torch.kron(reduce[name][1], reduce[name][0]), T)
        err_e = _rel(torch.kron(expand[name][1], expand[name][0]), T)
        print(f"reduce setting L={L} {how} {name}: reduce {err_r:.2e}, expand {err_e:.2e}")
        assert err_r < TOL and err_e > 0.1


def test_mixed_net_reduce_is_exact_everywhere_expand_only_after_the_reduction():
    """Two shared layers, the tokens reduced, two more layers: reduce = GGN everywhere;
    expand = GGN only for the layers after the reduction (one row per sample there)."""
    model = _ReduceNet(2, after=2).double()
    x, y = torch.randn(6, 5, 3, dtype=f64), torch.randn(6, 3, dtype=f64)
    lf = nn.MSELoss(reduction="sum")
    reduce = kfac_factors(model, lf, x, y, kfac_approx="reduce")
    expand = kfac_factors(model, lf, x, y, kfac_approx="expand")
    for name in reduce:
        T = _exact(model, lf, x, y, name, "ggn")
        (Ar, Gr), (Ae, Ge) = reduce[name], expand[name]
        assert _rel(torch.kron(Gr, Ar), T) < TOL
        assert (_rel(torch.kron(Ge, Ae), T) < TOL) == name.startswith("after")


class _TwoCalls(nn.Module):
    """One Linear called twice per forward (two halves of each sample's input), its outputs
    added, then a head: a weight shared over calls, in the reduce setting."""

    def __init__(self):
        super().__init__()
        self.shared, self.head = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.shared(x[:, :3]) + self.shared(x[:, 3:]))


def test_reduce_over_a_layers_calls_is_the_ggn():
    """A layer called twice per forward: reduce averages each sample's rows of both calls
    (and sums their gradients), which is the GGN of the deep linear net; expand is not."""
    model = _TwoCalls().double()
    x, y = torch.randn(6, 6, dtype=f64), torch.randn(6, 2, dtype=f64)
    lf = nn.MSELoss()
    A, G = kfac_factors(model, lf, x, y, kfac_approx="reduce")["shared"]
    T = _exact(model, lf, x, y, "shared", "ggn")
    Ae, Ge = kfac_factors(model, lf, x, y, kfac_approx="expand")["shared"]
    assert _rel(torch.kron(G, A), T) < TOL and _rel(torch.kron(Ge, Ae), T) > 0.1


@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_a_mean_is_the_sum_over_the_counted_positions(loss):
    """R of a mean: G(mean) = G(sum) / (positions counted): CE's targets that are not
    ignore_index (per token), MSE's every output entry (N S C)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 5)).double()
    x = torch.randn(2, 4, 3, dtype=f64)
    if loss == "ce":
        y = torch.randint(0, 5, (2, 4)).masked_fill(torch.tensor([[0, 1, 0, 0], [1, 0, 0, 0]])
                                                    .bool(), -100)
        model = nn.Sequential(model, _ClassAxis())
        mean, total, count = nn.CrossEntropyLoss(), nn.CrossEntropyLoss(reduction="sum"), 6
    else:
        y = torch.randn(2, 4, 5, dtype=f64)
        mean, total, count = nn.MSELoss(), nn.MSELoss(reduction="sum"), 40
    for fisher in ("type-2", "empirical"):
        Gm = kfac_factors(model, mean, x, y, fisher_type=fisher)
        Gs = kfac_factors(model, total, x, y, fisher_type=fisher)
        for name in Gm:
            assert _rel(Gm[name][1] * count, Gs[name][1]) < TOL


class _ClassAxis(nn.Module):
    def forward(self, h):  # (N, S, C) -> (N, C, S): CrossEntropyLoss's class axis
        return h.transpose(1, 2)


def test_both_flattenings_and_bias_joint_or_separate():
    """Row-major W (ours): kron(G, A); column-major vec(W): kron(A, G); the bias alone: G
    (times A's corner 1), the weight alone: kron(G, A without its bias row/column)."""
    model = _deep_linear(2)
    x, y = torch.randn(6, 3, dtype=f64), torch.randn(6, 5, dtype=f64)
    lf = nn.MSELoss()
    for name, (A, G) in kfac_factors(model, lf, x, y).items():
        T = _exact(model, lf, x, y, name, "ggn")
        d_out, d_in = G.shape[0], A.shape[0]
        # column-major: entry (i, j) of [W | b] at j d_out + i instead of i d_in + j
        perm = torch.arange(d_out * d_in).reshape(d_out, d_in).T.reshape(-1)
        assert _rel(torch.kron(A, G), T[perm][:, perm]) < TOL
        w = torch.arange(d_out * d_in).reshape(d_out, d_in)
        W_idx, b_idx = w[:, :-1].reshape(-1), w[:, -1]
        assert _rel(torch.kron(G, A[:-1, :-1]), T[W_idx][:, W_idx]) < TOL
        assert A[-1, -1] == 1 and _rel(G, T[b_idx][:, b_idx]) < TOL


def test_mc_converges_to_the_fisher_at_one_over_sqrt_m():
    """At N = 1 (K-FAC exact there) the MC factors' distance to the GGN (= the Fisher of CE)
    falls as 1/sqrt(M): averaged over 6 seeds, 16x the samples gives 1/4 of the error (within
    a factor 2)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x, y, lf = torch.randn(1, 3, dtype=f64), torch.tensor([1]), nn.CrossEntropyLoss()
    T = _exact(model, lf, x, y, "2", "ggn")

    def err(M, seed):
        g = torch.Generator().manual_seed(seed)
        A, G = kfac_factors(model, lf, x, y, fisher_type="mc", mc_samples=M,
                            generator=g)["2"]
        return _rel(torch.kron(G, A), T)
    small = sum(err(8, s) for s in range(6)) / 6
    large = sum(err(128, s) for s in range(6)) / 6
    print(f"mc error: M=8 {small:.3g}, M=128 {large:.3g}, ratio {small / large:.2f}")
    assert 2 < small / large < 8 and large < 0.2


def test_experts_factors_are_each_experts_ggn_block_at_one_token():
    """A fused Mixtral experts block (float64, eager) and a head, one token: every routed
    expert's kron(G_e, A_e) equals the GGN block of its own matrices; the experts routed
    nothing get zeros."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral import modeling_mixtral
    config = transformers.MixtralConfig(hidden_size=16, intermediate_size=12,
                                        num_local_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    moe = modeling_mixtral.MixtralSparseMoeBlock(config).double()
    for p in moe.parameters():  # the fused parameters are created empty
        nn.init.normal_(p, std=0.3)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.moe, self.head = moe, nn.Linear(16, 5).double()

        def forward(self, x):  # (1, 16): one token of a sequence of one
            return self.head(self.moe(x.unsqueeze(0)).squeeze(0))
    model = Net()
    x, y, lf = torch.randn(1, 16, dtype=f64), torch.tensor([3]), nn.CrossEntropyLoss()
    factors = kfac_factors(model, lf, x, y)
    out = model(x)
    H = torch.autograd.functional.hessian(lambda z: lf(z.reshape(out.shape), y),
                                          out.detach().reshape(-1))
    routed = 0
    for proj in ("gate_up_proj", "down_proj"):
        A, G = factors[f"moe.experts.{proj}"]
        W0 = getattr(moe.experts, proj)  # (E, d_out, d_in): expert e's [W_e] row-major
        J = torch.stack([torch.autograd.grad(out.reshape(-1)[i], W0, retain_graph=True)[0]
                         for i in range(out.numel())]).reshape(out.numel(), W0.shape[0], -1)
        for e in range(W0.shape[0]):
            T = J[:, e].T @ H @ J[:, e]
            K = torch.kron(G[e], A[e])
            if T.abs().max() == 0:
                assert K.abs().max() == 0 and A[e].abs().max() == 0
                continue
            routed += 1
            print(f"expert {e} {proj}: {_rel(K, T):.2e}")
            assert _rel(K, T) < TOL
    assert routed == 4  # top-2 of 4 experts, two projections each


# -- the stateless function's contract ---------------------------------------------------
def test_kfac_factors_leaves_no_hooks_no_graph_and_no_grad():
    """No hook stays on any module (also when it raises after the forward), nothing of the
    forward's graph outlives the call, no .grad is written, a preset .grad is unchanged, and
    the parameters' values too."""
    model = _deep_linear(2)
    model[0].weight.grad = torch.ones_like(model[0].weight)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(4, 3, dtype=f64), torch.randn(4, 5, dtype=f64)
    seen = []  # weak references to the forward's output and a hidden layer's
    handles = [m.register_forward_hook(lambda m, a, out: seen.append(weakref.ref(out)))
               for m in (model, model[0])]
    kfac_factors(model, nn.MSELoss(), x, y)
    for h in handles:
        h.remove()
    gc.collect()
    assert len(seen) == 2 and all(r() is None for r in seen)  # its graph died with them
    with pytest.raises(ValueError, match="targets"):
        kfac_factors(model, nn.MSELoss(), x, y[:, :2])
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))
    assert model[0].bias.grad is None and model[1].weight.grad is None
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("kwargs, match", [
    (dict(fisher_type="fisher"), "fisher_type"),
    (dict(kfac_approx="sum"), "kfac_approx"),
    (dict(mc_samples=0), "mc_samples"),
    (dict(mc_samples=1.5), "mc_samples"),
    (dict(generator=0), "generator"),
])
def test_bad_options_are_named(kwargs, match):
    model, x, y = _deep_linear(1), torch.randn(2, 3, dtype=f64), torch.randn(2, 4, dtype=f64)
    with pytest.raises(ValueError, match=match):
        kfac_factors(model, nn.MSELoss(), x, y, **kwargs)


@pytest.mark.parametrize("loss, match", [
    (nn.L1Loss(), "MSELoss or torch.nn.CrossEntropyLoss"),
    (nn.CrossEntropyLoss(label_smoothing=0.1), "label_smoothing"),
    (nn.CrossEntropyLoss(weight=torch.ones(4, dtype=f64)), "weight"),
    (nn.CrossEntropyLoss(reduction="none"), "reduction"),
])
def test_unsupported_losses_are_refused_by_name(loss, match):
    model, x = _deep_linear(1), torch.randn(2, 3, dtype=f64)
    with pytest.raises(ValueError, match=match):
        kfac_factors(model, loss, x, torch.tensor([0, 1]))


def test_ignore_index_positions_are_no_data_points():
    """CE's ignored positions add no column and are not counted by the mean: the factors
    equal those of the batch without them."""
    model = _deep_linear(2)
    x, y = torch.randn(5, 3, dtype=f64), torch.tensor([0, 4, 1, 2, 3])
    lf = nn.CrossEntropyLoss()
    ignored = kfac_factors(model, lf, x, y.masked_fill(torch.tensor([0, 1, 0, 1, 0]).bool(),
                                                       -100))
    kept = kfac_factors(model, lf, x[[0, 2, 4]], y[[0, 2, 4]])
    for name, (A, G) in kept.items():
        assert _rel(ignored[name][1], G) < TOL  # A keeps every row: the forward saw them


def test_type2_columns_are_a_square_root_of_the_loss_hessian():
    """KC2 at the level of the columns: sum_c s_c s_c^T = H_n for CE (diag p - p p^T) and
    MSE (2 I), per data point, with the class axis of a (N, C, d) output."""
    out = torch.randn(2, 4, 3, dtype=f64)
    y = torch.randint(0, 4, (2, 3))
    cols = kf.kfac_columns(nn.CrossEntropyLoss(), out, y, "type-2")
    S = torch.stack(cols, dim=-1)  # (N, C, d, C)
    p = out.softmax(1)
    for n in range(2):
        for t in range(3):
            s, q = S[n, :, t, :], p[n, :, t]
            assert torch.allclose(s @ s.T, torch.diag(q) - torch.outer(q, q), atol=1e-15)
    out = torch.randn(3, 4, dtype=f64)
    S = torch.stack(kf.kfac_columns(nn.MSELoss(), out, out, "type-2"), dim=-1)
    assert torch.allclose(S[1] @ S[1].T, 2 * torch.eye(4, dtype=f64), rtol=0, atol=1e-15)


def test_mc_samples_the_models_distribution_not_the_targets():
    """MC columns do not depend on the targets: the same draws for any targets, and their
    mean outer product is the Hessian, not the empirical (p - e_y)(p - e_y)^T."""
    out = torch.randn(1, 3, dtype=f64)
    lf = nn.CrossEntropyLoss()
    a = kf.kfac_columns(lf, out, torch.tensor([0]), "mc", 1500, torch.Generator().manual_seed(1))
    b = kf.kfac_columns(lf, out, torch.tensor([2]), "mc", 1500, torch.Generator().manual_seed(1))
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    C = torch.stack(a)[:, 0]
    p = out.softmax(1)[0]
    H = torch.diag(p) - torch.outer(p, p)
    print("mc columns:", (C.T @ C - H).abs().max().item())
    assert (C.T @ C - H).abs().max() < 0.05
    mse = kf.kfac_columns(nn.MSELoss(), out, out + 10, "mc", 1500,
                          torch.Generator().manual_seed(1))
    M = torch.stack(mse)[:, 0]
    print("mc columns mse:", (M.T @ M - 2 * torch.eye(3, dtype=f64)).abs().max().item())
    assert (M.T @ M - 2 * torch.eye(3, dtype=f64)).abs().max() < 0.25
    assert math.isclose(M.mean().item(), 0.0, abs_tol=0.1)


# -- the port against the numpy oracle -------------------------------------------------------
ORACLE_NETS = {
    "deep linear, per token (MSE)": (lambda: nets.deep_linear("mse", N=3, S=4), "mse"),
    "deep linear, per token (CE)": (lambda: nets.deep_linear("ce", N=3, S=4), "ce"),
    "MLP, N = 3 (CE)": (lambda: nets.mlp("tanh", "ce", N=3), "ce"),
    "shared, mean-reduced": (lambda: nets.shared_reduce("mean"), "mse"),
    "mixed, sum-reduced (CE)": (lambda: nets.mixed("sum", "ce"), "ce"),
    "conv net": (lambda: nets.conv_net(), "mse"),
    "transformer block (CE)": (lambda: nets.transformer_block(), "ce"),
}


def _points(loss_func, column):
    return curvature.output_points(loss_func, column).numpy()


@pytest.mark.parametrize("fisher", ["type-2", "mc", "empirical"])
@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("net_name", sorted(ORACLE_NETS))
def test_the_port_is_the_oracle(net_name, reduction, approx, fisher):
    """Every layer of every test network: the port's (A, G) = the oracle's to 1e-12. MC: the
    oracle's statistics of the port's own draws (the same seed), backpropagated by plain
    autograd (the draws' distribution is tested above and in the oracle's tests)."""
    build, kind = ORACLE_NETS[net_name]
    net = build()
    lf = nets.make_loss(kind, reduction)
    y = nets.make_targets(kind, net.model(net.inputs))
    ours = kfac_factors(net.model, lf, net.inputs, y, fisher_type=fisher, kfac_approx=approx,
                        mc_samples=3 if fisher == "mc" else 1,
                        generator=torch.Generator().manual_seed(7) if fisher == "mc" else None)
    names = {m: n for n, m in net.model.named_modules()}
    for layer in net.layers:
        if fisher == "mc":
            cap = capture(net.model, lf, net.inputs, y, layer)
            cols = kf.kfac_columns(lf, cap.output, y, "mc", 3, torch.Generator().manual_seed(7))
            a, g = cap.rows(cap.backprop(np.stack([_points(lf, c) for c in cols])))
            factors = oracle.expand_factors if approx == "expand" else oracle.reduce_factors
            A, G = factors(a, g, cap.R, layer.bias is not None)
        else:
            A, G = oracle_factors(net.model, lf, net.inputs, y, layer, fisher, approx)
        oA, oG = ours[names[layer]]
        err = max(_rel(oA, torch.from_numpy(A)), _rel(oG, torch.from_numpy(G)))
        assert err < TOL, (names[layer], err)


def test_the_port_columns_are_the_oracles():
    """type-2 and empirical columns of CE (classes at dim 1, per token) and MSE, as (P, C)
    data points: the oracle's kfac_columns to 1e-15."""
    out = torch.randn(2, 4, 3, dtype=f64)
    y = torch.randint(0, 4, (2, 3))
    lf = nn.CrossEntropyLoss()
    for fisher in ("type-2", "empirical"):
        ours = np.stack([_points(lf, c) for c in kf.kfac_columns(lf, out, y, fisher)])
        theirs = oracle.kfac_columns("ce", fisher, _points(lf, out),
                                     curvature.target_points(lf, y, out).numpy())
        assert np.abs(ours - theirs).max() < 1e-15
    lf, out = nn.MSELoss(), torch.randn(5, 3, dtype=f64)
    y = torch.randn(5, 3, dtype=f64)
    for fisher in ("type-2", "empirical"):
        ours = np.stack([c.numpy() for c in kf.kfac_columns(lf, out, y, fisher)])
        assert np.abs(ours - oracle.kfac_columns("mse", fisher, out.numpy(),
                                                  y.numpy())).max() < 1e-15
