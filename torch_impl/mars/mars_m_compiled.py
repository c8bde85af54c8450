"""The ``compiled=True`` path of ``MARSM``: one ``torch.compile``d call per group of same-shape
matrices (correction, clip, momentum, one batched Newton-Schulz and the updates) and per backup
tensor, built from the equation functions of ``mars_m_equations`` with the ``COMPILED`` ops
table (no second copy of the math).

Everything that changes between steps (lr, bias corrections) enters as data: the route's
``Hyper`` record from the one resolver packed into one tensor (``Hyper.packed``), the shape
scale too (one record per distinct scale), read by name (``Hyper.unpack``), so neither a
schedule nor the step count recompiles; a new shape or group size compiles once.  A stack of
matrices (``matrix_batch_dims``) enters as its matrices, views of the stack
(``mars_compiled.each_matrix``), grouped with every other matrix of their shape: each is
stepped exactly as a 2-D parameter, and clear of the Inductor CPU bug that a per-matrix norm
fused with a 3-D in-place update meets (torch 2.13).
"""
import torch

from . import mars_compiled
from . import mars_equations
from . import mars_m_equations
from ..common.sharding import BATCH_NUMEL
from ..common.tensor_ops import COMPILED


def matrix_kernel(ps, gs, lasts, bufs, hp, clip: bool, write_last: bool, efficient: bool,
                  ns_steps: int, ns_dtype: torch.dtype, ns_coefficients, orthogonalizer: str):
    r"""(M15)-(M18) for a list of same-shape matrices: each one's momentum, one batched
    Newton-Schulz of them all (each matrix on its own), each one's update."""
    h = mars_equations.Hyper.unpack(hp)
    ms = []
    for g, last, buf in zip(gs, lasts, bufs):
        if efficient:
            mars_m_equations.efficient_buffer_(buf, g, h.gamma, h.beta1, COMPILED)
            m = mars_m_equations.efficient_argument(buf, g, h.gamma, h.beta1, COMPILED)
        else:
            m = mars_m_equations.mars_m_momentum_(buf, g, last, h, clip, COMPILED)
        ms.append(m.to(ns_dtype))
    o = mars_m_equations.mars_m_direction(torch.stack(ms), ns_steps, ns_dtype, ns_coefficients,
                                          orthogonalizer)
    for i, p in enumerate(ps):
        mars_m_equations.mars_m_step_(p, o[i], h, COMPILED)
    if write_last:
        for last, g in zip(lasts, gs):
            last.copy_(g)


def backup_kernel(p, g, m, v, hp):
    r"""The AdamW backup (eps before the bias correction) for one tensor."""
    mars_m_equations.backup_adamw_step_(p, g, m, v, mars_equations.Hyper.unpack(hp), COMPILED)


def update(rows, hypers, clip, ns, write_last, matrix_batch_dims=0):
    """Every row (p, g, buf, last, m1, m2, step, kind, scale) of one group: one compiled call
    per backup tensor and per batch of same-(kind, shape, dtype, device, scale) matrices (a
    stack's matrices among them: ``matrix_batch_dims`` leading dims), batches of at most
    ``BATCH_NUMEL`` elements.  ``hypers``: each kind's ``Hyper``, from the resolver; ``ns``:
    ``mars_m_direction``'s keywords."""
    cache, groups = {}, {}
    for p, g, buf, last, m1, m2, k, kind, scale in rows:
        h = hypers[kind]
        dtype = torch.promote_types(p.dtype, torch.float32)
        if kind == mars_m_equations.BACKUP:
            key = (kind, p.device, dtype, k.item())  # CPU counter: no sync
            if key not in cache:
                h = mars_equations.with_bias_corrections(h, key[3], COMPILED)
                cache[key] = h.packed(p.device, dtype)
            mars_compiled.compiled(backup_kernel)(*mars_compiled._flat(p, g, m1, m2), cache[key])
            continue
        # each matrix's (A, B)
        s = mars_m_equations.match_rms_scale(p.shape[-2:]) if scale is None else scale
        key = (kind, p.device, dtype, s)
        if key not in cache:
            cache[key] = h._replace(scale=s).packed(p.device, dtype)
        if not p.numel():
            continue
        batch = groups.setdefault(key + (tuple(p.shape[-2:]), p.dtype), [[]])
        for row in mars_compiled.each_matrix(matrix_batch_dims, p, g, last, buf):
            if batch[-1] and (len(batch[-1]) + 1) * p.shape[-2:].numel() > BATCH_NUMEL:
                batch.append([])
            batch[-1].append(row)
    for key, batches in groups.items():
        for batch in batches:
            ps, gs, lasts, bufs = (list(column) for column in zip(*batch))
            mars_compiled.compiled(matrix_kernel)(
                ps, gs, lasts, bufs, cache[key[:4]], clip,
                write_last and key[0] == mars_m_equations.MATRIX,
                key[0] == mars_m_equations.EFFICIENT, ns["ns_steps"], ns["ns_dtype"],
                ns["ns_coefficients"], ns["orthogonalizer"])
