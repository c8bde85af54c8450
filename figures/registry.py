"""The optimizer registry of the figures: every curve is a :class:`Spec` (label, registry
entry, keyword overrides) built by :func:`build` from ``torch_impl`` (public API) and
``torch.optim``, with the spec's defaults (MARS.md section 3 and 6, MKOR.md section 3)."""
import contextlib
import dataclasses

import torch

from torch_impl import KFAC, LAMB, MARS, MARSM, MKOR
from torch_impl.common.matrix_functions import newton_schulz


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): u = sign(b1 m + (1-b1) g), m <- b2 m + (1-b2) g; decoupled wd.
    torch.optim has no Lion; this is the plain rule, the gamma = 0 baseline of MARS-Lion."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


@contextlib.contextmanager
def _float32_newton_schulz():
    """torch.optim.Muon's step with its Newton-Schulz in float32: torch casts to bf16 inside
    the private ``torch.optim._muon._zeropower_via_newtonschulz``; this swaps that function
    for ``torch_impl``'s (the same quintic, coefficients and steps) for the step's duration."""
    import torch.optim._muon as muon_module

    original = muon_module._zeropower_via_newtonschulz

    def float32_ns(grad, ns_coefficients, ns_steps, eps):
        return newton_schulz(grad, steps=ns_steps, eps=eps, dtype=torch.float32,
                             coefficients=ns_coefficients)

    muon_module._zeropower_via_newtonschulz = float32_ns
    try:
        yield
    finally:
        muon_module._zeropower_via_newtonschulz = original


class Float32Muon(torch.optim.Muon):
    """``torch.optim.Muon`` (its momentum, lr adjustment and weight decay) with the
    Newton-Schulz iteration in float32 instead of bf16 (see ``DEFAULTS``)."""

    @torch.no_grad()
    def step(self, closure=None):
        with _float32_newton_schulz():
            return super().step(closure)


# Every Newton-Schulz of the figures (MARS-Shampoo, MARS-M, Muon) runs in float32, not the
# bf16 of the authors and of torch.optim.Muon: a CPU without bf16 matrix units emulates a
# bf16 matmul, many times slower than float32 (measured: figures/README.md); the figures are
# about convergence, which a float32 iteration of the same quintic does not disadvantage.
# The names are recorded in the figure JSON.
#
# Keyword defaults per optimizer: MARS from the official constructor with the GPT-2 runs'
# weight decay (spec MARS.md sections 3 and 6), AdamW from the GPT-2 AdamW runs, Muon wd 0,
# MKOR and K-FAC with the released defaults (inv_freq 10, damping 1e-3) on an SGD backbone.
_MARS = dict(betas=(0.95, 0.99), gamma=0.025, weight_decay=1e-2, lr_1d=3e-3)
DEFAULTS = {
    "SGD": dict(momentum=0.9),
    "AdamW": dict(betas=(0.9, 0.95), weight_decay=0.1),
    "Lion": dict(betas=(0.9, 0.99), weight_decay=0.0),
    "MARS-AdamW": dict(_MARS, mars_type="mars-adamw"),
    "MARS-Lion": dict(_MARS, mars_type="mars-lion"),
    "MARS-Shampoo": dict(_MARS, mars_type="mars-shampoo", ns_dtype="float32"),
    "Muon": dict(momentum=0.95, weight_decay=0.0, adamw_lr=3e-3, exclude=("head",),
                 ns_dtype="float32"),
    # MARS-M: the authors' GPT-2 small config (wd 1e-2, momentum 0.95, gamma 0.025); the same
    # matrices as Muon take the MARS-M rule, everything else its AdamW backup at the same lr.
    "MARS-M": dict(momentum=0.95, weight_decay=1e-2, gamma=0.025, exclude=("head",),
                   ns_dtype="float32"),  # a name: the figure JSON records these keywords
    "MKOR": dict(variant="paper", inv_freq=10, backbone="sgd"),
    "MKOR-released": dict(variant="released", inv_freq=10, backbone="sgd"),
    "MKOR-H": dict(variant="paper", inv_freq=10, hybrid_switch="loss_rate", backbone="sgd"),
    # damping 0.1, not K-FAC's 1e-3: on these small-batch tasks 1e-3 diverges at every lr
    # (mnist1d probe over damping {1e-3, 1e-2, 1e-1} x lr {0.03, 0.1}, README "Figures").
    "K-FAC": dict(inv_freq=10, damping=0.1, backbone="sgd"),
    # LAMB, MKOR's BERT backbone (torch_impl.baselines.LAMB), with BERT's weight decay 0.01; MKOR,
    # MKOR-H and K-FAC run on it with the spec override ("backbone", "lamb").
    "LAMB": dict(betas=(0.9, 0.999), weight_decay=0.01),
}
# Centre of each lr grid (the grid is centre * 10^(k/2), k = -2..2, extended at an edge).
CENTER = {"SGD": 0.1, "AdamW": 1e-3, "Lion": 1e-4, "MARS-AdamW": 3e-3, "MARS-Lion": 3e-4,
          "MARS-Shampoo": 1e-2, "Muon": 2e-2, "MARS-M": 3e-3, "MKOR": 0.1, "MKOR-released": 0.1,
          "MKOR-H": 0.1, "K-FAC": 0.1, "LAMB": 1e-2}


@dataclasses.dataclass(frozen=True)
class Spec:
    """A curve: a label, the registry entry it builds and keyword overrides."""
    label: str
    base: str
    overrides: tuple = ()
    center: float = None
    lr_from: str = None  # reuse the (tuned) lr of this other curve instead of tuning

    def kwargs(self):
        return {**DEFAULTS[self.base], **dict(self.overrides)}

    def grid_center(self):
        if self.center is not None:
            return self.center
        return 1e-3 if self.kwargs().get("backbone") == "adamw" else CENTER[self.base]


class Stepper:
    """One interface over plain optimizers and MKOR/K-FAC wrappers, with an lr factor."""

    def __init__(self, optimizers, wrapper=None):
        self.optimizers, self.wrapper = optimizers, wrapper
        self.base = [[g["lr"] for g in o.param_groups] for o in optimizers]
        self.switch_step = None

    def set_lr_factor(self, factor):
        for o, lrs in zip(self.optimizers, self.base):
            for g, lr in zip(o.param_groups, lrs):
                g["lr"] = lr * factor

    def step(self, loss):
        if self.wrapper is None:
            for o in self.optimizers:
                o.step()
            return
        w = self.wrapper
        if isinstance(w, MKOR):
            w.observe_loss(loss)  # MKOR-H reads it (batched: one read per switch check)
        w.step()
        if isinstance(w, MKOR) and w.switched and self.switch_step is None:
            self.switch_step = w.steps

    def zero_grad(self):
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)


def _backbone(name, params, lr):
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "lamb":
        return LAMB(params, lr=lr, **DEFAULTS["LAMB"])
    return torch.optim.AdamW(params, lr=lr, **DEFAULTS["AdamW"])


def _quantization_groups(params, kw):
    """``params`` as MARS's groups: one, or with ``state_quantization`` the tensors smaller
    than a block in a second group of float32 state (MARS refuses to quantize them)."""
    if not kw.get("state_quantization"):
        return params
    block = kw.get("block_size", 256)
    big = [p for p in params if p.numel() >= block]
    small = [p for p in params if p.numel() < block]
    return [dict(params=big)] + ([dict(params=small, state_quantization=None, state_dtype=None)]
                                 if small else [])


def build(spec, model, lr):
    """The Stepper of ``spec`` on ``model`` at learning rate ``lr`` (public APIs only)."""
    kw, base, params = spec.kwargs(), spec.base, list(model.parameters())
    if base == "SGD":
        return Stepper([torch.optim.SGD(params, lr=lr, **kw)])
    if base == "AdamW":
        return Stepper([torch.optim.AdamW(params, lr=lr, **kw)])
    if base == "Lion":
        return Stepper([Lion(params, lr=lr, **kw)])
    if base == "LAMB":
        return Stepper([LAMB(params, lr=lr, **kw)])
    if base in ("Muon", "MARS-M"):  # the 2-D Linear weights; AdamW on everything else
        exclude = kw.pop("exclude")
        muon = [m.weight for n, m in model.named_modules()
                if isinstance(m, torch.nn.Linear) and n.split(".")[-1] not in exclude]
        ids = {id(p) for p in muon}
        rest = [p for p in params if id(p) not in ids]
        if base == "MARS-M":
            kw["ns_dtype"] = getattr(torch, kw["ns_dtype"])
            groups = [dict(params=muon, rule="mars_m")] + \
                ([dict(params=rest, rule="adamw")] if rest else [])
            return Stepper([MARSM(groups, lr=lr, **kw)])
        adamw_lr = kw.pop("adamw_lr")
        muon_class = {"float32": Float32Muon, "bfloat16": torch.optim.Muon}[kw.pop("ns_dtype")]
        opts = [muon_class(muon, lr=lr, **kw)]
        if rest:
            opts.append(torch.optim.AdamW(rest, lr=adamw_lr, **DEFAULTS["AdamW"]))
        return Stepper(opts)
    if base.startswith("MARS"):
        for key in ("ns_dtype", "state_dtype"):  # names in the spec (its JSON), dtypes here
            if isinstance(kw.get(key), str):
                kw[key] = getattr(torch, kw[key])
        return Stepper([MARS(_quantization_groups(params, kw), lr=lr, **kw)])
    backbone = _backbone(kw.pop("backbone"), params, lr)
    if base == "K-FAC":
        return Stepper([backbone], KFAC(model, backbone, **kw))
    return Stepper([backbone], MKOR(model, backbone, **kw))
