"""MKOR reference in NumPy float64 (Mozaffari et al., NeurIPS 2023; spec MKOR.md).

Per preconditioned layer m with weight W (d_out x d_in) and bias b, MKOR keeps the
inverses L^{-1} (d_out x d_out) and R^{-1} (d_in' x d_in'), both starting at I, and:

1. every ``inv_freq`` steps (or during warm-up, K2) updates R^{-1} with a_bar and
   then L^{-1} with g_bar, by rank-1 Sherman-Morrison steps (K6-K12);
2. every step preconditions Delta = L^{-1} [grad_W | grad_b] R^{-1} (K13),
3. rescales Delta to the gradient's norm (K14),
4. and hands Delta to a first-order backbone (K15; ``reference.common.first_order``).

The pieces live in ``vectors`` (rank-1 statistics), ``factors`` (factor inverses, the
stabiliser, preconditioning and rescaling) and here (the whole step). Every public name
is re-exported from this module.
"""
from dataclasses import dataclass, field

import numpy as np

from reference.common import first_order
from reference.mkor.factors import (  # noqa: F401  (re-exported)
    FactorOptions, VARIANT_OPTIONS, ema_inverse_update, factor_update, max_entry_norm,
    needs_stabilising, precondition, printed_algorithm1_update, rank1_inverse_update,
    released_inverse_update, rescale, reset_factor, sherman_morrison, spectral_norm, stabilise,
    symmetrise)
from reference.mkor.rank_k import (  # noqa: F401  (re-exported)
    conv2d_group_vectors, group_means, linear_group_vectors, rank_k_factor_update,
    woodbury_ema_inverse_update, woodbury_released_update)
from reference.mkor.vectors import (  # noqa: F401  (re-exported)
    conv2d_rank1_vectors, linear_rank1_vectors, unfold2d)

__all__ = [
    # rank-1 vectors (vectors): K3, K4, K6
    "linear_rank1_vectors", "conv2d_rank1_vectors", "unfold2d",
    # factor inverses and the stabiliser (factors): K7-K12
    "sherman_morrison", "ema_inverse_update", "released_inverse_update",
    "printed_algorithm1_update", "rank1_inverse_update", "symmetrise", "max_entry_norm",
    "spectral_norm", "stabilise", "reset_factor", "needs_stabilising", "factor_update",
    "FactorOptions", "VARIANT_OPTIONS",
    # preconditioning and rescaling with the factors (factors): K13, K14
    "precondition", "rescale",
    # rank k (rank_k): KC7 group means, KC8 Woodbury
    "group_means", "linear_group_vectors", "conv2d_group_vectors",
    "woodbury_ema_inverse_update", "woodbury_released_update", "rank_k_factor_update",
    # this module: K2, K15
    "MKORConfig", "MKORReference", "backbone_update",
    "is_factor_update_step",
]


_RESCALE_DEFAULT = {"paper": "joint", "released": "sum_of_norms"}
_COUPLING_DEFAULT = {"paper": "per_factor", "released": "coupled"}


@dataclass
class MKORConfig:
    """MKOR hyperparameters (MKOR.md sections 3-4).

    Options left as None take the value of ``variant``'s column in section 4
    ("paper": before_sm / blend / per_factor / sm / joint; "released": deferred /
    identity / coupled / identity / sum_of_norms); ``__post_init__`` fills them in.
    """

    inv_freq: int = 10
    stat_decay: float = 0.95          # rho (the spec's gamma); unused by "released"
    variant: str = "paper"
    zeta: float = 0.9                 # weight on J in the blend (code: 1 - 0.1)
    threshold: float = 2.0
    stabilizer_norm: str = "max_entry"
    stabilizer_timing: str = None     # "before_sm" | "deferred"
    stabilizer_reset: str = None      # "blend" | "identity"
    stabilizer_coupling: str = None   # "per_factor" | "coupled"
    first_update: str = None          # "sm" | "identity"
    rescale: str = None               # "joint" | "sum_of_norms"
    warmup_steps: int = 0
    backbone: str = "sgd"             # a function name in reference.common.first_order
    backbone_kwargs: dict = field(default_factory=lambda: {"lr": 0.1})
    rank: int = 1                     # k group means per factor (KC7, KC8); 1 = rank-1 MKOR

    def __post_init__(self):
        defaults = VARIANT_OPTIONS[self.variant] if self.variant in VARIANT_OPTIONS else None
        if defaults is None:
            raise ValueError(f"variant must be 'paper' or 'released', got {self.variant!r}")
        for name in ("stabilizer_timing", "stabilizer_reset", "first_update"):
            if getattr(self, name) is None:
                setattr(self, name, getattr(defaults, name))
        if self.stabilizer_coupling is None:
            self.stabilizer_coupling = _COUPLING_DEFAULT[self.variant]
        if self.rescale is None:
            self.rescale = _RESCALE_DEFAULT[self.variant]
        if self.stabilizer_coupling not in ("per_factor", "coupled"):
            raise ValueError(f"bad stabilizer_coupling {self.stabilizer_coupling!r}")
        if self.inv_freq < 1:
            raise ValueError(f"inv_freq must be >= 1, got {self.inv_freq}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"rank must be an int >= 1, got {self.rank!r}")
        _ = self.factor_options  # FactorOptions validates the per-factor values

    @property
    def factor_options(self):
        """The per-factor options as a FactorOptions."""
        return FactorOptions(self.stabilizer_timing, self.stabilizer_reset, self.first_update)


def backbone_update(name, p, g, state, **kwargs):
    """Apply the first-order backbone ``name`` (sgd, adamw, lamb, lion) to one tensor (K15)."""
    if name not in ("sgd", "adamw", "lamb", "lion"):
        raise ValueError(f"unknown backbone {name!r}")
    return getattr(first_order, name)(p, g, state, **kwargs)


def is_factor_update_step(steps, inv_freq, warmup_steps):
    """Schedule (K2): factors update iff steps % inv_freq == 0 or steps < warmup_steps."""
    return steps % inv_freq == 0 or steps < warmup_steps


class MKORReference:
    """Whole-model MKOR preconditioning step (K2, K6-K14), float64.

    ``layers`` passed to :meth:`step` is a list with one dict per hooked layer:

    * ``grad_W`` (any shape with d_out first), ``grad_b`` (d_out,) or None;
    * ``a_bar`` (d_in',) and ``g_bar`` (d_out,): required on factor-update steps,
      may be None otherwise; with ``config.rank`` k > 1, (k', d_in') and (k', d_out): the
      k' <= k group means of KC7 (``rank_k``), and the factors take KC8's Woodbury step;
    * ``sgd`` (optional, default False): an sgd_layer, passed through unchanged.

    State (public, for tests): ``L_inv[m]``, ``R_inv[m]`` (start at I), ``steps``,
    ``skipped_updates`` (factor updates skipped for non-finite vectors),
    ``stabiliser_fired`` (times the stabiliser test came out true), and the deferred
    reset flags ``reset_a[m]``, ``reset_g[m]``.
    """

    def __init__(self, config=None, layer_dims=None):
        self.config = MKORConfig() if config is None else config
        self.steps = 0
        self.skipped_updates = 0
        self.stabiliser_fired = 0
        self.L_inv, self.R_inv = [], []
        self.reset_a, self.reset_g = [], []
        self.updates_a, self.updates_g = [], []
        if layer_dims is not None:
            self._init_factors(layer_dims)

    def _init_factors(self, layer_dims):
        for d_out, d_in_prime in layer_dims:
            self.L_inv.append(np.eye(d_out))
            self.R_inv.append(np.eye(d_in_prime))
            self.reset_a.append(False)
            self.reset_g.append(False)
            self.updates_a.append(0)
            self.updates_g.append(0)

    @staticmethod
    def layer_dims(layers):
        """(d_out, d_in') of each layer, from its gradient shapes."""
        dims = []
        for layer in layers:
            grad_W = np.asarray(layer["grad_W"])
            d_in_prime = grad_W[0].size + (layer.get("grad_b") is not None)
            dims.append((grad_W.shape[0], d_in_prime))
        return dims

    def _update_one(self, J, v, first, reset_flag):
        """factor_update with this config (rank_k_factor_update for a rank > 1: ``v`` then
        holds the k' <= rank group means as rows, KC7/KC8), or None when v is non-finite
        (skipped)."""
        if not np.all(np.isfinite(v)):
            self.skipped_updates += 1
            return None
        c = self.config
        if c.rank > 1:
            V = np.asarray(v, dtype=np.float64).reshape(-1, J.shape[0])
            if not 1 <= V.shape[0] <= c.rank:
                raise ValueError(f"rank {c.rank}: expected 1 to {c.rank} group means, "
                                 f"got {V.shape[0]}")
            o = c.factor_options
            return rank_k_factor_update(
                J, V, variant=c.variant, stat_decay=c.stat_decay, zeta=c.zeta,
                threshold=c.threshold, norm=c.stabilizer_norm, first=first,
                reset_flag=reset_flag, stabilizer_timing=o.stabilizer_timing,
                stabilizer_reset=o.stabilizer_reset, first_update=o.first_update)
        return factor_update(J, np.asarray(v, dtype=np.float64), variant=c.variant,
                             stat_decay=c.stat_decay, zeta=c.zeta, threshold=c.threshold,
                             norm=c.stabilizer_norm, options=c.factor_options,
                             first=first, reset_flag=reset_flag)

    def update_factors(self, layers):
        """One factor update (K8-K12): every R^{-1} with a_bar, then every L^{-1} with g_bar."""
        c = self.config
        coupled = c.stabilizer_coupling == "coupled"
        deferred = c.stabilizer_timing == "deferred"
        active = [m for m, layer in enumerate(layers) if not layer.get("sgd", False)]
        for m in active:
            if layers[m].get("a_bar") is None or layers[m].get("g_bar") is None:
                raise ValueError(f"layer {m}: a_bar and g_bar are needed on update steps")
        # Under "before_sm" coupling, both factors are tested before either is touched.
        pre_test = {}
        if coupled and not deferred:
            for m in active:
                pre_test[m] = any(needs_stabilising(J, threshold=c.threshold,
                                                    norm=c.stabilizer_norm)
                                  for J in (self.R_inv[m], self.L_inv[m]))
        fired = {}
        for m in active:  # right factors first, as the code does
            flag = self.reset_a[m] if deferred else pre_test.get(m, False)
            result = self._update_one(self.R_inv[m], layers[m]["a_bar"],
                                      self.updates_a[m] == 0, flag)
            if result is not None:
                self.R_inv[m], fired[m, "a"] = result
                self.updates_a[m] += 1
        for m in active:
            flag = self.reset_g[m] if deferred else pre_test.get(m, False)
            result = self._update_one(self.L_inv[m], layers[m]["g_bar"],
                                      self.updates_g[m] == 0, flag)
            if result is not None:
                self.L_inv[m], fired[m, "g"] = result
                self.updates_g[m] += 1
        for m in active:
            # A skipped factor keeps its pending flag (deferred) or did not fire.
            fired_a = fired.get((m, "a"), self.reset_a[m] if deferred else False)
            fired_g = fired.get((m, "g"), self.reset_g[m] if deferred else False)
            self.stabiliser_fired += int((m, "a") in fired and fired_a)
            self.stabiliser_fired += int((m, "g") in fired and fired_g)
            if deferred:
                either = fired_a or fired_g
                self.reset_a[m] = either if coupled else fired_a
                self.reset_g[m] = either if coupled else fired_g

    def precondition_layers(self, layers):
        """K13 + K14 for every layer with the current factors; sgd layers pass through."""
        out = []
        for m, layer in enumerate(layers):
            grad_W, grad_b = layer["grad_W"], layer.get("grad_b")
            if layer.get("sgd", False):
                out.append((grad_W, grad_b))
                continue
            delta_W, delta_b = precondition(self.L_inv[m], self.R_inv[m], grad_W, grad_b)
            out.append(rescale(delta_W, delta_b, grad_W, grad_b, self.config.rescale))
        return out

    def step(self, layers, backbone_fn=None):
        """One MKOR step: factor update if scheduled (K2), then K13-K14 on every layer.

        Args:
            layers: list of per-layer dicts (see the class docstring).
            backbone_fn: optional callable ``backbone_fn(m, delta_W, delta_b)``, called
                once per layer in order with the preconditioned gradients (e.g. a
                closure over ``backbone_update``); its return value is ignored.

        Returns:
            list of (delta_W, delta_b), one per layer: the gradients to give the backbone.
        """
        if not self.L_inv:
            self._init_factors(self.layer_dims(layers))
        if len(layers) != len(self.L_inv):
            raise ValueError(f"expected {len(self.L_inv)} layers, got {len(layers)}")
        c = self.config
        if is_factor_update_step(self.steps, c.inv_freq, c.warmup_steps):
            self.update_factors(layers)
        out = self.precondition_layers(layers)
        if backbone_fn is not None:
            for m, (delta_W, delta_b) in enumerate(out):
                backbone_fn(m, delta_W, delta_b)
        self.steps += 1
        return out
