"""The ``compiled=True`` path of ``MARS``: each tensor's elementwise step under ``torch.compile``,
so that Inductor fuses it into one pass over p, g, g_prev, m, v (plus one reduction pass for the
per-tensor clip norm) instead of ~12 eager kernels.

The kernels are not a copy of the math: they call the equation functions of
``mars_equations`` with the ``COMPILED`` ops table.  Everything that changes between steps --
lr, the bias corrections, the global clip divisor -- enters as data: the route's ``Hyper``
record (from the one resolver, ``resolve_hyperparameters``) packed into one tensor
(``Hyper.packed``) and read by name in the kernels (``Hyper.unpack``), so neither a schedule nor the step count
recompiles, and shapes are dynamic so one compilation serves every tensor of a rank.
MARS-Shampoo's matrices keep the eager path: Newton-Schulz is matmul-bound.  A stack of
matrices (``matrix_batch_dims``) on the AdamW or Lion route enters as its matrices, one row
each (``each_matrix``), so that its per-tensor clip is each matrix's, as for 2-D parameters;
(a per-matrix norm fused with the in-place update of a 3-D tensor trips Inductor's CPU
outer-loop fusion in torch 2.13: KeyError in ``try_outer_loop_fusion_with_local_buf``).
"""
import itertools

import torch

from . import mars_equations
from ..common.tensor_ops import COMPILED

def _corrected(g, last, h, tensor_clip):
    c = mars_equations.corrected_gradient_(last, g, h.gamma, h.beta1, COMPILED)
    if tensor_clip:
        return mars_equations.clip_tensor_(c, COMPILED.norm(c), COMPILED)
    return c.div_(h.clip_divisor)  # 1 without a global clip


def adamw_kernel(p, g, last, m, v, vmax, hp, tensor_clip: bool, write_last: bool):
    r"""(M1)-(M9) for one tensor."""
    h = mars_equations.Hyper.unpack(hp)
    c = _corrected(g, last, h, tensor_clip)
    mars_equations.adamw_rule_(p, c, m, v, vmax, h, COMPILED)
    if write_last:
        last.copy_(g)


def lion_kernel(p, g, last, m, hp, tensor_clip: bool, write_last: bool):
    r"""(M1)-(M4), (M10) for one tensor."""
    h = mars_equations.Hyper.unpack(hp)
    c = _corrected(g, last, h, tensor_clip)
    mars_equations.lion_rule_(p, c, m, h, COMPILED)
    if write_last:
        last.copy_(g)


def fallback_kernel(p, g, m, v, hp):
    r"""(M14): AdamW on the raw gradient (``hp`` carries lr r, betas_1d, the 1-D weight decay)."""
    mars_equations.adamw_rule_(p, g, m, v, None, mars_equations.Hyper.unpack(hp), COMPILED)


_compiled = {}


def compiled(fn):
    """``torch.compile(fn, dynamic=True, fullgraph=True)``, created once per function."""
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=True, fullgraph=True)
    return _compiled[fn]


def _flat(*tensors):
    """1-D views with a dynamic length, so one compilation serves every contiguous tensor
    (dynamo otherwise specialises on each rank and size); non-contiguous tensors pass as they
    are (and cost a compilation per layout)."""
    if not all(t is None or t.is_contiguous() for t in tensors):
        return tensors
    flat = []
    for t in tensors:
        if t is not None:
            t = t.view(-1)
            torch._dynamo.maybe_mark_dynamic(t, 0)
        flat.append(t)
    return flat


def each_matrix(matrix_batch_dims, *tensors):
    """Rows of same-shape tensors: for a stack under ``matrix_batch_dims``
    (``mars_equations.matrix_batch_dims_of``) one row per matrix, of views (integer indexing:
    never a copy, so in-place updates land in the stack), else the tensors themselves;
    ``None`` stays ``None``."""
    shape = next(t.shape for t in tensors if t is not None)
    if not mars_equations.matrix_batch_dims_of(shape, matrix_batch_dims):
        return [tensors]
    return [tuple(None if t is None else t[i] for t in tensors)
            for i in itertools.product(*map(range, shape[:matrix_batch_dims]))]


def _over_lists(kernel):
    """``kernel`` applied to every row of column lists, as one function (compiled once per
    group in ``compiled="group"`` mode: one call and one guard check for the whole group)."""
    def run(columns, h, *flags):
        return [kernel(*row, h, *flags) for row in zip(*columns)]
    run.__name__ = f"{kernel.__name__}_over_lists"
    return run


_listed = {}


def _run(calls, grouped):
    """Execute ``(kernel, tensors, h, flags)`` calls one by one (``compiled="tensor"``) or
    batched by (kernel, h, flags) into one compiled call each (``compiled="group"``)."""
    if not grouped:
        return [compiled(kernel)(*tensors, h, *flags) for kernel, tensors, h, flags in calls]
    batches = {}
    for kernel, tensors, h, flags in calls:
        batches.setdefault((kernel, id(h), flags), (h, []))[1].append(tensors)
    out = []
    for (kernel, _, flags), (h, rows) in batches.items():
        if kernel not in _listed:
            _listed[kernel] = torch.compile(_over_lists(kernel), dynamic=True, fullgraph=True)
        out += _listed[kernel]([list(col) for col in zip(*rows)], h, *flags)
    return out


def update(buffers, steps, kinds, hypers, scope, total, write_last, grouped,
           matrix_batch_dims=0):
    """The whole step of every (non-Shampoo) tensor: one compiled kernel call per tensor (per
    matrix of a stack under ``matrix_batch_dims``), or per batch of same-route tensors with
    ``grouped``.  ``hypers``: each route's ``Hyper``; ``total``: the global norm (or None)."""
    divisor = torch.clamp(total, min=1.0) if scope == "global" else None
    flags = (scope == "tensor", write_last)
    cache, calls = {}, []
    for (p, g, m, v, vmax, last), k, kind in zip(zip(*buffers), steps, kinds):
        key = (p.device, p.dtype, k.item(), kind)  # CPU counter: no sync
        if key not in cache:
            h = mars_equations.with_bias_corrections(hypers[kind], key[2], COMPILED)
            dtype = torch.promote_types(p.dtype, torch.float32)
            if divisor is not None and kind != mars_equations.FALLBACK:  # already on the device
                cache[key] = h.packed(p.device, dtype, clip_divisor=divisor)
            else:
                cache[key] = h.packed(p.device, dtype)
        hp = cache[key]
        if kind == mars_equations.FALLBACK:
            calls.append((fallback_kernel, _flat(p, g, m, v), hp, ()))
            continue
        for row in each_matrix(matrix_batch_dims, p, g, m, v, vmax, last):  # (p, g, m, v, vmax, last)
            if kind == mars_equations.LION:
                calls.append((lion_kernel, _flat(row[0], row[1], row[5], row[2]), hp, flags))
            else:
                calls.append((adamw_kernel, _flat(*row[:2], row[5], *row[2:5]), hp, flags))
    _run(calls, grouped)
