"""MKOR options: the paper / released columns (spec MKOR.md section 4) and validation.

Every option left as None takes the value of ``variant``'s column:

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
spectral norm of the oracle is deliberately not offered here.
"""
from dataclasses import dataclass, fields
import math

import torch

__all__ = ["MKOROptions", "COLUMNS", "FACTOR_DTYPES"]

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
}


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _dtype(name, value):
    if isinstance(value, str):
        value = FACTOR_DTYPES.get(value.replace("torch.", ""), value)
    if value not in FACTOR_DTYPES.values():
        raise ValueError(f"{name} must be one of {sorted(FACTOR_DTYPES)}, got {value!r}")
    return value


@dataclass
class MKOROptions:
    """All MKOR hyperparameters, validated; see :class:`~torch_impl.mkor.MKOR`."""

    inv_freq: int = 10
    stat_decay: float = 0.95
    variant: str = "paper"
    zeta: float = 0.9
    threshold: float = 2.0
    stabilizer_norm: str = "max_entry"
    stabilizer_timing: str = None
    stabilizer_reset: str = None
    stabilizer_coupling: str = None
    first_update: str = None
    rescale: str = None
    factor_dtype: object = None
    average: str = None
    comm_dtype: object = None
    precondition_dtype: object = None
    warmup_steps: int = 0
    grad_accum_steps: int = None
    grad_scale: float = 1.0
    skip_modules: tuple = ()
    grad_hook: str = "tensor"
    hybrid_switch: str = None
    switch_window: int = 50
    switch_check_every: int = 10
    switch_threshold: float = 1e-3
    switch_patience: int = 3
    switch_step: int = None
    max_factor_dim: int = 8192
    token_mask: str = "attention_mask"

    def __post_init__(self):
        if self.variant not in _CHOICES["variant"]:
            raise ValueError(f"variant must be 'paper' or 'released', got {self.variant!r}")
        for key, value in COLUMNS[self.variant].items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        for key, allowed in _CHOICES.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key} must be one of {allowed}, got {getattr(self, key)!r}")
        self.factor_dtype = _dtype("factor_dtype", self.factor_dtype)
        if self.comm_dtype is not None:
            self.comm_dtype = _dtype("comm_dtype", self.comm_dtype)
        if self.precondition_dtype is not None:
            self.precondition_dtype = _dtype("precondition_dtype", self.precondition_dtype)
        if not (_is_int(self.inv_freq) and self.inv_freq >= 1):
            raise ValueError(f"inv_freq must be an int >= 1, got {self.inv_freq!r}")
        if not (_is_real(self.stat_decay) and 0 < self.stat_decay < 1):
            raise ValueError(f"stat_decay must be in (0, 1), got {self.stat_decay!r}")
        if not (_is_real(self.zeta) and 0 <= self.zeta <= 1):
            raise ValueError(f"zeta must be in [0, 1], got {self.zeta!r}")
        if not (_is_real(self.threshold) and self.threshold > 0):
            raise ValueError(f"threshold must be a finite number > 0, got {self.threshold!r}")
        if not (_is_int(self.warmup_steps) and self.warmup_steps >= 0):
            raise ValueError(f"warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if self.grad_accum_steps is not None and not (
                _is_int(self.grad_accum_steps) and self.grad_accum_steps >= 1):
            raise ValueError(
                f"grad_accum_steps must be None or an int >= 1, got {self.grad_accum_steps!r}")
        if not (isinstance(self.grad_scale, torch.Tensor)
                or (_is_real(self.grad_scale) and self.grad_scale > 0)):
            raise ValueError(f"grad_scale must be a finite number > 0, got {self.grad_scale!r}")
        if isinstance(self.skip_modules, str):
            self.skip_modules = (self.skip_modules,)
        self.skip_modules = tuple(self.skip_modules)
        if not all(isinstance(p, str) for p in self.skip_modules):
            raise ValueError("skip_modules must be name patterns (strings)")
        for key in ("switch_window", "switch_check_every", "switch_patience"):
            if not (_is_int(getattr(self, key)) and getattr(self, key) >= 1):
                raise ValueError(f"{key} must be an int >= 1, got {getattr(self, key)!r}")
        if not _is_real(self.switch_threshold):
            raise ValueError(
                f"switch_threshold must be a finite number, got {self.switch_threshold!r}")
        if self.max_factor_dim is not None and not (
                _is_int(self.max_factor_dim) and self.max_factor_dim >= 1):
            raise ValueError(
                f"max_factor_dim must be None or an int >= 1, got {self.max_factor_dim!r}")
        if self.token_mask is not None and not (
                isinstance(self.token_mask, str) and self.token_mask.isidentifier()):
            raise ValueError(
                f"token_mask must be None or a keyword name, got {self.token_mask!r}")
        if self.switch_step is not None and not (
                _is_int(self.switch_step) and self.switch_step >= 0):
            raise ValueError(f"switch_step must be None or an int >= 0, got {self.switch_step!r}")

    @property
    def compute_dtype(self):
        """Arithmetic dtype: float64 for float64 factors, else float32 (low-precision
        factors are stored in 16 bits but updated in float32)."""
        return torch.float64 if self.factor_dtype == torch.float64 else torch.float32

    def as_dict(self):
        return {f.name: getattr(self, f.name) for f in fields(self)}
