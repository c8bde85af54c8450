r"""Bytes of optimizer state, in closed form (LP6): what each optimizer and option keeps.

Each function returns ``{state key: bytes}`` summed over the parameters (or layers), the keys
named as in the optimizer's ``state_dict()`` (``figures.bench.state_memory.measured_bytes``
reads them from there, and ``theory_tests/figures/test_state_memory.py`` asserts the two are
equal on every row). Counted: every tensor of at least one dimension. Not counted: 0-d tensors
(step counters, MKOR's and K-FAC's per-layer counters and flags), Python numbers (MKOR-H's
window of 2W losses) and the param groups. With n the numel of a parameter and s(dtype) its
item size (4 float32, 2 bf16):

* AdamW, LAMB: m, v: 2 n s.
* MARS (approx, ``optimize_1d=False``): a matrix keeps m and the last gradient, plus v under
  MARS-AdamW (3 n s; MARS-Lion and MARS-Shampoo 2 n s); a 1-D tensor takes the AdamW fallback
  (m, v). Exact mode adds ``prev_param`` (x_{t-1}, the parameter's dtype) on every tensor.
* MARS-M: a matrix keeps the momentum and the last gradient (the efficient variant: the
  momentum alone); a 1-D tensor the fallback's two moments.
* ``state_dtype``: s is its item size for every buffer but ``prev_param``.
* ``kahan_sum`` on a 16-bit parameter: + n s(parameter) (``kahan_comp``).
* ``state_quantization="blockwise8"`` (LP4): a quantized moment is n bytes of codes plus
  4 ceil(n / B) bytes of block scales, ~1 + 4/B bytes per value.
* MKOR: per preconditioned ``nn.Linear`` of width (d_out, d_in) the inverse factors
  L^-1 (d_out^2) and R^-1 ((d_in + bias)^2) in the factor dtype, plus its backbone's state.
  MKOR-H and rank k keep the same tensors.
* K-FAC: per layer A ((d_in + bias)^2) and G (d_out^2) in the factor dtype and their
  decompositions in float32: "eigen" the eigenvalues and eigenvectors (d + d^2 per side),
  "inverse" the inverses (d^2 per side); plus its backbone's state.
"""
import math
from collections import Counter

import torch
from torch import nn

__all__ = ["item_size", "linear_shapes", "adamw", "lamb", "mars", "mars_m", "mkor", "kfac",
           "QUANTIZED_MOMENTS"]

# the moments LP4 quantizes (conventions of issue 47); the last gradient stays in state_dtype
QUANTIZED_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")
# modules that hold parameters and that MKOR / K-FAC leave to the backbone in these models
_BACKBONE_ONLY = (nn.Embedding, nn.LayerNorm)


def item_size(dtype):
    return torch.empty((), dtype=dtype).element_size()


def _buffer(counts, key, p, dtype, quantized, block_size):
    """Add one parameter-shaped buffer of ``p``: plain in ``dtype``, or LP4's codes and
    scales when ``quantized``."""
    n = p.numel()
    if quantized and key in QUANTIZED_MOMENTS:
        counts[key + "_codes"] += n
        counts[key + "_absmax"] += 4 * math.ceil(n / block_size)
    else:
        counts[key] += n * item_size(dtype)


def _per_parameter(groups, keys_of):
    """``groups``: [(params, options)], options with ``state_dtype``, ``kahan_sum``,
    ``quantized``, ``block_size``; ``keys_of(p)``: the buffer names of ``p``."""
    counts = Counter()
    for params, options in groups:
        dtype = options.get("state_dtype")
        for p in params:
            for key in keys_of(p):
                _buffer(counts, key, p, dtype or p.dtype, options.get("quantized", False),
                        options.get("block_size", 256))
            if options.get("kahan_sum") and item_size(p.dtype) == 2:
                counts["kahan_comp"] += p.numel() * item_size(p.dtype)
    return dict(counts)


def _groups(params_or_groups):
    """Either a list of tensors (one group, no options) or [(params, options)]."""
    items = list(params_or_groups)
    if items and isinstance(items[0], torch.Tensor):
        return [(items, {})]
    return items


def adamw(params):
    """torch.optim.AdamW (amsgrad off): exp_avg, exp_avg_sq."""
    return _per_parameter(_groups(params), lambda p: ("exp_avg", "exp_avg_sq"))


def lamb(params):
    """LAMB: exp_avg, exp_avg_sq (``state_dtype``, ``kahan_sum`` per group)."""
    return _per_parameter(_groups(params), lambda p: ("exp_avg", "exp_avg_sq"))


def mars(params, mars_type="mars-adamw", exact=False):
    """MARS with ``optimize_1d=False`` (the 1-D tensors take the AdamW fallback)."""
    if mars_type not in ("mars-adamw", "mars-lion", "mars-shampoo"):
        raise ValueError(f"mars_type: {mars_type!r} has no closed form here")
    counts = Counter()
    for params_, options in _groups(params):
        def keys(p):
            if p.ndim < 2:
                return ("exp_avg", "exp_avg_sq")
            return (("exp_avg", "exp_avg_sq", "last_grad") if mars_type == "mars-adamw"
                    else ("exp_avg", "last_grad"))
        counts.update(_per_parameter([(params_, options)], keys))
        if exact:  # x_{t-1} in the parameter's own dtype, whatever state_dtype says
            counts["prev_param"] += sum(p.numel() * item_size(p.dtype) for p in params_)
    return dict(counts)


def mars_m(params, efficient=False):
    """MARS-M: matrices momentum_buffer (+ last_grad unless efficient); 1-D moment1, moment2."""
    def keys(p):
        if p.ndim < 2:
            return ("moment1", "moment2")
        return ("momentum_buffer",) if efficient else ("momentum_buffer", "last_grad")
    return _per_parameter(_groups(params), keys)


def linear_shapes(model):
    """[(d_out, d_in + bias)] of every ``nn.Linear``: the layers MKOR and K-FAC precondition
    in these models. A module of another type holding parameters, other than those left to
    the backbone (embeddings, LayerNorms), has no closed form here: ValueError naming it."""
    shapes = []
    for name, module in model.named_modules():
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        if isinstance(module, nn.Linear):
            shapes.append((module.out_features, module.in_features + (module.bias is not None)))
        elif not isinstance(module, _BACKBONE_ONLY):
            raise ValueError(f"linear_shapes: module {name!r} ({type(module).__name__}) holds "
                             "parameters and is neither an nn.Linear nor left to the backbone")
    return shapes


def _prefixed(prefix, counts):
    return {f"{prefix}.{k}": v for k, v in counts.items()}


def mkor(model, backbone, factor_dtype=torch.float32):
    """MKOR (and MKOR-H, rank k): L^-1, R^-1 per Linear in ``factor_dtype``, plus
    ``backbone`` (the backbone optimizer's closed form)."""
    size = item_size(factor_dtype)
    shapes = linear_shapes(model)
    own = {"L_inv": sum(d_out ** 2 for d_out, _ in shapes) * size,
           "R_inv": sum(d_in ** 2 for _, d_in in shapes) * size}
    return {**backbone, **_prefixed("mkor", own)}


def kfac(model, backbone, method="eigen", factor_dtype=torch.float32):
    """K-FAC: A, G per Linear in ``factor_dtype``; decompositions in float32."""
    if method not in ("eigen", "inverse"):
        raise ValueError(f"method: {method!r} has no closed form here")
    size, f32 = item_size(factor_dtype), item_size(torch.float32)
    shapes = linear_shapes(model)
    a_side = [d_in for _, d_in in shapes]
    g_side = [d_out for d_out, _ in shapes]
    own = {"A": sum(d * d for d in a_side) * size, "G": sum(d * d for d in g_side) * size}
    for side, dims in (("A", a_side), ("G", g_side)):
        if method == "eigen":  # (eigenvalues, eigenvectors)
            own[f"eig_{side}[0]"] = sum(dims) * f32
            own[f"eig_{side}[1]"] = sum(d * d for d in dims) * f32
        else:
            own[f"inv_{side}"] = sum(d * d for d in dims) * f32
    return {**backbone, **_prefixed("kfac", own)}
