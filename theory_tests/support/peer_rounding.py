"""One AdamW step of each implementation from one starting state, written into R identical rows,
so that every element of a row draws the rounding of the same value: the experiment
``rounding_law.classify`` judges (``theory_tests/peers/test_peer_rounding_law.py``).

The same starting state in every convention: betas (0.5, 0.75) make 1 - β₁ = 2^-1 and
1 - β₂ = 2^-2, so after one step the raw moments of ours and torchao (m, v) and HeavyBall's
debiased ones (m̂ = m / (1 - β₁), v̂ = v / (1 - β₂)) are a power of two apart and the same
bf16 values in both.  The step's inputs are then equal in exact arithmetic, and the values x
each implementation writes differ only by float32 rounding.  Each implementation's x comes from
its own float32 twin: the same class on float32 parameters with float32 state, set to the same
values and given the same gradient, which computes the same float32 operations and writes them
without rounding.

Adapters (``heavyball_adapter``, ``torchao_adapter``, ``ours_adapter``,
``ours_as_heavyball_adapter``): ``build(p, narrow)`` (``narrow``: the 16-bit configuration;
else the float32 twin), ``state(opt, p)`` ({"exp_avg": tensor, "exp_avg_sq": tensor}, the live
buffers), ``step(opt)``.
"""
import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from .rounding_law import classify

__all__ = ["BETAS", "LR", "Adapter", "one_step", "heavyball_adapter", "torchao_adapter",
           "ours_adapter", "ours_as_heavyball_adapter", "eager_torch_compile"]

BETAS = (0.5, 0.75)
LR = 2.0 ** -7   # about one bf16 spacing of a parameter in [1, 2): every step moves the rows
EPS = 1e-8
WD = 0.0625


@dataclass
class Adapter:
    name: str
    build: Callable          # (param, narrow) -> optimizer
    state: Callable          # (optimizer, param) -> {"exp_avg": ..., "exp_avg_sq": ...}
    debiased: bool           # stores m̂, v̂ (HeavyBall) rather than m, v
    narrow_param_dtype: torch.dtype
    step: Callable = lambda opt: opt.step()


@contextlib.contextmanager
def eager_torch_compile():
    """``torch.compile(fn, ...)`` returns ``fn`` inside: torchao's optimizers compile their step
    at every call site (19 s for the first shape on the CPU here, 6 s each new shape); eager,
    the same Python function runs, with torch's eager kernels and the default generator."""
    real = torch.compile
    torch.compile = lambda fn=None, **kwargs: fn
    try:
        yield
    finally:
        torch.compile = real


def heavyball_adapter(heavyball, param_dtype=torch.bfloat16, storage="bfloat16"):
    """HeavyBall 3.2.1 ``AdamW`` (mars off) on ``param_dtype`` parameters with
    ``storage_dtype=storage``; run eager (the caller sets ``heavyball.utils.compile_mode =
    None``)."""
    def build(p, narrow):
        return heavyball.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                               storage_dtype=storage if narrow else "float32")

    def state(opt, p):
        return {k: opt.state_(p)[opt._find_val_name(k)] for k in ("exp_avg", "exp_avg_sq")}

    return Adapter(f"heavyball ({param_dtype} parameters, {storage} storage)", build, state,
                   True, param_dtype)


def torchao_adapter(compiled=False):
    """torchao 0.18 ``_AdamW(bf16_stochastic_round=True)``: its state is ``zeros_like(p)``,
    so bf16 on bf16 parameters."""
    from torchao.optim import _AdamW

    def build(p, narrow):
        return _AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                      bf16_stochastic_round=narrow)

    def state(opt, p):
        return {k: opt.state[p][k] for k in ("exp_avg", "exp_avg_sq")}

    def step(opt):
        with (contextlib.nullcontext() if compiled else eager_torch_compile()):
            opt.step()

    return Adapter("torchao" + (" (compiled)" if compiled else ""), build, state, False,
                   torch.bfloat16, step)


def ours_adapter(state_rounding="stochastic", param_dtype=torch.bfloat16):
    """``torch_impl.MARS`` with gamma = 0 (AdamW), no clip, bf16 state with ``state_rounding``
    on ``param_dtype`` parameters; the twin: float32 everything."""
    from torch_impl import MARS

    def build(p, narrow):
        kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, gamma=0.0,
                  mars_type="mars-adamw", optimize_1d=True, clip_scope="none")
        if narrow:
            kw.update(state_dtype=torch.bfloat16, state_rounding=state_rounding)
        return MARS([p], **kw)

    def state(opt, p):
        return {k: opt.state[p][k] for k in ("exp_avg", "exp_avg_sq")}

    return Adapter(f"ours ({state_rounding})", build, state, False, param_dtype)


def ours_as_heavyball_adapter(param_dtype=torch.bfloat16, storage="bfloat16"):
    """Ours built by the HeavyBall map (``from_heavyball_adamw``) from the keywords of
    ``heavyball_adapter(param_dtype, storage)``: its storage branch, stepped with the map's
    per-step edits."""
    from .heavyball_conventions import from_heavyball_adamw

    maps = {}

    def build(p, narrow):
        mapping = from_heavyball_adamw([("p", p)], lr=LR, betas=BETAS, eps=EPS,
                                       weight_decay=WD,
                                       storage_dtype=storage if narrow else "float32")
        opt = mapping.build()
        maps[id(opt)] = mapping
        return opt

    def state(opt, p):
        return {k: opt.state[p][k] for k in ("exp_avg", "exp_avg_sq")}

    return Adapter(f"ours as heavyball ({param_dtype} parameters, {storage} storage)", build,
                   state, False, param_dtype, lambda opt: maps[id(opt)].step(opt))


def _values(cols, seed):
    gen = torch.Generator().manual_seed(seed)
    p0 = (1.0 + torch.rand(cols, generator=gen)).bfloat16()      # one binade: [1, 2)
    m_hat = (0.5 * torch.randn(cols, generator=gen)).bfloat16()
    v_hat = (0.25 + torch.rand(cols, generator=gen)).bfloat16()  # sqrt(v̂) >= 0.5 >> eps
    g1 = torch.randn(cols, generator=gen).bfloat16()
    g2 = torch.randn(cols, generator=gen).bfloat16()
    return p0, m_hat, v_hat, g1, g2


def _run(adapter, values, rows, narrow):
    p0, m_hat, v_hat, g1, g2 = values
    dtype = adapter.narrow_param_dtype if narrow else torch.float32
    p = torch.nn.Parameter(p0.to(dtype).expand(rows, -1).clone())
    opt = adapter.build(p, narrow)
    p.grad = g1.to(dtype).expand(rows, -1).clone()
    adapter.step(opt)  # creates the state at step 1; overwritten below
    with torch.no_grad():
        for (name, buf), start, beta in zip(adapter.state(opt, p).items(), (m_hat, v_hat),
                                            BETAS):
            scale = 1.0 if adapter.debiased else 1.0 - beta  # a power of two: exact
            buf.copy_((start.double() * scale).to(buf.dtype).expand_as(buf))
        p.copy_(p0.to(dtype).expand(rows, -1))
    p.grad = g2.to(dtype).expand(rows, -1).clone()
    adapter.step(opt)
    out = {k: v.detach().clone() for k, v in adapter.state(opt, p).items()}
    out["param"] = p.detach().clone()
    return out


def one_step(adapter, rows=4096, cols=64, seed=0):
    """{"exp_avg" | "exp_avg_sq" | "param": Law} of ``adapter``'s step 2 from the shared
    starting state, each element's x from the float32 twin.  Deterministic: ``seed`` fixes
    the values and torch's default generator (ours draws ``rounding_seed`` from it where it
    is not given)."""
    values = _values(cols, seed)
    torch.manual_seed(seed)  # the peers draw their bits from torch's default generator
    narrow = _run(adapter, values, rows, True)
    twin = _run(adapter, values, 1, False)
    return {k: classify(narrow[k], twin[k][0]) for k in narrow}
