"""The ``compiled=True`` path of ``MARSM``: one ``torch.compile``d call per matrix (correction,
clip, momentum, Newton-Schulz and the update) and per backup tensor, built from the equation
functions of ``mars_m_equations`` with the ``COMPILED`` ops table (no second copy of the math).

Everything that changes between steps (lr, bias corrections) enters as a tensor ``hp`` from
the one resolver, the shape scale too (one ``hp`` per distinct scale), so neither a schedule,
the step count nor a new matrix size recompiles once both orientations have been seen.
"""
import torch

from . import mars_compiled
from . import mars_m_equations as M
from ..common.tensor_ops import COMPILED

_MATRIX_FIELDS = ("lr", "wd", "a", "beta1", "gamma", "scale")


def matrix_kernel(p, g, last, buf, hp, clip: bool, write_last: bool, efficient: bool,
                  ns_steps: int, ns_dtype: torch.dtype):
    r"""(M15)-(M18) for one matrix."""
    lr, wd, a, beta, gamma, scale = (hp[i] for i in range(len(_MATRIX_FIELDS)))
    h = M.F.Hyper(lr, wd, a, beta, 0.0, M.MARS_M_NS_EPS)
    if efficient:
        M.efficient_buffer_(buf, g, gamma, beta, COMPILED)
        m = M.efficient_argument(buf, g, gamma, beta, COMPILED)
    else:
        m = M.mars_m_momentum_(buf, g, last, h, clip, COMPILED)
    M.mars_m_step_(p, M.mars_m_direction(m, ns_steps, ns_dtype), h, scale, COMPILED)
    if write_last:
        last.copy_(g)


def backup_kernel(p, g, m, v, hp):
    r"""The AdamW backup (eps before the bias correction) for one tensor."""
    M.backup_adamw_step_(p, g, m, v, mars_compiled._unpack(hp), COMPILED)


def _matrix_hp(h, gamma, scale, device, dtype):
    hp = torch.tensor([h.lr, h.wd, h.a, h.beta1, gamma, scale], dtype=dtype)
    if device.type == "cuda":  # a pageable host-to-device copy would synchronise the stream
        return hp.pin_memory().to(device, non_blocking=True)
    return hp.to(device)


def update(rows, hp, clip, ns_steps, ns_dtype, write_last):
    """Every row (p, g, buf, last, m1, m2, step, kind, scale) of one group, one compiled call
    each.  ``hp``: the group's keywords for the resolver."""
    cache = {}
    for p, g, buf, last, m1, m2, k, kind, scale in rows:
        h = M.resolve_hyperparameters(hp, kind)
        dtype = torch.promote_types(p.dtype, torch.float32)
        if kind == M.BACKUP:
            key = (kind, p.device, dtype, k.item())  # CPU counter: no sync
            if key not in cache:
                M.F.with_bias_corrections(h, key[3], COMPILED)
                cache[key] = mars_compiled.hp_tensor(h, p.device, dtype)
            mars_compiled.compiled(backup_kernel)(*mars_compiled._flat(p, g, m1, m2), cache[key])
            continue
        s = M.match_rms_scale(p.shape) if scale is None else scale
        key = (kind, p.device, dtype, s)
        if key not in cache:
            cache[key] = _matrix_hp(h, hp["gamma"], s, p.device, dtype)
        if p.numel():
            mars_compiled.compiled(matrix_kernel)(
                p, g, last, buf, cache[key], clip, write_last and kind == M.MATRIX,
                kind == M.EFFICIENT, ns_steps, ns_dtype)
