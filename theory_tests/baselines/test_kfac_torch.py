"""K-FAC baseline (K19): same interface as MKOR, damped-inverse formula, oracle parity."""
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as Fn

from reference.common import first_order
from reference.baselines.kfac import KFACConfig, KFACReference, kfac_factors
from torch_impl.baselines import KFAC


f64 = torch.float64


def _close(ours, expected, rel):
    """|ours - expected| <= rel * max(1, max|expected|) entrywise (relative to the largest
    entry compared, an absolute floor rel below 1; torch.allclose's default atol = 1e-8
    would let an O(1e-8)-sized factor or step through unchecked)."""
    expected = torch.as_tensor(expected)
    return torch.allclose(torch.as_tensor(ours), expected, rtol=0,
                          atol=rel * max(1.0, expected.abs().max().item()))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        self.fc = nn.Linear(12, 5)
        self.out = nn.Linear(5, 2, bias=False)
        self.norm = nn.LayerNorm(5)

    def forward(self, x):
        h = torch.relu(self.conv(x)).flatten(1)
        return self.out(self.norm(torch.tanh(self.fc(h))))


def _batch(t, dtype=f64):
    g = torch.Generator().manual_seed(t)
    return (torch.randn(6, 2, 4, 4, generator=g, dtype=dtype),
            torch.randn(6, 2, generator=g, dtype=dtype))


def _make(seed=0, **kwargs):
    torch.manual_seed(seed)
    model = Net().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt, KFAC(model, opt, **kwargs)


def _grad_matrix(layer):
    G = layer.weight.grad.reshape(layer.weight.shape[0], -1)
    if layer.bias is not None:
        G = torch.cat([G, layer.bias.grad[:, None]], 1)
    return G


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_preconditioned_grad_matches_the_damped_inverse_formula(method):
    """eigen: vec_r(V) = (G (x) A + delta I)^{-1} vec_r(G_hat) (row-major vec);
    inverse: V = (G + delta I)^{-1} G_hat (A + delta I)^{-1}. Dense float64 solves;
    tolerance 1e-9 relative (cond(G (x) A + delta I) <= ~1e6 here)."""
    model, opt, kfac = _make(method=method, kl_clip=None, damping=0.05, inv_freq=2)
    for t in range(3):
        x, y = _batch(t)
        Fn.mse_loss(model(x), y).backward()
        raw = {n: _grad_matrix(getattr(model, n)).clone() for n in kfac.preconditioned_modules}
        kfac.precondition()
        if t == 1:  # off-schedule: factors moved but the decomposition is from t = 0
            opt.zero_grad()
            continue
        for name, (A, G) in kfac.factors().items():
            V = _grad_matrix(getattr(model, name))
            d = 0.05
            if method == "eigen":
                M = torch.kron(G, A) + d * torch.eye(G.shape[0] * A.shape[0], dtype=f64)
                expected = torch.linalg.solve(M, raw[name].flatten()).reshape(V.shape)
            else:
                expected = (torch.linalg.inv(G + d * torch.eye(G.shape[0], dtype=f64))
                            @ raw[name] @ torch.linalg.inv(A + d * torch.eye(A.shape[0], dtype=f64)))
            assert torch.allclose(V, expected, rtol=1e-9, atol=1e-12 * expected.abs().max())
        opt.step()
        opt.zero_grad()


def test_linear_factors_are_the_batch_second_moments():
    """K19: A = (1/N) sum [a|1][a|1]^T, G = (1/N) sum (N g)(N g)^T on the first update."""
    torch.manual_seed(1)
    lin = nn.Linear(3, 2).double()
    kfac = KFAC(lin, torch.optim.SGD(lin.parameters(), lr=0.1))
    x = torch.randn(4, 5, 3, dtype=f64)
    out = lin(x)
    out.retain_grad()
    out.pow(2).mean().backward()
    kfac.precondition()
    A, G = kfac.factors()[""]
    rows = torch.cat([x.reshape(-1, 3), torch.ones(20, 1, dtype=f64)], 1)
    g = 20 * out.grad.reshape(-1, 2)
    assert _close(A, rows.T @ rows / 20, 1e-13)
    assert _close(G, g.T @ g / 20, 1e-13)


def test_kl_clip_scales_by_nu():
    """nu = min(1, sqrt(kappa / |lr^2 sum <V, G_hat>|)) multiplies every layer."""
    updates = []
    for clip in (None, 1e-6):
        model, opt, kfac = _make(kl_clip=clip)
        x, y = _batch(0)
        Fn.mse_loss(model(x), y).backward()
        raw = {n: _grad_matrix(getattr(model, n)).clone() for n in kfac.preconditioned_modules}
        kfac.precondition()
        updates.append({n: _grad_matrix(getattr(model, n)).clone() for n in raw})
    vg = sum((updates[0][n] * raw[n]).sum() for n in raw) * 0.05 ** 2
    nu = min(1.0, (1e-6 / abs(vg)).sqrt().item())
    assert nu < 1
    for n in raw:
        assert _close(updates[1][n], nu * updates[0][n], 1e-12)


def test_interface_and_state_dict_round_trip():
    """Same interface as MKOR: names, step(closure), a bit-identical checkpoint."""
    model, opt, kfac = _make(inv_freq=3)
    assert kfac.preconditioned_modules == ["conv", "fc", "out"]
    assert kfac.skipped_modules == ["norm"]
    for t in range(5):
        def closure():
            opt.zero_grad()
            x, y = _batch(t)
            loss = Fn.mse_loss(model(x), y)
            loss.backward()
            return loss
        kfac.step(closure)
    opt.zero_grad()  # the closure zeroes at its start; leave no stale grads behind
    buffer = io.BytesIO()
    torch.save({"m": model.state_dict(), "k": kfac.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    model2, opt2, kfac2 = _make(seed=9, inv_freq=3)
    model2.load_state_dict(saved["m"])
    kfac2.load_state_dict(saved["k"])
    for t in range(5, 12):
        for m, o, k in ((model, opt, kfac), (model2, opt2, kfac2)):
            x, y = _batch(t)
            Fn.mse_loss(m(x), y).backward()
            k.step()
            o.zero_grad()
        for p, q in zip(model.parameters(), model2.parameters()):
            assert torch.equal(p, q)


def test_matches_the_numpy_oracle_on_an_mlp():
    """Differential vs reference.baselines.kfac.KFACReference (float64, eigen, KL-clip on, SGD
    momentum), 8 steps with factor_freq 1 and inv_freq 2: parameters agree to 1e-10 times
    their largest entry (eigenbases are unique only up to sign/rotation within repeated
    eigenvalues, but the preconditioned step is basis-independent)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    kfac = KFAC(model, opt, inv_freq=2, damping=1e-2, kl_clip=1e-2)
    ref = KFACReference(KFACConfig(factor_freq=1, inv_freq=2, damping=1e-2, kl_clip=1e-2,
                                   lr=0.05))
    params = [p.detach().numpy().copy() for p in model.parameters()]
    states = [{} for _ in params]
    layers = [model[0], model[2]]
    seen = {}
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, inp, i=i: seen.__setitem__(("a", i), inp[0]))
        layer.register_full_backward_hook(lambda m, gi, go, i=i: seen.__setitem__(("g", i), go[0]))
    for t in range(8):
        g = torch.Generator().manual_seed(t)
        x, y = torch.randn(10, 4, generator=g, dtype=f64), torch.randn(10, 2, generator=g, dtype=f64)
        Fn.mse_loss(model(x), y).backward()
        ref_layers = []
        for i, layer in enumerate(layers):
            A_new, G_new = kfac_factors(seen["a", i].detach().numpy(),
                                        seen["g", i].detach().numpy(), has_bias=True)
            ref_layers.append({"A_new": A_new, "G_new": G_new,
                               "grad_W": layer.weight.grad.numpy().copy(),
                               "grad_b": layer.bias.grad.numpy().copy()})
        deltas = ref.step(ref_layers)
        flat = [d for pair in deltas for d in pair]
        params = [first_order.sgd(p, d, s, lr=0.05, momentum=0.9)
                  for p, d, s in zip(params, flat, states)]
        kfac.step()
        opt.zero_grad()
        for p, q in zip(model.parameters(), params):
            assert _close(p.detach(), torch.from_numpy(q), 1e-10), t
