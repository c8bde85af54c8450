"""MARS-M update math in PyTorch, one function per equation (mirrors
``reference/mars/mars_m_equations.py``);
the list driver ``mars_m`` that runs them is ``functional.mars_m``.

The elementwise equations run under ``SINGLE`` (one tensor) or ``FOREACH`` (lists) ops, as in
``mars_equations``; Newton-Schulz is a matrix function, called once per matrix.  The MARS
equations themselves (M2 correction, M3 clip, M4 momentum) are ``mars_equations``'s.
A stack of matrices (``matrix_batch_dims`` = k >= 1: every matrix tensor has ndim k + 2) is
clipped, scaled and orthogonalised matrix by matrix, as k = 0's 2-D tensors are.
"""

from . import mars_equations
from ..common.matrix_functions import gram_newton_schulz, newton_schulz
from ..common.tensor_ops import SINGLE

MATRIX, EFFICIENT, BACKUP = "mars_m", "mars_m_efficient", "adamw"
MARS_M_NS_EPS = 1e-7  # the authors' Newton-Schulz eps (not the AdamW eps)


# ------------------------------------------------------------------ hyperparameters

def resolve_hyperparameters(kind, *, lr, weight_decay, momentum, gamma, adamw_betas,
                            adamw_eps):
    """The one MARS-M resolver: the optimizer's keywords -> the route's ``Hyper``.
    Matrices: beta1 = ``momentum`` (a = gamma beta/(1 - beta) in M15); the backup:
    ``adamw_betas``, ``adamw_eps``.  Both decay by ``weight_decay`` (the authors' ``wd``)."""
    momentum = mars_equations._number(momentum)  # tensors where AdamW takes them (common.scalars)
    if kind == BACKUP:
        beta1, beta2 = (mars_equations._number(b) for b in adamw_betas)
        return mars_equations.Hyper(lr=mars_equations._number(lr), weight_decay=weight_decay,
                                    gamma=0.0, beta1=beta1, beta2=beta2, eps=adamw_eps)
    return mars_equations.Hyper(lr=mars_equations._number(lr), weight_decay=weight_decay,
                                gamma=gamma, beta1=momentum, beta2=0.0, eps=MARS_M_NS_EPS)


# ------------------------------------------------------------------ equations (2.6)

def match_rms_scale(shape):
    r"""(M17) 0.2 sqrt(max(A, B)): the update's RMS then matches AdamW's (Moonlight).
    ``shape`` is one matrix's (A, B): a stack's callers pass ``p.shape[-2:]``."""
    return 0.2 * max(shape[0], shape[1]) ** 0.5


def mars_m_momentum_(m, g, last, h, clip, ops=SINGLE, matrix_batch_dims=0):
    r"""(M15)  C_t = g + a (g - g_prev) in ``last``'s buffer, clipped to norm 1 if ``clip``
    (each matrix of a stack with ``matrix_batch_dims`` leading dims to its own norm), then
    M <- beta M + (1 - beta) C~_t.  Returns M."""
    c = mars_equations.corrected_gradient_(last, g, h.gamma, h.beta1, ops)
    if clip:
        mars_equations.clip_matrices_(c, matrix_batch_dims, ops)
    return mars_equations.momentum_(m, c, h.beta1, ops)


def mars_m_direction(m, ns_steps, ns_dtype, ns_coefficients="authors",
                     orthogonalizer="newton_schulz"):
    r"""(M16)  O = NS5(M) as the authors compute it: cast to ``ns_dtype``, transpose if tall,
    normalise by ||X||_F + 1e-7, five quintic steps (their coefficients ``ns_coefficients``,
    M13a); O stays in ``ns_dtype``.  ``orthogonalizer="gram_newton_schulz"``: the same
    iteration through the Gram matrix (M13b).  A batch or stack (..., A, B): each matrix's own
    O (its own norm)."""
    ns = gram_newton_schulz if orthogonalizer == "gram_newton_schulz" else newton_schulz
    return ns(m, steps=ns_steps, eps=MARS_M_NS_EPS, dtype=ns_dtype, coefficients=ns_coefficients,
              cast_first=True)


def mars_m_step_(p, o, h, ops=SINGLE):
    r"""(M17)  p <- p (1 - lr lambda) - lr scale O, ``h.scale`` = 0.2 sqrt(max(A, B))."""
    ops.decay_(p, h.lr, h.weight_decay)
    ops.add_scaled_(p, o, -h.lr * h.scale)


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
    mars_equations.momentum_(m, g, h.beta1, ops)
    mars_equations.second_moment_(v, g, h.beta2, ops)
    denom = ops.sqrt(v)
    ops.add_(denom, h.eps)
    ops.decay_(p, h.lr, h.weight_decay)
    if isinstance(h.bc1, list):  # FOREACH: one step size per tensor
        step = [-h.lr * s / b for b, s in zip(h.bc1, h.sqrt_bc2)]
    else:
        step = -h.lr * h.sqrt_bc2 / h.bc1
    ops.addcdiv_(p, m, denom, step)
