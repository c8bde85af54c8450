"""MARS-M update math in PyTorch, one function per equation (mirrors ``reference/mars_m.py``),
and the functional entry point ``mars_m``.

The elementwise equations run under ``SINGLE`` (one tensor) or ``FOREACH`` (lists) ops, as in
``mars_functional``; Newton-Schulz is a matrix function, called once per matrix.  The MARS
equations themselves (M2 correction, M3 clip, M4 momentum) are ``mars_functional``'s.
"""
import torch

from . import mars_functional as F
from .matrix_functions import newton_schulz
from .tensor_ops import FOREACH, SINGLE

MATRIX, EFFICIENT, BACKUP = "mars_m", "mars_m_efficient", "adamw"
MARS_M_NS_EPS = 1e-7  # the authors' Newton-Schulz eps (not the AdamW eps)


# ------------------------------------------------------------------ hyperparameters

def resolve_hyperparameters(hp, kind):
    """The one MARS-M resolver: group dict (or functional keywords) -> the route's ``Hyper``.
    Matrices: beta1 = ``momentum``, a = gamma beta/(1 - beta); the backup: ``adamw_betas``,
    ``adamw_eps``.  Both decay by the group's ``weight_decay`` (the authors' ``wd``)."""
    lr = F._number(hp["lr"])
    if kind == BACKUP:
        b1, b2 = hp["adamw_betas"]
        return F.Hyper(lr, hp["weight_decay"], 0.0, b1, b2, hp["adamw_eps"])
    beta = hp["momentum"]
    return F.Hyper(lr, hp["weight_decay"], F.correction_coefficient(hp["gamma"], beta), beta,
                   0.0, MARS_M_NS_EPS)


# ------------------------------------------------------------------ equations (2.6)

def match_rms_scale(shape):
    r"""(M17) 0.2 sqrt(max(A, B)): the update's RMS then matches AdamW's (Moonlight)."""
    return 0.2 * max(shape[0], shape[1]) ** 0.5


def mars_m_momentum_(m, g, last, h, clip, ops=SINGLE):
    r"""(M15)  C_t = g + a (g - g_prev) in ``last``'s buffer, clipped to norm 1 if ``clip``,
    then M <- beta M + (1 - beta) C~_t.  Returns M."""
    c = F.corrected_gradient_(last, g, h.a, ops)
    if clip:
        F.clip_tensor_(c, ops.norm(c), ops)
    return F.momentum_(m, c, h.beta1, ops)


def mars_m_direction(m, ns_steps, ns_dtype):
    r"""(M16)  O = NS5(M) as the authors compute it: cast to ``ns_dtype``, transpose if tall,
    normalise by ||X||_F + 1e-7, five quintic steps; O stays in ``ns_dtype``."""
    return newton_schulz(m, steps=ns_steps, eps=MARS_M_NS_EPS, dtype=ns_dtype, cast_first=True)


def mars_m_step_(p, o, h, scale, ops=SINGLE):
    r"""(M17)  p <- p (1 - lr lambda) - lr scale O."""
    ops.decay_(p, h.lr, h.wd)
    ops.add_scaled_(p, o, -h.lr * scale)


def efficient_buffer_(buf, g, gamma, beta, ops=SINGLE):
    r"""(M18)  buf <- beta buf + ((1 - gamma)(1 - beta) / beta) g."""
    ops.mul_(buf, beta)
    return ops.add_scaled_(buf, g, (1.0 - gamma) * (1.0 - beta) / beta)


def efficient_argument(buf, g, gamma, beta, ops=SINGLE):
    r"""(M18)  gamma g + beta buf (a new tensor): the unclipped MARS-M momentum (MT12)."""
    return ops.add_scaled_(buf * beta, g, gamma)


def backup_adamw_step_(p, g, m, v, h, ops=SINGLE):
    r"""The AdamW backup, eps *before* the bias correction (the authors' placement):
    m <- lerp(m, g, 1-b1), v <- b2 v + (1-b2) g^2, p <- p (1 - lr wd) - lr sqrt(bc2)/bc1 m/(eps + sqrt(v))."""
    F.momentum_(m, g, h.beta1, ops)
    F.second_moment_(v, g, h.beta2, ops)
    denom = ops.sqrt(v)
    ops.add_(denom, h.eps)
    ops.decay_(p, h.lr, h.wd)
    if isinstance(h.bc1, list):  # FOREACH: one step size per tensor
        step = [-h.lr * s / b for b, s in zip(h.bc1, h.sqrt_bc2)]
    else:
        step = -h.lr * h.sqrt_bc2 / h.bc1
    ops.addcdiv_(p, m, denom, step)


# ------------------------------------------------------------------ the functional

def mars_m(params, grads, momentum_buffers, last_grads, exp_avgs, exp_avg_sqs, state_steps,
           kinds, *, lr, weight_decay, momentum, gamma, ns_steps=5, ns_dtype=torch.bfloat16,
           clip_c=True, adamw_betas=(0.9, 0.95), adamw_eps=1e-8, shape_scales=None,
           maximize=False, foreach=None, compiled=False, write_last_grad=True):
    r"""One MARS-M step (M15-M18 and the AdamW backup) over parallel lists.

    ``kinds[i]``: "mars_m", "mars_m_efficient" or "adamw".  Buffers that a kind does not keep
    are ``None``.  ``shape_scales[i]`` overrides 0.2 sqrt(max(A, B)) (``None``: p's shape).
    ``state_steps`` (CPU tensors) are incremented here.  ``compiled``: one
    ``torch.compile``d call per tensor (``mars_m_compiled``), the same equations.
    """
    if not params:
        return
    hp = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, gamma=gamma,
              adamw_betas=adamw_betas, adamw_eps=adamw_eps)
    torch._foreach_add_(state_steps, 1.0)
    if maximize:
        grads = torch._foreach_neg(grads)
    if shape_scales is None:
        shape_scales = [None] * len(params)
    if torch.compiler.is_compiling():  # torch.compile(opt.step): the traced loop is fused
        compiled, foreach = False, False
    if foreach is None:
        foreach = bool(params) and all(p.is_cuda for p in params)
    columns = list(zip(params, grads, momentum_buffers, last_grads, exp_avgs, exp_avg_sqs,
                       state_steps, kinds, shape_scales))
    if compiled:
        from . import mars_m_compiled  # it imports this module
        mars_m_compiled.update(columns, hp, clip_c, ns_steps, ns_dtype, write_last_grad)
        return
    for kind in (MATRIX, EFFICIENT, BACKUP):
        rows = [r for r in columns if r[7] == kind]
        if not rows:
            continue
        h = resolve_hyperparameters(hp, kind)
        if kind == BACKUP:
            _backup(rows, h, foreach)
        else:
            _matrices(rows, h, kind, gamma, clip_c, ns_steps, ns_dtype, foreach, write_last_grad)


def _matrices(rows, h, kind, gamma, clip, ns_steps, ns_dtype, foreach, write_last):
    ps, gs, bufs, lasts = ([r[i] for r in rows] for i in range(4))
    if kind == EFFICIENT:
        if foreach:
            efficient_buffer_(bufs, gs, gamma, h.beta1, FOREACH)
        else:
            for b, g in zip(bufs, gs):
                efficient_buffer_(b, g, gamma, h.beta1, SINGLE)
        args = [efficient_argument(b, g, gamma, h.beta1) for b, g in zip(bufs, gs)]
    elif foreach:
        args = mars_m_momentum_(bufs, gs, lasts, h, clip, FOREACH)
    else:
        args = [mars_m_momentum_(b, g, last, h, clip, SINGLE) for b, g, last in zip(bufs, gs, lasts)]
    for p, m, r in zip(ps, args, rows):  # Newton-Schulz: one matrix function per matrix
        scale = match_rms_scale(p.shape) if r[8] is None else r[8]
        if p.numel():
            mars_m_step_(p, mars_m_direction(m, ns_steps, ns_dtype), h, scale)
    if write_last and kind == MATRIX:  # the raw g_t, copied (never an alias of p.grad)
        if foreach:
            FOREACH.copy_(lasts, gs)
        else:
            for last, g in zip(lasts, gs):
                last.copy_(g)


def _backup(rows, h, foreach):
    if foreach:
        ks = [r[6].item() for r in rows]  # CPU counters: no sync
        F.with_bias_corrections(h, ks, FOREACH)
        backup_adamw_step_(*([r[i] for r in rows] for i in (0, 1, 4, 5)), h, FOREACH)
        return
    for p, g, _, _, m, v, k, _, _ in rows:
        backup_adamw_step_(p, g, m, v, F.with_bias_corrections(h, F._step_count(k), SINGLE),
                           SINGLE)
