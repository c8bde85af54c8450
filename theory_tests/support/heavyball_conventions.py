"""HeavyBall 3.2.1's ``heavyball.AdamW`` (with ``mars=True`` or without) as our ``torch_impl.MARS``,
every convention written as code (the pattern of ``peer_conventions.py``: a map returns an
``OurMARS``, refuses with a ``ValueError`` naming the keyword what it cannot express, and
never maps a case approximately).  ``paper_notes/peers_low_precision.md`` lists each
difference with the measured agreement; ``theory_tests/peers/test_heavyball.py`` runs them.

The differences (read in ``heavyball/chainable.py`` and ``heavyball/utils.py`` of 3.2.1, and
checked by running it):

* The correction coefficient.  ``chainable.mars`` calls
  ``utils.mars_correction(update, old, group["mars_gamma"], beta1)`` while the signature is
  ``mars_correction(g, old_g, beta1, gamma)``, so inside it ``beta1`` is the user's gamma and
  ``gamma`` the user's beta1: ``a = -gamma * beta1 / (1 - beta1)`` evaluates to
  ``-γ β₁ / (1 - γ)``, and ``stochastic_lerp_(g, old_g, a)`` gives
  c = g + k (g - g_prev) with k = γ β₁ / (1 - γ), where the paper (and ours, M1/M2) has
  a = γ β₁ / (1 - β₁): 10x smaller at β₁ = 0.9, γ ≪ 1.  Map: our gamma is
  γ' = k (1 - β₁) / β₁ = γ (1 - β₁) / (1 - γ), so that our a = γ' β₁ / (1 - β₁) = k
  (``mapped_gamma``).  A γ' above 1 (our gamma's range) is refused.
* No clip of c (M3): our ``clip_scope="none"``.
* No routing by shape: every tensor takes the corrected AdamW rule, 0-D and 1-D included:
  one group of ours per peer group with ``optimize_1d=True``.
* g_prev = 0 at the first step (its ``mars_old_grad`` starts at zero): c₁ = (1 + k) g₁, as
  ours (M2).  Its ``old_grad`` stores the raw gradient, as our ``last_grad``.
* Bias corrections folded into the EMA weights: it stores the debiased moments
  m̂ = lerp(m̂, c, 1 - β̂ₜ) with β̂ₜ = 1 - (1 - β)/(1 - βᵗ) (``beta_debias``), which is
  m / (1 - β₁ᵗ) and v / (1 - β₂ᵗ) of ours in exact arithmetic; the state holds m̂, v̂, not
  m, v (a state_dict is not interchangeable).  Its β̂ are 0-D tensors of the parameter's
  float type (float32 for float32 and 16-bit parameters), so float32 runs compute them in
  float32 (``theory_tests/peers/_heavyball_bounds.py`` bounds what that moves).
* eps: its denominator is max(√v̂, ε) (``eps_sqrt``: ``sqrt().clamp(min=eps)``), ours
  √v̂ + ε.  Not expressible (a max is not a sum): our eps is the peer's, and the tests bound
  the difference from the peer's own v̂; with ε → 1e-30 on both sides the map is
  rounding-exact.
* Weight decay: p ← p (1 - η λ) - η u, as ours.
* The learning rate: each step it sets ``lr = base_lr * step / step.clamp(min=warmup_steps +
  1)`` with ``step`` an int64 tensor, so lr is a float32 tensor (torch's default dtype) even
  for float64 parameters, and ramps linearly over ``warmup_steps + 1`` steps.  Map:
  ``before_step`` sets our group's lr to that float32 value, computed the same way from our
  group's lr (a schedule written into ``group["lr"]`` moves both: HeavyBall takes a changed
  ``lr`` as its new ``base_lr``, with a once-per-process warning), ``after_step`` restores it.
* Step counter per group (``group["step_count"]``), ours per tensor; a tensor without a
  gradient is skipped by both, but HeavyBall keeps its old ``old_grad`` and its group count
  moves on: a tensor without a gradient after a step, or one starting late, is refused per
  step (ValueError naming it).
* Storage: ``storage_dtype`` must be the parameters' dtype (float32 or float64; another
  wide one makes it compute its moments in the storage dtype: refused) or ``"bfloat16"``
  (our ``state_dtype=torch.bfloat16``, ``state_rounding="stochastic"``: compared in
  distribution, ``theory_tests/peers/test_peer_rounding_law.py``).  Its bf16 writes round
  stochastically (16 random bits added to the float32 pattern, then truncated); a float16
  target is written to nearest (``copy_stochastic_`` rounds only bf16): ``"float16"`` is
  refused.  Its float32 and float64 writes do not round.
* It overwrites the gradient tensor it was given with c (``copy_stochastic_list_(grad,
  update)``) and sets ``p.grad = None`` (``consume_grad``).  A caller comparing it must copy
  the gradients before its step (the lockstep does).
* ``mars=True`` with 16-bit gradients and ``promote`` off writes c back into the 16-bit
  update tensor (rounded) before Adam sees it; ours keeps c in float32: refused.
* Refused (no counterpart): ``caution``, ``cautious_weight_decay``, ``gradient_clipping``,
  ``update_clipping``, ``palm`` (its β₂ schedule), ``ecc`` / ``param_ecc`` (its error-
  correcting storage), ``orig_shapes``.  ``multi_tensor`` changes no number (eager: the same
  element-wise ops per tensor; both values are tested); ``compile_step`` and HeavyBall's
  module-level ``utils.compile_mode`` (default: every fused function compiled with
  ``max-autotune-no-cudagraphs``, 17 s for the first step on the CPU here) are its kernels,
  not its arithmetic; the tests run it eager (``compile_mode = None``).
"""
import torch

from .peer_conventions import OurMARS, _check_unknown, _peer_groups, _refuse

__all__ = ["HEAVYBALL_VERSION", "HEAVYBALL_ADAMW_DEFAULTS", "USE_DEFAULT", "load_heavyball",
           "from_heavyball_adamw", "heavyball_coefficient", "mapped_gamma", "heavyball_lr"]

HEAVYBALL_VERSION = "3.2.1"


class _UseDefault:
    """Stands for HeavyBall's ``use_default`` sentinel in the defaults below (the test maps
    the installed sentinel to it)."""

    def __repr__(self):
        return "USE_DEFAULT"


USE_DEFAULT = _UseDefault()

# ``heavyball.AdamW.__init__`` defaults of 3.2.1 (the test checks them against the installed
# signature).
HEAVYBALL_ADAMW_DEFAULTS = dict(
    lr=0.0025, betas=(0.9, 0.99), eps=1e-8, weight_decay=0, cautious_weight_decay=False,
    warmup_steps=0, multi_tensor=True, storage_dtype="float32", mars=False, caution=False,
    mars_gamma=0.0025, gradient_clipping=USE_DEFAULT, update_clipping=USE_DEFAULT,
    palm=USE_DEFAULT, beta2_scale=0.8, compile_step=USE_DEFAULT, promote=USE_DEFAULT,
    ecc=None, param_ecc=None, orig_shapes=None)

PEER = "heavyball.AdamW"
_SIXTEEN = (torch.bfloat16, torch.float16)


def heavyball_coefficient(gamma, beta1):
    """k of HeavyBall's c = g + k (g - g_prev): its ``a = -gamma * beta1 / (1 - beta1)`` with
    its ``beta1`` bound to the user's gamma and its ``gamma`` to the user's beta1."""
    return gamma * beta1 / (1.0 - gamma)


def mapped_gamma(gamma, beta1):
    """Our gamma whose a = gamma beta1 / (1 - beta1) is HeavyBall's k (0 where beta1 = 0:
    both coefficients vanish)."""
    if beta1 == 0.0:
        return 0.0
    return heavyball_coefficient(gamma, beta1) * (1.0 - beta1) / beta1


def heavyball_lr(lr, step, warmup_steps):
    """The lr HeavyBall steps with at its group step ``step``: ``base_lr * step /
    step.clamp(min=warmup_steps + 1)`` with an int64 ``step``, evaluated as it is (float32)."""
    t = torch.tensor(step, dtype=torch.int64)
    return (lr * t / t.clamp(min=warmup_steps + 1)).item()


def _storage(storage_dtype, params):
    """Our storage keywords for HeavyBall's ``storage_dtype`` on these parameters."""
    dtypes = {p.dtype for _, p in params}
    if storage_dtype == "bfloat16":
        return dict(state_dtype=torch.bfloat16, state_rounding="stochastic")
    wide = getattr(torch, storage_dtype, None)
    if storage_dtype == "float16":
        raise ValueError("storage_dtype='float16': HeavyBall writes a float16 state to nearest "
                         "(its copy_stochastic_ rounds only bfloat16 targets); no test compares "
                         "it, so the map refuses it")
    if wide not in (torch.float32, torch.float64) or dtypes != {wide}:
        raise ValueError(f"storage_dtype={storage_dtype!r} with {sorted(map(str, dtypes))} "
                         "parameters: HeavyBall computes its moments in the storage dtype "
                         "(its lerp casts the gradient to it); torch_impl.MARS computes in the "
                         "parameter's, so the map takes only the parameters' own dtype or "
                         "'bfloat16'")
    return {}


def from_heavyball_adamw(params, **kwargs):
    """``heavyball.AdamW(params, **kwargs)`` (3.2.1) as our MARS (module docstring: every
    difference and its map).  ``mars=False`` is plain AdamW: our gamma = 0."""
    _check_unknown(kwargs, HEAVYBALL_ADAMW_DEFAULTS, PEER)
    d = {**HEAVYBALL_ADAMW_DEFAULTS, **kwargs}
    groups, names, origin, warmups = [], {}, [], []
    for gi, (keys, named) in enumerate(_peer_groups(params)):
        h = {**d, **keys}
        for flag, default, why in (
                ("caution", False, "Cautious Optimizers' mask"),
                ("cautious_weight_decay", False, "decay masked by sign agreement"),
                ("gradient_clipping", USE_DEFAULT, "its gradient clipping functions"),
                ("update_clipping", USE_DEFAULT, "its update clipping functions"),
                ("ecc", None, "its error-correcting state storage"),
                ("param_ecc", None, "its error-correcting parameter storage"),
                ("orig_shapes", None, "its FSDP shape bookkeeping")):
            _refuse(flag, h[flag], default, PEER, why)
        if h["palm"] not in (USE_DEFAULT, False):
            _refuse("palm", h["palm"], False, PEER, "its beta2 = 1 - step^-beta2_scale schedule")
        beta1, beta2 = (float(b) for b in h["betas"])
        names.update({id(p): n for n, p in named})
        if h["mars"]:
            if h["promote"] is not True and any(p.dtype in _SIXTEEN for _, p in named):
                raise ValueError("mars=True with 16-bit parameters and promote off: HeavyBall "
                                 "writes c into the 16-bit update tensor (rounded) before its "
                                 "Adam step; torch_impl.MARS keeps c in float32. Pass "
                                 "promote=True")
            if not 0.0 <= h["mars_gamma"] < 1.0:
                raise ValueError(f"mars_gamma={h['mars_gamma']!r}: HeavyBall's coefficient "
                                 "gamma beta1 / (1 - gamma) needs 0 <= mars_gamma < 1")
            gamma = mapped_gamma(float(h["mars_gamma"]), beta1)
            if gamma > 1.0:
                raise ValueError(f"mars_gamma={h['mars_gamma']!r}: HeavyBall's coefficient "
                                 f"{heavyball_coefficient(h['mars_gamma'], beta1):.4g} needs our "
                                 f"gamma = {gamma:.4g}, outside [0, 1]")
        else:
            gamma = 0.0
        groups.append(dict(params=[p for _, p in named], lr=h["lr"], betas=(beta1, beta2),
                           eps=h["eps"], weight_decay=h["weight_decay"], gamma=gamma,
                           mars_type="mars-adamw", optimize_1d=True, clip_scope="none",
                           **_storage(h["storage_dtype"], named)))
        warmups.append(int(h["warmup_steps"]))
        origin.append(gi)
    counts = [0] * len(groups)  # each peer group's step_count after the coming step
    scheduled = {}

    def before_step(opt):
        for i, group in enumerate(opt.param_groups):
            counts[i] += 1
            t = counts[i]
            for p in group["params"]:
                st = opt.state.get(p, {})
                stepped = int(st["step"].item()) if "step" in st else 0
                if (p.grad is None and stepped) or (p.grad is not None and stepped != t - 1):
                    now = "no gradient" if p.grad is None else "a gradient"
                    raise ValueError(f"{names[id(p)]}: {now} at the group's step {t} after "
                                     f"{stepped} steps of its own; HeavyBall counts steps per "
                                     "group and keeps a skipped tensor's old_grad, "
                                     "torch_impl.MARS counts per tensor (g_prev = 0 after a gap)")
            scheduled[i] = group["lr"]
            group["lr"] = heavyball_lr(float(group["lr"]), t, warmups[i])

    def after_step(opt):
        for i, lr in scheduled.items():
            opt.param_groups[i]["lr"] = lr
        scheduled.clear()

    return OurMARS(groups, dict(foreach=False), names, before_step, after_step, origin)


def load_heavyball():
    """``import heavyball``, refusing another version than the map was written against (CI
    installs it: ``pip install --no-deps heavyball==3.2.1``; the tests do not skip)."""
    from importlib.metadata import version

    installed = version("heavyball")
    if installed != HEAVYBALL_VERSION:
        raise RuntimeError(f"heavyball {installed} is installed; the convention map was written "
                           f"against heavyball {HEAVYBALL_VERSION}")
    import heavyball
    return heavyball
