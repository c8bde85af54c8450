"""Convention maps, written as code: a peer's MARS constructor keywords -> our ``torch_impl.MARS``.

Each ``from_*`` function takes the parameters and the keywords one would give the peer's class
and returns an ``OurMARS``: the parameter groups and keywords of the ``torch_impl.MARS`` that
takes the same steps, and the per-step group edits (``before_step`` / ``after_step``, both
given our optimizer) that some conventions need.  ``OurMARS.step(opt)`` runs
``before_step``, ``opt.step()``, ``after_step``.  What a map cannot express it refuses with a
``ValueError`` naming the keyword (or, per step, the tensor) rather than mapping it wrongly.
``theory_tests/peers/README.md`` lists every difference, the map of each, and the measured agreement.

Both peers route a tensor by ``ndim >= 2`` (or ``optimize_1d``) to the MARS rule; ours routes
``ndim == 2`` (or ``optimize_1d``), so 3-D and 4-D tensors (convolution kernels) would take
our AdamW fallback.  Both maps therefore split each peer group into at most two of ours: the
tensors the peer sends through MARS, in a group with ``optimize_1d=True`` (where every tensor
of ours takes the mars_type rule, clipped by its whole-tensor norm, as the peers do), and the
rest (ndim < 2 without the peer's ``optimize_1d``) in a group with ``optimize_1d=False``, our
fallback (M14).  That maps every shape exactly, so no shape is refused.

Parameters may be given as tensors, as ``(name, tensor)`` pairs (``named_parameters()``) or as
group dicts of either; the names appear in the per-step refusals.
"""
import math
from dataclasses import dataclass, field
from typing import Callable


from torch_impl import MARS

__all__ = ["OurMARS", "from_timm_mars", "from_pytorch_optimizer_mars", "TIMM_DEFAULTS",
           "PYTORCH_OPTIMIZER_DEFAULTS", "SQRT_EPS_1E15"]

# timm 1.0.31 ``Mars.__init__`` defaults (``theory_tests/peers`` checks them against the
# installed signature).
TIMM_DEFAULTS = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0, gamma=0.025,
                     mars_type="adamw", optimize_1d=False, lr_1d_factor=1.0, betas_1d=None,
                     caution=False)

# pytorch_optimizer 4.1.0 ``MARS.__init__`` defaults (checked the same way).
PYTORCH_OPTIMIZER_DEFAULTS = dict(lr=3e-3, betas=(0.95, 0.99), gamma=0.025, mars_type="adamw",
                                  optimize_1d=False, lr_1d=3e-3, betas_1d=(0.9, 0.95),
                                  weight_decay=0.0, weight_decay_1d=1e-1, weight_decouple=True,
                                  fixed_decay=False, ams_bound=False, cautious=False, eps=1e-8,
                                  maximize=False, foreach=None)

# pytorch_optimizer's ``apply_ams_bound`` takes sqrt(v + 1e-15): the one difference no
# hyperparameter of ours can express (the peer tests bound its effect, ``peers.md``).
SQRT_EPS_1E15 = 1e-15


@dataclass
class OurMARS:
    """Our construction of a peer's optimizer.

    ``param_groups``: group dicts for ``torch_impl.MARS`` (tensors under ``"params"``);
    ``kwargs``: its constructor keywords; ``names``: id(tensor) -> a name for refusals;
    ``before_step(opt)`` / ``after_step(opt)``: the per-step edits of ``opt.param_groups``."""
    param_groups: list
    kwargs: dict
    names: dict
    before_step: Callable = None
    after_step: Callable = None
    origin: list = field(default_factory=list)  # our group i came from peer group origin[i]

    def build(self):
        return MARS(self.param_groups, **self.kwargs)

    def step(self, opt, closure=None):
        if self.before_step is not None:
            self.before_step(opt)
        loss = opt.step(closure)
        if self.after_step is not None:
            self.after_step(opt)
        return loss


# ------------------------------------------------------------------ shared pieces

def _peer_groups(params):
    """[(group keywords, [(name, tensor), ...])] of a peer's ``params`` argument."""
    params = list(params)
    if params and isinstance(params[0], dict):
        groups = [(dict(g), list(g["params"])) for g in params]
    else:
        groups = [({}, params)]
    out = []
    for gi, (keys, items) in enumerate(groups):
        keys.pop("params", None)
        named = []
        for i, item in enumerate(items):
            if isinstance(item, tuple):
                named.append(item)
            else:
                where = f"group {gi} " if len(groups) > 1 else ""
                named.append((f"{where}params[{i}] (shape {tuple(item.shape)})", item))
        out.append((keys, named))
    return out


def _split(named, peer_optimize_1d):
    """The peer's MARS-path tensors (ndim >= 2, or all with its ``optimize_1d``) and the rest."""
    mars = [(n, p) for n, p in named if peer_optimize_1d or p.ndim >= 2]
    rest = [(n, p) for n, p in named if not (peer_optimize_1d or p.ndim >= 2)]
    return mars, rest


def _check_unknown(kwargs, defaults, peer):
    unknown = sorted(set(kwargs) - set(defaults))
    if unknown:
        raise ValueError(f"{peer}: keyword(s) {unknown} have no counterpart in the convention map")


def _refuse(flag, value, default, peer, why):
    if value != default:
        raise ValueError(f"{flag}={value!r}: {peer}'s {flag} has no counterpart in "
                         f"torch_impl.MARS ({why}); the map refuses it")


def _each_live(opt, group):
    """(tensor, our state step) for the tensors of ``group`` with a gradient now."""
    for p in group["params"]:
        if p.grad is not None:
            st = opt.state.get(p, {})
            yield p, int(st["step"].item()) if "step" in st else 0


# ------------------------------------------------------------------ timm

def from_timm_mars(params, **timm_kwargs):
    """``timm.optim.Mars(params, **timm_kwargs)`` (timm 1.0.31) as our MARS.

    Differences and their maps:

    * Step 1: timm takes c_1 = g_1 (no correction, "a timm addition"); ours takes
      c_1 = (1 + a) g_1 with g_0 = 0 (M2).  Map: our group ``gamma`` is set to 0 before a step
      in which the group's MARS-path tensors take their first step (c = lerp(0, g, 1) = g
      exactly) and restored after it.  timm counts steps per tensor; our gamma is per group,
      so a step in which some of a group's MARS-path tensors take their first step and others
      do not is refused (ValueError naming a tensor).
    * A tensor without a gradient after it has stepped: timm keeps its old ``last_grad``; ours
      takes g_prev = 0 at its next step (M2).  Refused per step (ValueError naming it) for
      MARS-path tensors; fallback tensors keep no ``last_grad`` and agree.
    * Routing: ndim >= 2 (timm) vs ndim == 2 (ours): the group split of the module docstring.
    * The non-MARS tensors: AdamW with lr * ``lr_1d_factor`` (a ratio, as ours), ``betas_1d``
      (defaults to ``betas``) and the group's ``weight_decay`` (timm has no
      ``weight_decay_1d``): our ``lr_1d_factor``, ``betas_1d`` and
      ``weight_decay_1d_source="group"``.
    * The clip c / max(1, ||c||) over each whole tensor: our ``clip_scope="tensor"``.
    * eps after the bias correction, (sqrt(v)/sqrt(bc2) + eps): as ours.  Weight decay
      p -= lr (wd p + u): ours p <- p (1 - lr wd) - lr u, equal up to rounding.
    * ``mars_type`` "adamw" / "lion": ours "mars-adamw" / "mars-lion".  ``caution=True``
      (Cautious Optimizers' mask) has no counterpart: refused.
    """
    _check_unknown(timm_kwargs, TIMM_DEFAULTS, "timm Mars")
    d = {**TIMM_DEFAULTS, **timm_kwargs}
    groups, names, origin, mars_groups = [], {}, [], []
    for gi, (keys, named) in enumerate(_peer_groups(params)):
        h = {**d, **keys}
        _refuse("caution", h["caution"], False, "timm Mars", "Cautious Optimizers' mask")
        if h["mars_type"] not in ("adamw", "lion"):
            raise ValueError(f"mars_type={h['mars_type']!r}: timm Mars takes 'adamw' or 'lion'")
        names.update({id(p): n for n, p in named})
        common = dict(lr=h["lr"], betas=tuple(h["betas"]), eps=h["eps"],
                      weight_decay=h["weight_decay"], gamma=h["gamma"],
                      mars_type="mars-" + h["mars_type"], lr_1d_factor=h["lr_1d_factor"],
                      betas_1d=tuple(h["betas_1d"] or h["betas"]),
                      weight_decay_1d_source="group", clip_scope="tensor")
        mars, rest = _split(named, h["optimize_1d"])
        if mars:
            mars_groups.append(len(groups))
            groups.append(dict(common, params=[p for _, p in mars], optimize_1d=True))
            origin.append(gi)
        if rest:
            groups.append(dict(common, params=[p for _, p in rest], optimize_1d=False))
            origin.append(gi)
    saved = {}

    def before_step(opt):
        for i in mars_groups:
            group = opt.param_groups[i]
            for p in group["params"]:
                if p.grad is None and "last_grad" in opt.state.get(p, {}):
                    raise ValueError(f"{names[id(p)]}: no gradient after a step; timm keeps its "
                                     "last_grad, torch_impl.MARS takes g_prev = 0 (M2)")
            live = list(_each_live(opt, group))
            first = {step == 0 for _, step in live}
            if first == {True, False}:
                p = next(p for p, step in live if step == 0)
                raise ValueError(f"{names[id(p)]}: takes its first step while other tensors of "
                                 "its group do not; timm's step-1 rule (c_1 = g_1) is per "
                                 "tensor, our gamma per group")
            if first == {True}:
                saved[i] = group["gamma"]
                group["gamma"] = 0.0

    def after_step(opt):
        for i, gamma in saved.items():
            opt.param_groups[i]["gamma"] = gamma
        saved.clear()

    return OurMARS(groups, dict(foreach=False), names, before_step, after_step, origin)


# ------------------------------------------------------------------ pytorch_optimizer

def from_pytorch_optimizer_mars(params, **kwargs):
    """``pytorch_optimizer.MARS(params, **kwargs)`` (pytorch_optimizer 4.1.0) as our MARS.

    Differences and their maps:

    * eps before the bias correction: the peer divides by (sqrt(v + 1e-15) + eps) / sqrt(bc2)
      (and multiplies by bc1), ours by sqrt(v) / sqrt(bc2) + eps.  Map: our group ``eps`` is
      eps / sqrt(1 - beta2^t) during step t (set by ``before_step``, restored by
      ``after_step``), with the beta2 of the rule the group's tensors take (``betas`` on the
      MARS path, ``betas_1d`` in the fallback: the two are separate groups of ours).
    * The 1e-15 under the square root (``SQRT_EPS_1E15``) has no counterpart: it moves the
      denominator by sqrt(v + 1e-15) - sqrt(v) <= 1e-15 / (2 sqrt(v)).  The peer tests bound
      its effect on the iterate (``peers.md``: the derivation); it is not mapped.
    * Step counter per group (the peer's ``group["step"]`` advances at every ``step()``),
      ours per tensor: equal while every tensor of a group has a gradient at every step.  A
      tensor that stepped before and has no gradient now, or one that starts late, is refused
      per step (ValueError naming it).  Step 1 takes c_1 = (1 + a) g_1 as ours.
    * Routing ndim >= 2: the group split of the module docstring.
    * The non-MARS tensors: AdamW with lr * ``lr_1d_factor`` where the peer stores
      ``lr_1d_factor = lr_1d / lr`` at construction (a ratio, as ours: a schedule on ``lr``
      moves both), ``betas_1d`` and ``weight_decay_1d``: our ``lr_1d_factor``, ``betas_1d``,
      ``weight_decay_1d`` with ``weight_decay_1d_source="constructor"``.  A user group with
      its own ``lr`` keeps the constructor's ``lr_1d_factor`` in the peer, and here.
    * Weight decay: decoupled p <- p (1 - wd lr) before the update (``weight_decouple=True``,
      ``fixed_decay=False``): ours exactly (the same factor 1 - lr wd); the other forms are
      refused.
    * The clip: the peer divides by ||c|| when ||c|| > 1 (loop path) or by max(||c||, 1)
      (foreach path); ours by max(||c||, 1): the same numbers.
    * ``foreach`` (the peer's loop or multi-tensor path) changes no number: passed on to ours.
    * ``mars_type="shampoo"`` is refused: the peer's Newton-Schulz always runs in bfloat16 and
      normalises by max(||X||, eps) after rounding X to bfloat16, ours by ||M|| + eps before
      rounding; a bfloat16 rounding apart, so no setting of ours is the same map (and a
      tensor of ndim > 2 is flattened to (dim0, -1) and scaled by its size(1), which ours has
      no rule for).  ``ams_bound`` (the bound also on the fallback's v, which ours has not),
      ``cautious`` and ``maximize`` (the peer negates ``p.grad`` in place) are refused too.
    """
    _check_unknown(kwargs, PYTORCH_OPTIMIZER_DEFAULTS, "pytorch_optimizer MARS")
    d = {**PYTORCH_OPTIMIZER_DEFAULTS, **kwargs}
    lr_1d_factor = d["lr_1d"] / d["lr"]  # the peer's defaults["lr_1d_factor"]
    peer = "pytorch_optimizer MARS"
    groups, names, origin, eps_map = [], {}, [], []
    for gi, (keys, named) in enumerate(_peer_groups(params)):
        h = {**d, "lr_1d_factor": lr_1d_factor, **keys}
        if h["mars_type"] == "shampoo":
            raise ValueError("mars_type='shampoo': pytorch_optimizer's MARS-Shampoo runs its "
                             "own bfloat16 Newton-Schulz (normalised after the cast, by "
                             "max(norm, eps)); torch_impl.MARS cannot take the same steps, "
                             "so the map refuses it (theory_tests/peers/README.md)")
        if h["mars_type"] not in ("adamw", "lion"):
            raise ValueError(f"mars_type={h['mars_type']!r}: not a pytorch_optimizer MARS type")
        _refuse("weight_decouple", h["weight_decouple"], True, peer, "coupled L2 decay")
        _refuse("fixed_decay", h["fixed_decay"], False, peer, "decay not scaled by lr")
        _refuse("ams_bound", h["ams_bound"], False, peer, "the bound also on the fallback's v")
        _refuse("cautious", h["cautious"], False, peer, "Cautious Optimizers' mask")
        _refuse("maximize", h["maximize"], False, peer, "the peer negates p.grad in place")
        names.update({id(p): n for n, p in named})
        common = dict(lr=h["lr"], betas=tuple(h["betas"]), eps=h["eps"],
                      weight_decay=h["weight_decay"], gamma=h["gamma"],
                      mars_type="mars-" + h["mars_type"], lr_1d_factor=h["lr_1d_factor"],
                      betas_1d=tuple(h["betas_1d"]), weight_decay_1d=h["weight_decay_1d"],
                      weight_decay_1d_source="constructor", clip_scope="tensor")
        on_mars, on_fallback = _split(named, h["optimize_1d"])
        if on_mars:
            groups.append(dict(common, params=[p for _, p in on_mars], optimize_1d=True))
            eps_map.append(dict(group=len(groups) - 1, peer_group=gi, eps=h["eps"],
                                beta2=float(h["betas"][1])))
            origin.append(gi)
        if on_fallback:
            groups.append(dict(common, params=[p for _, p in on_fallback], optimize_1d=False))
            eps_map.append(dict(group=len(groups) - 1, peer_group=gi, eps=h["eps"],
                                beta2=float(h["betas_1d"][1])))
            origin.append(gi)
    peer_steps = {}  # peer group -> its group["step"] after the coming step

    def before_step(opt):
        for gi in set(origin):
            peer_steps[gi] = peer_steps.get(gi, 0) + 1
        for e in eps_map:
            t = peer_steps[e["peer_group"]]
            group = opt.param_groups[e["group"]]
            for p in group["params"]:
                st = opt.state.get(p, {})
                stepped = int(st["step"].item()) if "step" in st else 0
                if (p.grad is None and stepped) or (p.grad is not None and stepped != t - 1):
                    now = "no gradient" if p.grad is None else "a gradient"
                    raise ValueError(f"{names[id(p)]}: {now} at the group's step {t} after "
                                     f"{stepped} steps of its own; pytorch_optimizer counts "
                                     "steps per group, torch_impl.MARS per tensor")
            group["eps"] = e["eps"] / math.sqrt(1.0 - e["beta2"] ** t)

    def after_step(opt):
        for e in eps_map:
            opt.param_groups[e["group"]]["eps"] = e["eps"]

    foreach = d["foreach"] if d["foreach"] in (True, False) else None
    return OurMARS(groups, dict(foreach=foreach), names, before_step, after_step, origin)
