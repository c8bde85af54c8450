"""MARS in NumPy float64, one function per equation of arXiv 2411.10438 (M1-M14).

Symbols follow ``shared/spec/MARS.md``: g_t the stochastic gradient, c_t the corrected
gradient, c~_t its clipped version, m/v the moments, k the step (from 1), a = gamma beta1/(1-beta1),
s = sqrt(max(1, A/B)) for an A x B matrix.  ``reference.mars.mars.MARSReference`` strings the
equations together in the official code's order.  A stack of matrices (``matrix_batch_dims``,
issue 31) is its matrices: every matrix equation applies to each on its own
(``reference.common.matrix_functions.over_matrices``).
"""
import numpy as np

from ..common.matrix_functions import (gram_newton_schulz, newton_schulz, orthogonalize_svd,
                                       over_matrices)

MARS_TYPES = ("mars-adamw", "mars-lion", "mars-shampoo")
CLIP_SCOPES = ("tensor", "global", "none")
ORTHOGONALIZERS = ("newton_schulz", "svd", "gram_newton_schulz")
WEIGHT_DECAY_1D_SOURCES = ("constructor", "group")


# ---------------------------------------------------------------- core recursion (2.1)

def correction_coefficient(gamma, beta1):
    """a = gamma beta1 / (1 - beta1), the weight of the gradient difference in (M1)/(M2)."""
    return gamma * beta1 / (1.0 - beta1)


def corrected_gradient(g, g_prev, gamma, beta1):
    r"""(M1)/(M2)  c_t = g_t + a (g_t - g_prev).

    Exact mode (M1): g_prev = grad f(x_{t-1}, xi_t), the *new* batch at the *old* point.
    Approx mode (M2): g_prev = g_{t-1}, the previous step's gradient.  g_prev = 0 at step 1,
    so c_1 = (1 + a) g_1.
    """
    return g + correction_coefficient(gamma, beta1) * (g - g_prev)


def clip_tensor(c):
    r"""(M3), official scope:  c~ = c / ||c||_F  if ||c||_F > 1,  else c  (one tensor)."""
    norm = np.linalg.norm(c)
    return c / norm if norm > 1.0 else c


def clip_matrices(c, batch_dims):
    r"""(M3), official scope, on a stack: each matrix of ``c`` (``batch_dims`` leading dims)
    clipped on its own, c~_i = c_i / ||c_i||_F if ||c_i||_F > 1, as a 2-D parameter would be
    (``batch_dims`` = 0: ``clip_tensor`` of the whole tensor)."""
    return over_matrices(clip_tensor, batch_dims, c)


def clip_global(cs):
    r"""(M3), paper scope: one Euclidean norm over the whole parameter vector (all tensors)."""
    norm = np.sqrt(sum(np.sum(c * c) for c in cs))
    return [c / norm for c in cs] if norm > 1.0 else list(cs)


def momentum(m, c, beta1):
    r"""(M4)  m_t = beta1 m_{t-1} + (1 - beta1) c~_t,  m_0 = 0."""
    return beta1 * m + (1.0 - beta1) * c


# ---------------------------------------------------------------- MARS-AdamW (2.2)

def second_moment(v, c, beta2):
    r"""(M6)  v_t = beta2 v_{t-1} + (1 - beta2) c~_t * c~_t  (the clipped corrected gradient)."""
    return beta2 * v + (1.0 - beta2) * c * c


def amsgrad_max(v_max, v):
    r"""(M9)  v-bar_t = max(v-bar_{t-1}, v_t), used in place of v in (M7)."""
    return np.maximum(v_max, v)


def adamw_direction(m, v, k, beta1, beta2, eps):
    r"""(M7)  u = (m / bc1) / (sqrt(v) / sqrt(bc2) + eps),  bc_i = 1 - beta_i^k.

    Written, like the official code, as m / ((sqrt(v) / sqrt(bc2) + eps) bc1).
    """
    bc1, bc2 = 1.0 - beta1**k, 1.0 - beta2**k
    return m / ((np.sqrt(v) / np.sqrt(bc2) + eps) * bc1)


def decoupled_step(p, u, lr, weight_decay):
    r"""(M8), also the last line of (M10) and (M12):  p <- p - lr (u + lambda p)."""
    return p - lr * (u + weight_decay * p)


def adamw_step(p, m, v, k, lr, beta1, beta2, eps, weight_decay):
    r"""(M7)+(M8): the AdamW-rule step, ``decoupled_step`` of ``adamw_direction``."""
    return decoupled_step(p, adamw_direction(m, v, k, beta1, beta2, eps), lr, weight_decay)


# ---------------------------------------------------------------- MARS-Lion (2.3)

def lion_direction(m):
    r"""(M10)  u = sign(m_t): every coordinate moves by exactly lr (0 where m_i = 0)."""
    return np.sign(m)


def lion_step(p, m, lr, weight_decay):
    r"""(M10): p <- p - lr (sign(m) + lambda p)."""
    return decoupled_step(p, lion_direction(m), lr, weight_decay)


# ---------------------------------------------------------------- MARS-Shampoo (2.4)

def shape_scale(shape):
    r"""s = sqrt(max(1, A / B)) for an A x B matrix (official MARS-Shampoo and Muon scale)."""
    rows, cols = shape
    return max(1.0, rows / cols) ** 0.5 if cols else 1.0


def shampoo_direction(m, beta1, eps, orthogonalizer="newton_schulz", ns_steps=5,
                      ns_coefficients="authors"):
    r"""(M11)/(M12)  u = s O(m / (1 - beta1)), O = NS (official, with the optimizer's eps; its
    schedule ``ns_coefficients``, M13a), NS through the Gram matrix (M13b) or U V^T (paper).
    The 1/(1-beta1) prescale changes nothing up to eps: all three maps are scale invariant."""
    scaled = m / (1.0 - beta1)
    if orthogonalizer == "svd":
        direction = orthogonalize_svd(scaled)
    elif orthogonalizer == "gram_newton_schulz":
        direction = gram_newton_schulz(scaled, steps=ns_steps, eps=eps,
                                       coefficients=ns_coefficients)
    else:
        direction = newton_schulz(scaled, steps=ns_steps, eps=eps, coefficients=ns_coefficients)
    return shape_scale(m.shape) * direction


def shampoo_step(p, m, lr, beta1, eps, weight_decay, orthogonalizer="newton_schulz", ns_steps=5,
                 scale=None, ns_coefficients="authors"):
    r"""(M12): p <- p - lr (s O(m / (1 - beta1)) + lambda p); ``scale`` replaces s (a matrix
    stored transposed gives the s of its true shape)."""
    u = shampoo_direction(m, beta1, eps, orthogonalizer, ns_steps, ns_coefficients)
    if scale is not None:
        u = u * (scale / shape_scale(m.shape))
    return decoupled_step(p, u, lr, weight_decay)


# ---------------------------------------------------------------- routing (2.5)

def takes_mars_path(shape, optimize_1d):
    """A tensor takes the mars_type update if it is 2-D or ``optimize_1d``; else (M14)."""
    return len(shape) == 2 or optimize_1d


def matrix_batch_dims_of(shape, matrix_batch_dims):
    r"""How many leading dims of a tensor of ``shape`` index independent matrices, in a group
    that declares ``matrix_batch_dims`` = k (fused MoE experts: one (E, A, B) parameter):

    * ndim = k + 2: k, a stack, each of whose A x B matrices takes the rule of a 2-D tensor
      (k = 0: a matrix, as without the option);
    * k = 0, or ndim < 2: 0, the tensor routes by its own shape, as without the option;
    * anything else (k >= 1, ndim >= 2, ndim != k + 2): a ValueError naming
      ``matrix_batch_dims``.  Nothing is guessed: a 3-D Conv1d kernel is not a stack of
      matrices, and a 2-D tensor among stacks is a mistake in the grouping.
    """
    if len(shape) == matrix_batch_dims + 2:
        return matrix_batch_dims
    if matrix_batch_dims == 0 or len(shape) < 2:
        return 0
    raise ValueError(
        f"matrix_batch_dims={matrix_batch_dims}: a tensor of ndim {matrix_batch_dims + 2} is a "
        f"stack of matrices and one of ndim < 2 takes the non-matrix rule; got shape "
        f"{tuple(shape)} (give it a parameter group with its own matrix_batch_dims)")


def route(shape, mars_type, optimize_1d, matrix_batch_dims=0):
    """The rule a tensor takes: "fallback" (M14), or "lion", "shampoo" (2-D) or "adamw".
    A stack of matrices (``matrix_batch_dims_of``) takes the rule of one of its matrices."""
    shape = tuple(shape)[matrix_batch_dims_of(shape, matrix_batch_dims):]
    if not takes_mars_path(shape, optimize_1d):
        return "fallback"
    if mars_type == "mars-lion":
        return "lion"
    if mars_type == "mars-shampoo" and len(shape) == 2:
        return "shampoo"
    return "adamw"
