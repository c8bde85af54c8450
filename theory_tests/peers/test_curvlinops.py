"""Peer oracle for the K-FAC flavours (issue 46, item 4; claims row KFAC-CURVLINOPS): the port's
``torch_impl.kfac_factors`` equals curvlinops-for-pytorch 3.0.1's ``KFACLinearOperator``
factors, A and G each, to 1e-12 of the largest entry (float64), for every flavour both offer
(fisher_type "type-2", "mc", "empirical" x kfac_approx "expand", "reduce"), on curvlinops' own
kinds of test models: deep linear nets with MSE mean and sum at two batch sizes, one-datum
cross-entropy, bias joint and separate, weight sharing over tokens, a shallow CNN. The
conventions that differ are mapped in ``theory_tests/support/curvlinops_conventions.py``
(named there, each). And the factors' product is the operator's own dense matrix on a tiny
model.
"""
import pytest
import torch
import torch.nn as nn

from theory_tests.support.curvlinops_conventions import (curvlinops_factors, ours_as_curvlinops,
                                                         same_draws)
from torch_impl import kfac_factors

pytest.importorskip("curvlinops")  # the peers extra (README: installed with --no-deps)

f64 = torch.float64
TOL = 1e-12
FISHERS = ["type-2", "mc", "empirical"]
APPROXES = ["expand", "reduce"]


def _rel(ours, theirs):
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def _compare(model, lf, x, y, fisher, approx, joint, mc_samples=1):
    ours = kfac_factors(model, lf, x, y, fisher_type=fisher, kfac_approx=approx,
                        mc_samples=mc_samples,
                        generator=same_draws() if fisher == "mc" else None)
    theirs = curvlinops_factors(model, lf, x, y, fisher_type=fisher, kfac_approx=approx,
                                joint_bias=joint, mc_samples=mc_samples)
    assert set(ours) == set(theirs)
    mods = dict(model.named_modules())
    worst = 0.0
    for name, (A, G) in ours.items():
        A, G = ours_as_curvlinops(A, G, mods[name].bias is not None, joint)
        tA, tG = theirs[name]
        errs = (_rel(A, tA), _rel(G, tG))
        worst = max(worst, *errs)
        assert max(errs) < TOL, (name, errs)
    return worst


def _deep_linear(bias):
    return nn.Sequential(nn.Linear(3, 4, bias=bias), nn.Linear(4, 5, bias=bias),
                         nn.Linear(5, 2, bias=bias)).double()


@pytest.mark.parametrize("fisher", FISHERS)
@pytest.mark.parametrize("approx", APPROXES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("N", [1, 6])
@pytest.mark.parametrize("joint", [True, False], ids=["joint", "separate"])
def test_deep_linear_mse(fisher, approx, reduction, N, joint):
    torch.manual_seed(N)
    model = _deep_linear(bias=True)
    x, y = torch.randn(N, 3, dtype=f64), torch.randn(N, 2, dtype=f64)
    err = _compare(model, nn.MSELoss(reduction=reduction), x, y, fisher, approx, joint,
                   mc_samples=3 if fisher == "mc" else 1)
    print(f"curvlinops deep linear {fisher} {approx} {reduction} N={N} joint={joint}: {err:.1e}")


@pytest.mark.parametrize("fisher", FISHERS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_one_datum(fisher, reduction):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 5)).double()
    x, y = torch.randn(1, 3, dtype=f64), torch.tensor([2])
    _compare(model, nn.CrossEntropyLoss(reduction=reduction), x, y, fisher, "expand", True,
             mc_samples=4 if fisher == "mc" else 1)


class _Tokens(nn.Module):
    """Linear layers on (N, S, d) tokens with per-token CE outputs (N, C, S)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, 4), nn.Linear(4, 5)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))).transpose(1, 2)


@pytest.mark.parametrize("fisher", FISHERS)
@pytest.mark.parametrize("approx", APPROXES)
@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_weight_sharing_over_tokens(fisher, approx, loss):
    torch.manual_seed(0)
    model = _Tokens().double()
    x = torch.randn(4, 6, 3, dtype=f64)
    if loss == "ce":
        lf, y = nn.CrossEntropyLoss(), torch.randint(0, 5, (4, 6))
    else:  # per-token regression: outputs (N, S, C)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 5)).double()
        lf, y = nn.MSELoss(), torch.randn(4, 6, 5, dtype=f64)
    _compare(model, lf, x, y, fisher, approx, joint=True,
             mc_samples=2 if fisher == "mc" else 1)


@pytest.mark.parametrize("fisher", FISHERS)
@pytest.mark.parametrize("approx", APPROXES)
def test_shallow_cnn(fisher, approx):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(3 * 5 * 5, 4)).double()
    x, y = torch.randn(3, 2, 5, 5, dtype=f64), torch.tensor([0, 3, 1])
    _compare(model, nn.CrossEntropyLoss(), x, y, fisher, approx, joint=False)


def test_the_kronecker_product_is_the_operators_dense_matrix():
    """On a 2-layer net (separate bias): curvlinops' operator applied to the identity equals
    our factors' blocks placed in its parameter order (weight: kron(G, A without the bias
    column), bias: G), and zero off the layers' blocks."""
    from curvlinops import KFACLinearOperator
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(5, 3, dtype=f64), torch.randn(5, 2, dtype=f64)
    lf = nn.MSELoss()
    params = list(model.parameters())
    op = KFACLinearOperator(model, lf, params, [(x, y)], fisher_type="type-2",
                            check_deterministic=False)
    n = sum(p.numel() for p in params)
    dense = op @ torch.eye(n, dtype=f64)
    ours = torch.zeros(n, n, dtype=f64)
    at = 0
    for name, (A, G) in kfac_factors(model, lf, x, y).items():
        w = G.shape[0] * (A.shape[0] - 1)
        ours[at:at + w, at:at + w] = torch.kron(G, A[:-1, :-1])
        ours[at + w:at + w + G.shape[0], at + w:at + w + G.shape[0]] = G
        at += w + G.shape[0]
    assert _rel(ours, dense) < TOL
