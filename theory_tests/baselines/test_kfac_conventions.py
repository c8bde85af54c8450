"""kfac-pytorch's hyperparameters through :func:`from_kfac_pytorch` give the same training.

kfac-pytorch (gpauloski/kfac-pytorch, 0.4.1) is not on PyPI (``pip download kfac-pytorch``:
no distribution, checked 2026-12-01), so it cannot be a test dependency. The reference
here, :class:`KaisaConvention`, is an independent hand-written transcription of its
convention, written from its sources (``layers/modules.py``, ``layers/utils.py::get_cov``,
``layers/base.py::update_a_factor``, ``layers/eigen.py``, ``layers/inverse.py``,
``base_preconditioner.py::_compute_grad_scale``): module hooks on every nn.Linear /
nn.Conv2d; A = mean of [a | 1][a | 1]^T over rows (conv: patches / L), G = mean of
g g^T over rows (conv: g / L); F <- beta F + (1 - beta) F_new from F = I; eigen
V = Q_G[(Q_G^T Ghat Q_A) / (lam_G lam_A^T + delta)]Q_A^T with eigenvalues clamped at 0,
or (G + delta I)^{-1} Ghat (A + delta I)^{-1}; nu = min(1, sqrt(kappa / |sum lr^2 <V, Ghat>|)).
Unlike kfac-pytorch (float32 ``eigh``/``inv`` whatever its dtypes), it decomposes in float64,
so the comparison is exact up to float64 rounding: what is tested is the convention.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as Fn

from torch_impl.baselines import KFAC, from_kfac_pytorch, kfac_pytorch_scales

f64 = torch.float64


class KaisaConvention:
    """kfac-pytorch's KFACPreconditioner.step(), float64, one process (module docstring)."""

    def __init__(self, model, *, damping, factor_decay, kl_clip, lr, method="eigen",
                 inv_update_steps=1, factor_update_steps=1):
        self.damping, self.decay, self.kl_clip, self.lr = damping, factor_decay, kl_clip, lr
        self.method, self.inv_steps = method, inv_update_steps
        self.factor_steps = factor_update_steps
        self.steps, self.nus = 0, []
        self.modules = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
        self.state = {m: {} for m in self.modules}
        for m in self.modules:
            m.register_forward_pre_hook(self._save_input)
            m.register_full_backward_hook(self._save_grad_output)

    def _due(self):
        return self.steps % self.factor_steps == 0

    def _ema(self, st, key, new):
        old = st.get(key, torch.eye(new.shape[0], dtype=new.dtype))
        st[key] = self.decay * old + (1 - self.decay) * new

    def _save_input(self, m, inputs):
        if not (m.training and self._due()):
            return
        x = inputs[0].detach()
        if isinstance(m, nn.Conv2d):
            cols = Fn.unfold(x, m.kernel_size, padding=m.padding, stride=m.stride)
            L = cols.shape[-1]
            rows = cols.transpose(1, 2).reshape(-1, cols.shape[1])
        else:
            L, rows = 1, x.reshape(-1, x.shape[-1])
        if m.bias is not None:
            rows = torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype)], 1)
        rows = rows / L
        self._ema(self.state[m], "A", rows.T @ rows / rows.shape[0])

    def _save_grad_output(self, m, grad_input, grad_output):
        if not (m.training and self._due()):
            return
        g = grad_output[0].detach()
        if isinstance(m, nn.Conv2d):
            L = g.shape[2] * g.shape[3]
            g = g.permute(0, 2, 3, 1).reshape(-1, g.shape[1]) / L
        else:
            g = g.reshape(-1, g.shape[-1])
        self._ema(self.state[m], "G", g.T @ g / g.shape[0])

    @staticmethod
    def grad_matrix(m):
        G = m.weight.grad.reshape(m.weight.shape[0], -1)
        return G if m.bias is None else torch.cat([G, m.bias.grad[:, None]], 1)

    @torch.no_grad()
    def step(self):
        """Replace every registered layer's .grad by nu V; returns {module: V before nu}."""
        if self.steps % self.inv_steps == 0:
            for st in self.state.values():
                if self.method == "eigen":
                    st["eig"] = [(lam.clamp(min=0), Q) for lam, Q in
                                 (torch.linalg.eigh(st["A"]), torch.linalg.eigh(st["G"]))]
                else:
                    st["inv"] = [torch.linalg.inv(st[k] + self.damping * torch.eye(
                        st[k].shape[0], dtype=f64)) for k in ("A", "G")]
        out, vg = {}, 0.0
        for m in self.modules:
            st, Ghat = self.state[m], self.grad_matrix(m)
            if self.method == "eigen":
                (lam_A, QA), (lam_G, QG) = st["eig"]
                V = QG @ ((QG.T @ Ghat @ QA) / (torch.outer(lam_G, lam_A) + self.damping)) @ QA.T
            else:
                V = st["inv"][1] @ Ghat @ st["inv"][0]
            out[m] = V
            vg += (V * Ghat).sum().item() * self.lr ** 2
        nu = 1.0 if vg == 0 else min(1.0, (self.kl_clip / abs(vg)) ** 0.5)
        self.nus.append(nu)
        for m, V in out.items():
            V = nu * V
            w = V[:, :-1] if m.bias is not None else V
            m.weight.grad.copy_(w.reshape(m.weight.shape))
            if m.bias is not None:
                m.bias.grad.copy_(V[:, -1])
        self.steps += 1
        return out


class MLP(nn.Module):
    """Two Linear layers on (B, T, d) inputs (R = B T rows) and a LayerNorm that neither
    preconditions (its own param group)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(5, 6), nn.LayerNorm(6), nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(self.norm(torch.tanh(self.fc1(x))))


class ConvNet(nn.Module):
    """Two stride-1 'same' convolutions: both see B samples x L = 16 positions."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 3, 3, padding=1, bias=False)

    def forward(self, x):
        return self.c2(torch.tanh(self.c1(x))).mean(dim=(2, 3))


def _batch(model_cls, t, batch, tokens=2):
    g = torch.Generator().manual_seed(100 + t)
    if model_cls is MLP:
        x = torch.randn(batch, tokens, 5, generator=g, dtype=f64)
        y = torch.randn(batch, tokens, 3, generator=g, dtype=f64)
    else:
        x = 3.0 * torch.randn(batch, 2, 4, 4, generator=g, dtype=f64)
        y = torch.randn(batch, 3, generator=g, dtype=f64)
    return x, 3.0 * y


def _groups(model, make):
    """Preconditioned layers in group 0, the rest (LayerNorm) in group 1."""
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    mine = [p for m in layers for p in m.parameters()]
    rest = [p for p in model.parameters() if all(p is not q for q in mine)]
    return make([{"params": mine}] + ([{"params": rest}] if rest else []))


def _twins(model_cls, make_opt, *, batch, tokens=2, steps=4, method="eigen", loss_scale=1.0,
           **kp):
    """Train a model with the kfac-pytorch convention and its copy with our KFAC built by
    from_kfac_pytorch; yield per step (ours, theirs, conversion, kfac, reference)."""
    torch.manual_seed(0)
    theirs = model_cls().double()
    ours = copy.deepcopy(theirs)
    opt_kp, opt = _groups(theirs, make_opt), _groups(ours, make_opt)
    ref = KaisaConvention(theirs, method=method, lr=opt_kp.param_groups[0]["lr"], **kp)
    conv = from_kfac_pytorch(ours, opt, _batch(model_cls, 0, batch, tokens)[0],
                             compute_method=method,
                             **{k: kp[k] for k in ("damping", "factor_decay", "kl_clip")},
                             inv_update_steps=kp.get("inv_update_steps", 1))
    conv.apply(opt)
    kfac = KFAC(ours, opt, **conv.kfac_kwargs)
    for t in range(steps):
        x, y = _batch(model_cls, t, batch, tokens)
        for model, o in ((theirs, opt_kp), (ours, opt)):
            o.zero_grad()
            (loss_scale * Fn.mse_loss(model(x), y)).backward()
        ref.step()
        kfac.precondition()
        yield ours, theirs, conv, kfac, ref
        opt_kp.step()
        opt.step()


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _check_trajectory(model_cls, make_opt, *, batch, grad_ratio, tokens=2, steps=4, tol=1e-10,
                      **kp):
    """Preconditioned gradients (weights and biases) ours = grad_ratio(conv) x theirs,
    factors ours = c_F x theirs, and the parameters equal after every backbone step; the
    batch part of every factor F - beta^t I is >= 1% of it at the last step (the factors
    are not just the identity start). Returns the KL clips nu."""
    worst = 0.0
    for ours, theirs, conv, kfac, ref in _twins(model_cls, make_opt, batch=batch, tokens=tokens,
                                                steps=steps, **kp):
        ratio = grad_ratio(conv)
        for name, (A, G) in kfac.factors().items():
            st = ref.state[theirs.get_submodule(name)]
            worst = max(worst, _rel(A, conv.c_A * st["A"]), _rel(G, conv.c_G * st["G"]))
        for p, q in zip(ours.parameters(), theirs.parameters()):
            worst = max(worst, _rel(p.data, q.data))
        for name, m in theirs.named_modules():
            if m in ref.state:
                for p, q in zip(ours.get_submodule(name).parameters(), m.parameters()):
                    worst = max(worst, _rel(p.grad * ratio, q.grad))
    for p, q in zip(ours.parameters(), theirs.parameters()):
        worst = max(worst, _rel(p.data, q.data))
    assert worst <= tol, worst
    for st in ref.state.values():
        for F in (st["A"], st["G"]):
            start = kp["factor_decay"] ** ref.steps * torch.eye(F.shape[0], dtype=f64)
            assert kp["factor_decay"] == 1 or (F - start).norm() >= 0.01 * F.norm()
    return ref.nus


def _sgd(groups):
    return torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=1e-2)


@pytest.mark.parametrize("factor_decay,kl_clip", [(0.5, 0.12), (1.0, 0.08)])
def test_mlp_sgd_matches_the_kfac_pytorch_convention(factor_decay, kl_clip):
    """Linear layers on (B, T, d) inputs, R = 3 x 2 rows: c_A = 1, c_G = 36. SGD with
    momentum and weight decay, a LayerNorm group left alone; lr x c and weight decay / c
    on the layer group; the KL clip binds on some steps (nu < 1) and not on others;
    decompositions every 2 steps. factor_decay 1 (kfac-pytorch's upper end) keeps the
    factors at I there and at c_F I here. Agreement to 1e-10 relative (float64; measured
    ~1e-14)."""
    nus = _check_trajectory(MLP, _sgd, batch=3, grad_ratio=lambda c: c.lr_factor,
                            damping=0.05, factor_decay=factor_decay, kl_clip=kl_clip,
                            inv_update_steps=2)
    assert min(nus) < 1 and max(nus) == 1, nus


def test_conv_sgd_matches_the_kfac_pytorch_convention():
    """Two 3x3 'same' convolutions, B = 3 samples, L = 16 positions: c_A = L^2 = 256,
    c_G = B^2 L^3 = 36,864, so our damping is c = 9.4e6 times theirs. Inputs x 3 and the
    loss x 100 (a scale both sides see) so that kfac-pytorch's conv factors, L^2 and
    B^2 L^3 smaller than ours, are not all identity start after 4 steps."""
    nus = _check_trajectory(ConvNet, _sgd, batch=3, grad_ratio=lambda c: c.lr_factor,
                            damping=0.01, factor_decay=0.2, kl_clip=1e-2, loss_scale=100.0)
    assert min(nus) < 1, nus


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_adam_backbones_keep_lr_and_divide_eps(cls):
    """A scale-invariant backbone receives V_kp / c: eps / c (and Adam's coupled weight
    decay / c) make its steps the same; AdamW's decoupled decay is left as it is. eps is
    large here so that a wrong eps shows."""
    def make(groups):
        return cls(groups, lr=0.01, eps=1e-2, weight_decay=0.05)

    nus = _check_trajectory(MLP, make, batch=4, grad_ratio=lambda c: c.c,
                            damping=0.05, factor_decay=0.5, kl_clip=1e-5)
    assert min(nus) < 1, nus


def test_inverse_form_maps_when_c_A_equals_c_G():
    """The inverse form damps each factor: only c_A = c_G maps (one row: R = 1, c = 1)."""
    _check_trajectory(MLP, _sgd, batch=1, tokens=1, method="inverse", grad_ratio=lambda c: 1.0,
                      damping=0.05, factor_decay=0.5, kl_clip=1e-3)
    model = MLP().double()
    opt = _groups(model, _sgd)
    with pytest.raises(ValueError, match="c_A = c_G"):
        from_kfac_pytorch(model, opt, _batch(MLP, 0, 4)[0], compute_method="inverse")


def test_the_constants():
    """c_A, c_G per layer kind, and the returned hyperparameters (spec section 2.8:
    delta_kp = delta / c, lr_kp = lr / c, kappa_kp = kappa / c for SGD)."""
    model = ConvNet().double()
    x = torch.zeros(3, 2, 4, 4, dtype=f64)
    assert kfac_pytorch_scales(model, x) == {"c1": (256, 36864), "c2": (256, 36864)}
    mlp = MLP().double()
    assert kfac_pytorch_scales(mlp, torch.zeros(4, 2, 5, dtype=f64)) == {
        "fc1": (1, 64), "fc2": (1, 64)}
    opt = _groups(mlp, _sgd)
    conv = from_kfac_pytorch(mlp, opt, torch.zeros(4, 2, 5, dtype=f64), damping=1e-3,
                             kl_clip=1e-3, factor_decay=0.95)
    kw = conv.kfac_kwargs
    assert conv.c == 64 and conv.lr_factor == 64
    assert kw["damping"] == pytest.approx(64e-3, rel=1e-15)
    assert kw["kl_clip"] == pytest.approx(64e-3, rel=1e-15)
    assert kw["factor_init"] == "identity" and kw["factor_init_scale"] == (1.0, 64.0)
    assert conv.group_settings[0] == {"lr": 0.05 * 64, "weight_decay": 1e-2 / 64}
    assert conv.group_settings[1] == {}


def test_what_cannot_be_converted_is_refused():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.fc = nn.Conv2d(2, 3, 3, padding=1), nn.Linear(48, 2)

        def forward(self, x):
            return self.fc(self.conv(x).flatten(1))

    model = Mixed()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"do not share one \(c_A, c_G\).*conv: c_A=256"):
        from_kfac_pytorch(model, opt, torch.zeros(2, 2, 4, 4))
    opt = torch.optim.SGD([{"params": model.conv.parameters()},
                           {"params": model.fc.parameters()}], lr=0.1)
    conv = from_kfac_pytorch(model, opt, torch.zeros(2, 2, 4, 4), skip_modules=("fc",))
    assert conv.c == 256 * 4 * 4096  # the Linear left out: the conv alone maps
    mlp = MLP()
    with pytest.raises(ValueError, match="mixes preconditioned and other"):
        from_kfac_pytorch(mlp, torch.optim.SGD(mlp.parameters(), lr=0.1), torch.zeros(4, 5))
    with pytest.raises(ValueError, match="unknown backbone RMSprop"):
        from_kfac_pytorch(mlp, torch.optim.RMSprop(mlp.parameters()), torch.zeros(4, 5))
    with pytest.raises(ValueError, match=r"factor_decay: expected a value in \[0.0, 1.0\]"):
        from_kfac_pytorch(mlp, _groups(mlp, _sgd), torch.zeros(4, 5), factor_decay=1.5)


def test_factor_init_option():
    """KFAC(factor_init=...): validated by name; "identity" blends from s I at the first
    update; the default "batch" takes the batch factor as is."""
    model = MLP().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="factor_init: expected one of \\('batch', 'identity'\\)"):
        KFAC(model, opt, factor_init="eye")
    with pytest.raises(ValueError, match="factor_init_scale: only applies"):
        KFAC(model, opt, factor_init_scale=(2.0, 1.0))
    with pytest.raises(ValueError, match=r"factor_init_scale\[1\]: expected a value > 0.0"):
        KFAC(model, opt, factor_init="identity", factor_init_scale=(2.0, 0.0))
    with pytest.raises(ValueError, match="factor_init_scale: expected a pair"):
        KFAC(model, opt, factor_init="identity", factor_init_scale=(2.0,))
    with pytest.raises(ValueError, match=r"factor_decay: expected a value in \[0.0, 1.0\)"):
        KFAC(model, opt, factor_decay=1.0)
    x = torch.randn(4, 5, dtype=f64)
    factors = {}
    for init, scale in (("batch", (1.0, 1.0)), ("identity", (2.0, 3.0))):
        kfac = KFAC(model, opt, factor_init=init, factor_init_scale=scale, factor_decay=0.75,
                    kl_clip=None)
        opt.zero_grad()
        model(x).square().mean().backward()
        kfac.precondition()
        factors[init] = kfac.factors()["fc1"]
        kfac.remove()
    (A_b, G_b), (A_i, G_i) = factors["batch"], factors["identity"]
    eye_A, eye_G = torch.eye(A_b.shape[0], dtype=f64), torch.eye(G_b.shape[0], dtype=f64)
    assert torch.allclose(A_i, 0.75 * 2.0 * eye_A + 0.25 * A_b, rtol=0, atol=1e-14)
    assert torch.allclose(G_i, 0.75 * 3.0 * eye_G + 0.25 * G_b, rtol=0, atol=1e-14)
