"""The ``compiled=True`` path of ``MARSM``: one ``torch.compile``d call per matrix (correction,
clip, momentum, Newton-Schulz and the update) and per backup tensor, built from the equation
functions of ``mars_m_equations`` with the ``COMPILED`` ops table (no second copy of the math).

Everything that changes between steps (lr, bias corrections) enters as data: the route's
``Hyper`` record from the one resolver packed into one tensor (``Hyper.packed``), the shape
scale too (one record per distinct scale), read by name (``Hyper.unpack``), so neither a schedule, the step count nor
a new matrix size recompiles once both orientations have been seen.  A stack of matrices
(``matrix_batch_dims``) is stepped matrix by matrix, one call per matrix on views of the
stack (``mars_compiled.each_matrix``): each exactly as a 2-D parameter, and clear of the
Inductor CPU bug that a per-matrix norm fused with a 3-D in-place update meets (torch 2.13).
"""
import torch

from . import mars_compiled
from . import mars_m_equations as M
from ..common.tensor_ops import COMPILED

def matrix_kernel(p, g, last, buf, hp, clip: bool, write_last: bool, efficient: bool,
                  ns_steps: int, ns_dtype: torch.dtype):
    r"""(M15)-(M18) for one matrix."""
    h = M.F.Hyper.unpack(hp)
    if efficient:
        M.efficient_buffer_(buf, g, h.gamma, h.beta1, COMPILED)
        m = M.efficient_argument(buf, g, h.gamma, h.beta1, COMPILED)
    else:
        m = M.mars_m_momentum_(buf, g, last, h, clip, COMPILED)
    M.mars_m_step_(p, M.mars_m_direction(m, ns_steps, ns_dtype), h, COMPILED)
    if write_last:
        last.copy_(g)


def backup_kernel(p, g, m, v, hp):
    r"""The AdamW backup (eps before the bias correction) for one tensor."""
    M.backup_adamw_step_(p, g, m, v, M.F.Hyper.unpack(hp), COMPILED)


def update(rows, hypers, clip, ns_steps, ns_dtype, write_last, matrix_batch_dims=0):
    """Every row (p, g, buf, last, m1, m2, step, kind, scale) of one group, one compiled call
    each (per matrix of a stack: ``matrix_batch_dims`` leading dims).  ``hypers``: each
    kind's ``Hyper``, from the resolver."""
    cache = {}
    for p, g, buf, last, m1, m2, k, kind, scale in rows:
        h = hypers[kind]
        dtype = torch.promote_types(p.dtype, torch.float32)
        if kind == M.BACKUP:
            key = (kind, p.device, dtype, k.item())  # CPU counter: no sync
            if key not in cache:
                h = M.F.with_bias_corrections(h, key[3], COMPILED)
                cache[key] = h.packed(p.device, dtype)
            mars_compiled.compiled(backup_kernel)(*mars_compiled._flat(p, g, m1, m2), cache[key])
            continue
        s = M.match_rms_scale(p.shape[-2:]) if scale is None else scale  # each matrix's
        key = (kind, p.device, dtype, s)
        if key not in cache:
            cache[key] = h._replace(scale=s).packed(p.device, dtype)
        if not p.numel():
            continue
        for p, g, last, buf in mars_compiled.each_matrix(matrix_batch_dims, p, g, last, buf):
            mars_compiled.compiled(matrix_kernel)(
                p, g, last, buf, cache[key], clip, write_last and kind == M.MATRIX,
                kind == M.EFFICIENT, ns_steps, ns_dtype)
