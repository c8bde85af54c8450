"""torch-optimi 0.3.3's ``optimi.AdamW`` as our ``torch_impl.MARS`` with gamma = 0, every convention
written as code (the pattern of ``peer_conventions.py``), and the fixed-gradient trajectories
on which its Kahan summation and ours are compared with the float32 trajectory
(``theory_tests/peers/test_optimi_kahan.py``; ``paper_notes/peers_low_precision.md``).

The differences (``optimi/adam.py`` of 0.3.3, read and run):

* Its moments are stored debiased (m̂ = lerp(m̂, g, 1 - β̂ₜ), β̂ₜ = (βᵗ - β)/(βᵗ - 1),
  computed in float64 on the host), ours raw with the corrections at use: equal in exact
  arithmetic.  Its denominator √v̂ + ε is ours, √v/√(1 - β₂ᵗ) + ε.
* Its state is ``zeros_like(p)``: in the parameter's dtype, every operation rounding to
  nearest (v̂: ``mul_`` then ``addcmul_``, two roundings).  Ours with ``state_dtype=None``
  stores the state in the parameter's dtype too, computed in float32 and written once.
* Weight decay (decoupled): p ← p (1 - η λ) multiplies the 16-bit parameter in place, outside
  the compensation, so a decay smaller than half a spacing of p is lost.  Ours decays the
  compensated value x = p + c in float32 (LP3).  ``decouple_lr=True`` (p (1 - η/η_max λ)) is
  our weight_decay λ/η_max.
* Kahan summation (``kahan_sum``, on for 16-bit parameters when None): it accumulates the
  update into the compensation, c ← c - η m̂/(√v̂ + ε) (rounded), then p' = p + c (rounded)
  and c ← c + (p - p') (rounded): three 16-bit roundings per step.  Ours (LP3) forms
  x = p + c in float32, steps x, writes p' = RN(x) and c' = RN(x - p'): two.  Both keep
  p + c equal to the running float32 sum up to those roundings.  Both store the
  compensation as ``kahan_comp`` (the parameter's dtype and shape).
* It uses the gradient tensor as scratch (the loop path copies the parameter into it, the
  foreach path the denominator): a caller comparing it copies the gradients first.
* Refused: ``gradient_release`` (steps from backward hooks), ``triton=True`` (its GPU kernels).
"""
import torch

from .peer_conventions import OurMARS, _check_unknown, _peer_groups, _refuse

__all__ = ["OPTIMI_VERSION", "OPTIMI_ADAMW_DEFAULTS", "load_optimi", "from_optimi_adamw",
           "start", "gradients", "trajectory", "in_ulps"]

OPTIMI_VERSION = "0.3.3"
OPTIMI_ADAMW_DEFAULTS = dict(betas=(0.9, 0.99), weight_decay=1e-2, eps=1e-6, decouple_lr=False,
                             max_lr=None, kahan_sum=None, foreach=None, triton=None,
                             gradient_release=False)
PEER = "optimi.AdamW"
_SIXTEEN = (torch.bfloat16, torch.float16)


def load_optimi():
    from importlib.metadata import version

    installed = version("torch-optimi")
    if installed != OPTIMI_VERSION:
        raise RuntimeError(f"torch-optimi {installed} is installed; the convention map was "
                           f"written against {OPTIMI_VERSION}")
    import optimi
    return optimi


def from_optimi_adamw(params, lr, **kwargs):
    """``optimi.AdamW(params, lr, **kwargs)`` as our MARS (module docstring)."""
    _check_unknown(kwargs, OPTIMI_ADAMW_DEFAULTS, PEER)
    d = {**OPTIMI_ADAMW_DEFAULTS, **kwargs}
    groups, names = [], {}
    for keys, named in _peer_groups(params):
        h = {**d, "lr": lr, **keys}
        _refuse("gradient_release", h["gradient_release"], False, PEER, "steps in backward hooks")
        if h["triton"]:
            _refuse("triton", h["triton"], False, PEER, "its GPU kernels")
        decay = h["weight_decay"]
        if h["decouple_lr"]:
            if not h["max_lr"]:
                raise ValueError("decouple_lr=True needs max_lr (optimi raises too)")
            decay = decay / h["max_lr"]
        sixteen = any(p.dtype in _SIXTEEN for _, p in named)
        kahan = sixteen if h["kahan_sum"] is None else bool(h["kahan_sum"]) and sixteen
        names.update({id(p): n for n, p in named})
        groups.append(dict(params=[p for _, p in named], lr=h["lr"], betas=tuple(h["betas"]),
                           eps=h["eps"], weight_decay=decay, gamma=0.0, mars_type="mars-adamw",
                           optimize_1d=True, clip_scope="none", kahan_sum=kahan))
    return OurMARS(groups, dict(foreach=False), names)


# ------------------------------------------------------------------ the trajectories

def start(shape, seed=0):
    """bf16 values with |p| in [1, 2) (one binade, spacing 2^-7; no sign change in a short
    run, so the spacing of the float32 trajectory's values is that of the start)."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = 1.0 + torch.rand(shape, generator=gen)
    return (magnitude * torch.randn(shape, generator=gen).sign()).bfloat16()


def gradients(shape, steps, seed=1):
    """A fixed sequence of bf16 gradients: every run sees the same ones, whatever its
    iterate, so runs differ only in how they store and sum (not in the loss landscape)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).bfloat16() for _ in range(steps)]


def trajectory(make, p0, grads, dtype, step=None):
    """The parameter and its ``kahan_comp`` (or None) after ``grads``, from ``p0`` in
    ``dtype``; ``make(p)`` builds the optimizer, ``step(opt)`` steps it (``opt.step()``)."""
    p = torch.nn.Parameter(p0.to(dtype).clone())
    opt = make(p)
    for g in grads:
        p.grad = g.to(dtype).clone()  # a copy: optimi writes into its gradient
        (step or (lambda o: o.step()))(opt)
    comp = opt.state[p].get("kahan_comp")
    return p.detach().clone(), (comp.detach().clone() if isinstance(comp, torch.Tensor)
                                and comp.shape == p.shape else None)


def in_ulps(value, reference):
    """|value - reference| in bf16 spacings of the reference (float32)."""
    spacing = torch.exp2(torch.floor(torch.log2(reference.abs())) - 7)
    return (value.float() - reference).abs() / spacing
