"""MKOR options: the paper / released columns (spec MKOR.md section 4), validation, and the
small records each part of MKOR reads.

Every option left as None takes the value of ``variant``'s column (:data:`COLUMNS`, the one
table of the two columns; :func:`~.factors.factor_update` reads it too):

==================== ============== ==================
option               "paper"        "released"
==================== ============== ==================
stabilizer_timing    before_sm      deferred
stabilizer_reset     blend          identity
stabilizer_coupling  per_factor     coupled
first_update         sm             identity
rescale              joint          sum_of_norms
factor_dtype         float32        float16
average              once           double
==================== ============== ==================

``stabilizer_norm`` is "max_entry" (threshold 2) in both columns; the O(d^3)
spectral norm of the oracle is deliberately not offered here. ``factor_rounding`` is
"nearest" in both (issue 47: "stochastic" needs a 16-bit ``factor_dtype``; LP5).

:class:`MKOROptions` validates every keyword of :class:`~.preconditioner.MKOR` under its own
name; each consumer then receives a frozen record of just what it reads, the names unchanged:
:class:`FactorRule` (the factor update, K8-K12), :class:`PreconditionRule` (K13-K14),
:class:`ExchangeOptions` (the vector all-reduce) and :class:`SwitchOptions` (MKOR-H, K18).
"""
from dataclasses import dataclass, fields

import torch

from ..common.rounding import ROUNDING_DTYPES
from ..common.validation import check_choice, check_int, check_number

__all__ = ["MKOROptions", "FactorRule", "PreconditionRule", "ExchangeOptions",
           "SwitchOptions", "COLUMNS", "FACTOR_DTYPES"]

COLUMNS = {
    "paper": dict(stabilizer_timing="before_sm", stabilizer_reset="blend",
                  stabilizer_coupling="per_factor", first_update="sm", rescale="joint",
                  factor_dtype=torch.float32, average="once"),
    "released": dict(stabilizer_timing="deferred", stabilizer_reset="identity",
                     stabilizer_coupling="coupled", first_update="identity",
                     rescale="sum_of_norms", factor_dtype=torch.float16, average="double"),
}

FACTOR_DTYPES = {"float32": torch.float32, "float64": torch.float64,
                 "bfloat16": torch.bfloat16, "float16": torch.float16}

_CHOICES = {
    "variant": ("paper", "released"),
    "stabilizer_norm": ("max_entry",),
    "stabilizer_timing": ("before_sm", "deferred"),
    "stabilizer_reset": ("blend", "identity"),
    "stabilizer_coupling": ("per_factor", "coupled"),
    "first_update": ("sm", "identity"),
    "rescale": ("joint", "sum_of_norms"),
    "average": ("once", "double"),
    "hybrid_switch": (None, "loss_rate"),
    "grad_hook": ("module", "tensor"),
    "factor_placement": ("replicated", "owner"),
    "factor_rounding": ("nearest", "stochastic"),
}


def _dtype(name, value):
    if isinstance(value, str):
        value = FACTOR_DTYPES.get(value.replace("torch.", ""), value)
    if value not in FACTOR_DTYPES.values():
        raise ValueError(f"{name}: expected one of {sorted(FACTOR_DTYPES)}, got {value!r}")
    return value


def _compute_dtype(factor_dtype):
    """Arithmetic dtype: float64 for float64 factors, else float32 (low-precision factors are
    stored in 16 bits but updated in float32)."""
    return torch.float64 if factor_dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class FactorRule:
    """What one factor update reads (K8-K12; :func:`~.layer_state.update_layer_factors`)."""

    variant: str
    stat_decay: float
    zeta: float
    threshold: float
    stabilizer_norm: str
    stabilizer_timing: str
    stabilizer_reset: str
    stabilizer_coupling: str
    first_update: str
    factor_dtype: torch.dtype

    @property
    def compute_dtype(self):
        return _compute_dtype(self.factor_dtype)


@dataclass(frozen=True)
class PreconditionRule:
    """What preconditioning a layer's gradient reads (K13-K14;
    :func:`~.layer_state.precondition_layer`)."""

    rescale: str
    precondition_dtype: object
    compute_dtype: torch.dtype


@dataclass(frozen=True)
class ExchangeOptions:
    """What the vector all-reduce reads (:class:`~.vector_exchange.VectorExchange`)."""

    average: str
    comm_dtype: object
    compute_dtype: torch.dtype


@dataclass(frozen=True)
class SwitchOptions:
    """What MKOR-H reads (K18; :class:`~.hybrid.HybridSwitch`)."""

    hybrid_switch: str
    switch_window: int
    switch_check_every: int
    switch_threshold: float
    switch_patience: int
    switch_step: int


@dataclass(frozen=True)
class MKOROptions:
    """All MKOR hyperparameters, validated, by :class:`~torch_impl.mkor.MKOR`'s names; its
    signature holds their defaults (written nowhere else) and builds this record. Options
    left None take the ``variant``'s column (the table above). The consumers' records
    (:attr:`factor_rule`, :attr:`precondition_rule`, :attr:`exchange`, :attr:`switch`) are
    views of it under the same names."""

    inv_freq: int
    stat_decay: float
    variant: str
    zeta: float
    threshold: float
    stabilizer_norm: str
    stabilizer_timing: str
    stabilizer_reset: str
    stabilizer_coupling: str
    first_update: str
    rescale: str
    factor_dtype: object
    average: str
    comm_dtype: object
    precondition_dtype: object
    warmup_steps: int
    grad_accum_steps: int
    grad_scale: float
    skip_modules: tuple
    grad_hook: str
    hybrid_switch: str
    switch_window: int
    switch_check_every: int
    switch_threshold: float
    switch_patience: int
    switch_step: int
    max_factor_dim: int
    token_mask: str
    factor_placement: str
    rank: int
    factor_rounding: str
    rounding_seed: object

    def __post_init__(self):
        def set_(name, value):  # a frozen record is written here, while it is being made
            object.__setattr__(self, name, value)

        check_choice("variant", self.variant, _CHOICES["variant"])
        for key, value in COLUMNS[self.variant].items():
            if getattr(self, key) is None:
                set_(key, value)
        for key, allowed in _CHOICES.items():
            check_choice(key, getattr(self, key), allowed)
        set_("factor_dtype", _dtype("factor_dtype", self.factor_dtype))
        if self.comm_dtype is not None:
            set_("comm_dtype", _dtype("comm_dtype", self.comm_dtype))
        if self.precondition_dtype is not None:
            set_("precondition_dtype", _dtype("precondition_dtype", self.precondition_dtype))
        check_int("inv_freq", self.inv_freq, low=1)
        check_int("rank", self.rank, low=1)
        check_number("stat_decay", self.stat_decay, 0.0, 1.0, high_open=True, low_open=True)
        check_number("zeta", self.zeta, 0.0, 1.0)
        check_number("threshold", self.threshold, 0.0, low_open=True, finite=True)
        check_int("warmup_steps", self.warmup_steps, low=0)
        if self.grad_accum_steps is not None:
            check_int("grad_accum_steps", self.grad_accum_steps, low=1)
        if not isinstance(self.grad_scale, torch.Tensor):
            check_number("grad_scale", self.grad_scale, 0.0, low_open=True, finite=True)
        skip = (self.skip_modules,) if isinstance(self.skip_modules, str) else self.skip_modules
        set_("skip_modules", tuple(skip))
        if not all(isinstance(p, str) for p in self.skip_modules):
            raise ValueError(f"skip_modules: expected name patterns (strings), "
                             f"got {self.skip_modules!r}")
        for key in ("switch_window", "switch_check_every", "switch_patience"):
            check_int(key, getattr(self, key), low=1)
        check_number("switch_threshold", self.switch_threshold, finite=True)
        if self.max_factor_dim is not None:
            check_int("max_factor_dim", self.max_factor_dim, low=1)
        if self.token_mask is not None and not (
                isinstance(self.token_mask, str) and self.token_mask.isidentifier()):
            raise ValueError(
                f"token_mask: expected None or a keyword name, got {self.token_mask!r}")
        if self.switch_step is not None:
            check_int("switch_step", self.switch_step, low=0)
        if self.factor_rounding == "stochastic" and self.factor_dtype not in ROUNDING_DTYPES:
            raise ValueError(
                "factor_rounding: expected 'nearest' or a 16-bit factor_dtype (bfloat16 or "
                "float16) for 'stochastic', which rounds the stored factors, got 'stochastic' "
                f"with factor_dtype={self.factor_dtype}: nothing to round")
        if self.rounding_seed is not None:
            check_int("rounding_seed", self.rounding_seed, low=0)
            if self.rounding_seed >= 2 ** 63:
                raise ValueError(f"rounding_seed: expected an int in [0, 2**63), got "
                                 f"{self.rounding_seed!r}")

    @property
    def compute_dtype(self):
        """Arithmetic dtype: float64 for float64 factors, else float32 (low-precision
        factors are stored in 16 bits but updated in float32)."""
        return _compute_dtype(self.factor_dtype)

    @property
    def factor_rule(self):
        return FactorRule(**{f.name: getattr(self, f.name) for f in fields(FactorRule)})

    @property
    def precondition_rule(self):
        return PreconditionRule(self.rescale, self.precondition_dtype, self.compute_dtype)

    @property
    def exchange(self):
        return ExchangeOptions(self.average, self.comm_dtype, self.compute_dtype)

    @property
    def switch(self):
        return SwitchOptions(**{f.name: getattr(self, f.name) for f in fields(SwitchOptions)})

    def as_dict(self):
        return {f.name: getattr(self, f.name) for f in fields(self)}
