"""The rows of the state-memory table: each optimizer and option, how to build it on a model,
and its closed form (``figures.bench.state_closed_form``). A new option is one ``Row`` here.

A row whose option is not a keyword of its optimizer in this tree (``Row.needs``) is listed as
not available, never run. The 8-bit rows put the matrices of at least ``block_size`` elements
in the quantized group and every other tensor in a plain one (LP4 refuses a tensor smaller than
a block; the 1-D tensors, a few per cent of a model, stay as they are, as in bitsandbytes).
"""
import dataclasses
import inspect
from typing import Callable

import torch

from torch_impl import KFAC, LAMB, MARS, MARSM, MKOR
from figures.bench import state_closed_form as cf

__all__ = ["Row", "ROWS", "BLOCK_SIZE", "INV_FREQ"]

BF16 = torch.bfloat16
BLOCK_SIZE = 256
INV_FREQ = 10  # MKOR's and K-FAC's default: a timed round holds one factor update


@dataclasses.dataclass(frozen=True)
class Row:
    """``build(model, ns_dtype) -> optimizer``; ``closed_form(model) -> {key: bytes}``;
    ``needs``: (class, keyword) pairs the row's option requires; ``kronecker``: steps need a
    fresh forward and backward (MKOR and K-FAC capture statistics there); ``hybrid``: feed
    each loss to MKOR-H; ``closure``: the step takes a closure (MARS exact mode: its step runs
    two forward-backward passes, so it is not timed against a step on a fixed gradient);
    ``param_dtype``: the model's dtype."""
    name: str
    build: Callable
    closed_form: Callable
    needs: tuple = ()
    kronecker: bool = False
    hybrid: bool = False
    closure: bool = False
    param_dtype: torch.dtype = torch.float32

    def missing(self):
        """The keywords this tree's optimizers do not take yet, as 'Class(keyword)'."""
        return [f"{cls.__name__}({kw})" for cls, kw in self.needs
                if kw not in inspect.signature(cls).parameters]


def _split(model, block_size=BLOCK_SIZE):
    """(quantized, plain): matrices of at least ``block_size`` elements, and the rest."""
    params = list(model.parameters())
    big = [p for p in params if p.ndim >= 2 and p.numel() >= block_size]
    return big, [p for p in params if not any(p is q for q in big)]


def _quantized_groups(model, **plain):
    big, small = _split(model)
    return [{"params": big, "state_quantization": "blockwise8", "block_size": BLOCK_SIZE,
             **plain}, {"params": small, **plain}]


def _quantized_cf(model, **plain):
    big, small = _split(model)
    return [(big, {"quantized": True, "block_size": BLOCK_SIZE, **plain}), (small, plain)]


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=True)


def _mars(mars_type, **kw):
    return lambda model, ns: MARS(model.parameters(), lr=1e-3, mars_type=mars_type,
                                  ns_dtype=ns, **kw)


def _mars_groups(mars_type, groups, **kw):
    return lambda model, ns: MARS(groups(model), lr=1e-3, mars_type=mars_type, ns_dtype=ns,
                                  **kw)


def _mars_m(**kw):
    return lambda model, ns: MARSM(model.parameters(), lr=1e-3, ns_dtype=ns, **kw)


def _mkor(**kw):
    return lambda model, ns: MKOR(model, _adamw(model.parameters()), inv_freq=INV_FREQ, **kw)


def _kfac(**kw):
    return lambda model, ns: KFAC(model, _adamw(model.parameters()), inv_freq=INV_FREQ, **kw)


def _params(model):
    return list(model.parameters())


def _with(**options):
    return lambda model: [(_params(model), options)]


SR = dict(state_dtype=BF16, state_rounding="stochastic")
ROWS = [
    Row("AdamW (torch, foreach)", lambda m, ns: _adamw(m.parameters()),
        lambda m: cf.adamw(_params(m))),
    Row("MARS-AdamW", _mars("mars-adamw"), lambda m: cf.mars(_params(m))),
    Row("MARS-AdamW exact (is_approx=False)", _mars("mars-adamw", is_approx=False),
        lambda m: cf.mars(_params(m), exact=True), closure=True),
    Row("MARS-Lion", _mars("mars-lion"), lambda m: cf.mars(_params(m), "mars-lion")),
    Row("MARS-Shampoo", _mars("mars-shampoo"), lambda m: cf.mars(_params(m), "mars-shampoo")),
    Row("MARS-M", _mars_m(), lambda m: cf.mars_m(_params(m))),
    Row("MARS-M efficient", _mars_m(efficient=True),
        lambda m: cf.mars_m(_params(m), efficient=True)),
    Row("LAMB", lambda m, ns: LAMB(m.parameters(), lr=1e-3), lambda m: cf.lamb(_params(m))),
    Row("MKOR (AdamW backbone)", _mkor(),
        lambda m: cf.mkor(m, cf.adamw(_params(m))), kronecker=True),
    Row("MKOR-H (loss_rate switch)", _mkor(hybrid_switch="loss_rate"),
        lambda m: cf.mkor(m, cf.adamw(_params(m))), kronecker=True, hybrid=True),
    Row("MKOR rank=4", _mkor(rank=4), lambda m: cf.mkor(m, cf.adamw(_params(m))),
        needs=((MKOR, "rank"),), kronecker=True),
    Row("K-FAC (eigen, AdamW backbone)", _kfac(), lambda m: cf.kfac(m, cf.adamw(_params(m))),
        kronecker=True),
    # ---- low precision (issue 47)
    Row("MARS-AdamW state_dtype=bf16", _mars("mars-adamw", state_dtype=BF16),
        lambda m: cf.mars(_with(state_dtype=BF16)(m))),
    Row("MARS-AdamW bf16, stochastic rounding", _mars("mars-adamw", **SR),
        lambda m: cf.mars(_with(state_dtype=BF16)(m)), needs=((MARS, "state_rounding"),)),
    Row("MARS-Lion state_dtype=bf16", _mars("mars-lion", state_dtype=BF16),
        lambda m: cf.mars(_with(state_dtype=BF16)(m), "mars-lion")),
    Row("MARS-M state_dtype=bf16", _mars_m(state_dtype=BF16),
        lambda m: cf.mars_m(_with(state_dtype=BF16)(m)), needs=((MARSM, "state_dtype"),)),
    Row("MARS-M bf16, stochastic rounding", _mars_m(**SR),
        lambda m: cf.mars_m(_with(state_dtype=BF16)(m)),
        needs=((MARSM, "state_dtype"), (MARSM, "state_rounding"))),
    Row("LAMB state_dtype=bf16", lambda m, ns: LAMB(m.parameters(), lr=1e-3, state_dtype=BF16),
        lambda m: cf.lamb(_with(state_dtype=BF16)(m)), needs=((LAMB, "state_dtype"),)),
    Row("LAMB bf16, stochastic rounding",
        lambda m, ns: LAMB(m.parameters(), lr=1e-3, **SR),
        lambda m: cf.lamb(_with(state_dtype=BF16)(m)),
        needs=((LAMB, "state_dtype"), (LAMB, "state_rounding"))),
    Row("MARS-AdamW, bf16 parameters", _mars("mars-adamw"), lambda m: cf.mars(_params(m)),
        param_dtype=BF16),
    Row("MARS-AdamW, bf16 parameters, kahan_sum", _mars("mars-adamw", kahan_sum=True),
        lambda m: cf.mars(_with(kahan_sum=True)(m)), needs=((MARS, "kahan_sum"),),
        param_dtype=BF16),
    Row("MARS-AdamW blockwise8", _mars_groups("mars-adamw", _quantized_groups),
        lambda m: cf.mars(_quantized_cf(m)), needs=((MARS, "state_quantization"),)),
    Row("MARS-Lion blockwise8", _mars_groups("mars-lion", _quantized_groups),
        lambda m: cf.mars(_quantized_cf(m), "mars-lion"), needs=((MARS, "state_quantization"),)),
    Row("MARS-M blockwise8",
        lambda m, ns: MARSM(_quantized_groups(m), lr=1e-3, ns_dtype=ns),
        lambda m: cf.mars_m(_quantized_cf(m)), needs=((MARSM, "state_quantization"),)),
    Row("MKOR factor_dtype=bf16", _mkor(factor_dtype=BF16),
        lambda m: cf.mkor(m, cf.adamw(_params(m)), BF16), kronecker=True),
    Row("MKOR factor_dtype=bf16, stochastic rounding",
        _mkor(factor_dtype=BF16, factor_rounding="stochastic"),
        lambda m: cf.mkor(m, cf.adamw(_params(m)), BF16), needs=((MKOR, "factor_rounding"),),
        kronecker=True),
    Row("K-FAC factor_dtype=bf16", _kfac(factor_dtype=BF16),
        lambda m: cf.kfac(m, cf.adamw(_params(m)), factor_dtype=BF16),
        needs=((KFAC, "factor_dtype"),), kronecker=True),
]
