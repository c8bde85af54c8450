"""LP5 for K-FAC: A and G kept in bf16 (``factor_dtype``), each EMA write rounded to
nearest, the decompositions in float32; against the float64 oracle
(``reference/baselines/kfac.py``) within the bound the rounding predicts, for the factors
entry by entry and for the preconditioned gradient (``torch_impl/baselines/kfac_state.py``)."""
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as Fn

from reference.baselines.kfac import ema, inverse_precondition, eigen_precondition, kfac_factors
from torch_impl.baselines import KFAC

U = 2.0 ** -8          # bf16's unit roundoff: a write to nearest moves an entry by <= U |x|
F32 = 2.0 ** -20       # the float32 statistics and arithmetic, per entry of the largest
BETA, DAMPING, STEPS = 0.9, 1e-2, 6


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4))


def _spectral(M):
    return float(np.linalg.norm(M, 2))


def _lam_min(M):
    return max(float(np.linalg.eigvalsh((M + M.T) / 2).min()), 0.0)


def _run(method, factor_dtype):
    """KFAC (lr 0: the parameters stay, so every step preconditions the same model) beside
    the oracle's float64 EMAs of the same rows; per step and layer: the port's factors and V,
    the oracle's factors and V, the entrywise error bound of each factor."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    kfac = KFAC(model, opt, inv_freq=1, factor_decay=BETA, damping=DAMPING, kl_clip=None,
                method=method, factor_dtype=factor_dtype)
    layers = [model[0], model[2]]
    seen = {}
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, inp, i=i: seen.__setitem__(("a", i), inp[0]))
        layer.register_full_backward_hook(
            lambda m, gi, go, i=i: seen.__setitem__(("g", i), go[0]))
    exact = [[None, None] for _ in layers]
    bounds = [[None, None] for _ in layers]
    out = []
    for t in range(STEPS):
        g = torch.Generator().manual_seed(t)
        x, y = torch.randn(32, 6, generator=g), torch.randn(32, 4, generator=g)
        Fn.mse_loss(model(x), y).backward()
        grads = [torch.cat([l.weight.grad, l.bias.grad[:, None]], 1).double().numpy()
                 for l in layers]
        kfac.step()
        stored = kfac.factors()
        step = []
        for i, layer in enumerate(layers):
            new = kfac_factors(seen["a", i].detach().double().numpy(),
                               seen["g", i].detach().double().numpy(), has_bias=True)
            port = [f.double().numpy() for f in stored[str(2 * i)]]
            for k in range(2):
                exact[i][k] = ema(exact[i][k], new[k], BETA)
                write = U * np.abs(port[k]) + F32 * np.abs(exact[i][k]).max()
                bounds[i][k] = write if bounds[i][k] is None else BETA * bounds[i][k] + write
            V_port = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1)
            precondition = eigen_precondition if method == "eigen" else inverse_precondition
            step.append(dict(port=port, exact=list(exact[i]), bound=list(bounds[i]),
                             V_port=V_port.double().numpy(),
                             V=precondition(exact[i][0], exact[i][1], grads[i], DAMPING)))
        out.append(step)
        kfac.zero_grad()
    return kfac, out


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_bf16_factors_are_the_oracle_within_the_rounding_bound(method):
    """Per entry |A_hat - A| <= E_t, E_t = beta E_{t-1} + u |A_hat_t| (+ float32's share),
    the EMA's own recursion on the write errors; then the preconditioned gradient within the
    first-order perturbation bound of the damped Kronecker inverse:

    * eigen: ||V_hat - V||_F <= (2 ||dG|| ||A|| + 2 ||G_hat|| ||dA||) ||V||_F /
      (lambda_min(G_hat)_+ lambda_min(A_hat)_+ + delta) (the 2s: the eigenvalues clamped at 0);
    * inverse: ||V_hat - V||_F <= (2 ||dG|| / (lambda_min(G_hat)_+ + delta) + 2 ||dA|| /
      (lambda_min(A_hat)_+ + delta)) ||V||_F;

    with ||dF||_2 <= ||E||_F. The bf16 errors are 2^-8-sized: far above float32's."""
    kfac, out = _run(method, torch.bfloat16)
    ratios = []
    for t, step in enumerate(out):
        for i, layer in enumerate(step):
            for k in range(2):
                err = np.abs(layer["port"][k] - layer["exact"][k])
                assert np.all(err <= layer["bound"][k]), (t, i, k)
            dA, dG = (np.linalg.norm(b) for b in layer["bound"])
            A_hat, G_hat = layer["port"]
            if method == "eigen":
                factor = (2 * dG * _spectral(layer["exact"][0]) + 2 * _spectral(G_hat) * dA) / (
                    _lam_min(G_hat) * _lam_min(A_hat) + DAMPING)
            else:
                factor = 2 * dG / (_lam_min(G_hat) + DAMPING) + 2 * dA / (_lam_min(A_hat)
                                                                          + DAMPING)
            V = layer["V"]
            err = np.linalg.norm(layer["V_port"] - V)
            bound = factor * np.linalg.norm(V) + 1e-5 * np.linalg.norm(V)
            assert err <= bound, (t, i, err, bound)
            ratios.append(err / np.linalg.norm(V))
    assert max(ratios) > 1e-4  # bf16-sized: the factors really are rounded
    # the decompositions ran in float32, on the first try
    assert kfac.decomposition_retries == 0
    for s in kfac._state.values():
        assert s["A"].dtype == s["G"].dtype == torch.bfloat16
        kept = s["eig_A"][1] if method == "eigen" else s["inv_A"]
        assert kept.dtype == torch.float32


def test_the_factor_memory_halves_and_the_default_is_unchanged():
    """factor_dtype=bf16 keeps A and G in half float32's bytes ((d_in'^2 + d_out^2) x 2 per
    layer); the default keeps them in the compute dtype, as before."""
    sizes = {}
    for dtype in (None, torch.bfloat16):
        model = _model()
        kfac = KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1), factor_dtype=dtype)
        Fn.mse_loss(model(torch.randn(8, 6)), torch.randn(8, 4)).backward()
        kfac.step()
        sizes[dtype] = sum(f.numel() * f.element_size() for pair in kfac.factors().values()
                           for f in pair)
        assert all(f.dtype == (dtype or torch.float32)
                   for pair in kfac.factors().values() for f in pair)
    assert sizes[None] == 2 * sizes[torch.bfloat16] == 4 * ((7 ** 2 + 10 ** 2) + (11 ** 2 + 4 ** 2))


def test_a_checkpoint_keeps_the_factor_dtype():
    """A bf16 run's state dict loads into a bf16 K-FAC with its factors in bf16 and its
    decompositions in float32, and the resumed step is the uninterrupted one."""
    def steps(kfac, model, ts):
        for t in ts:
            g = torch.Generator().manual_seed(t)
            Fn.mse_loss(model(torch.randn(8, 6, generator=g)),
                        torch.randn(8, 4, generator=g)).backward()
            kfac.step()
            kfac.zero_grad()

    model = _model()
    kfac = KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1), factor_dtype="bfloat16")
    steps(kfac, model, range(4))
    whole = [p.detach().clone() for p in model.parameters()]
    model = _model()
    first = KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1), factor_dtype="bfloat16")
    steps(first, model, range(2))
    saved = first.state_dict()
    model2 = _model()
    with torch.no_grad():
        for p, q in zip(model2.parameters(), model.parameters()):
            p.copy_(q)
    resumed = KFAC(model2, torch.optim.SGD(model2.parameters(), lr=0.1), factor_dtype="bfloat16")
    resumed.load_state_dict(saved)
    s = next(iter(resumed._state.values()))
    assert s["A"].dtype == torch.bfloat16 and s["eig_A"][1].dtype == torch.float32
    steps(resumed, model2, range(2, 4))
    assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), whole))


@pytest.mark.parametrize("value", ["int8", torch.float64, 3])
def test_a_bad_factor_dtype_is_refused_by_name(value):
    """Not a float dtype, or wider than the compute dtype (float32 weights: float64 would
    store digits the computation never had)."""
    model = _model()
    with pytest.raises(ValueError, match="^factor_dtype: expected"):
        KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1), factor_dtype=value)


def test_each_ema_write_is_the_float32_blend_rounded_once():
    """The kept bf16 factor is, bit for bit, RN(beta F_hat_{t-1} + (1 - beta) F_new) with the
    blend computed in float32 from the upcast stored factor (one rounding per write, the
    premise of the bound above), F_new the batch factor from the captured float32 rows."""
    model = _model()
    kfac = KFAC(model, torch.optim.SGD(model.parameters(), lr=0.0), inv_freq=1,
                factor_decay=BETA, factor_dtype=torch.bfloat16)
    layer = model[0]
    rows = {}
    layer.register_forward_pre_hook(lambda m, inp: rows.__setitem__("a", inp[0].detach()))
    layer.register_full_backward_hook(lambda m, gi, go: rows.__setitem__("g", go[0].detach()))
    previous = None
    for t in range(4):
        g = torch.Generator().manual_seed(t)
        x, y = torch.randn(32, 6, generator=g), torch.randn(32, 4, generator=g)
        Fn.mse_loss(model(x), y).backward()
        kfac.step()
        kfac.zero_grad()
        a = torch.cat([rows["a"], torch.ones(32, 1)], dim=1)
        new = {"A": a.T @ a / 32, "G": rows["g"].T @ rows["g"] * (32 / 1)}
        state = kfac._state["0"]
        for key in ("A", "G"):
            want = new[key] if previous is None else (
                BETA * previous[key].float() + (1 - BETA) * new[key])
            assert torch.equal(state[key], want.to(torch.bfloat16)), (t, key)
        previous = {key: state[key].clone() for key in ("A", "G")}
