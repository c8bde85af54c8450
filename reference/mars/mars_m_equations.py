"""MARS-M (MARS on Muon, arXiv 2510.21800) in NumPy float64, one function per equation (M15-M18).

Matrices: the MARS-approx correction with beta = ``momentum`` (M2), the per-tensor clip (M3),
the momentum (M15), Newton-Schulz (M16) and a step scaled by 0.2 sqrt(max(A, B)) (M17).
Everything else: an AdamW backup whose eps sits before the bias correction.  ``MARS_M_Efficient``
(M18) keeps no g_{t-1} and never clips.  ``reference.mars.mars_m.MARSMReference`` strings them
together in the official code's order.
"""
import numpy as np

from .mars_equations import clip_tensor, corrected_gradient, momentum
from ..common.matrix_functions import gram_newton_schulz, newton_schulz

RULES = ("mars_m", "adamw")
MARS_M_NS_EPS = 1e-7  # the authors' Newton-Schulz eps (not the AdamW eps)


def match_rms_scale(shape):
    r"""(M17) 0.2 sqrt(max(A, B)): the update's RMS then matches AdamW's (Moonlight)."""
    return 0.2 * max(shape[0], shape[1]) ** 0.5


def mars_m_momentum(m, g, g_prev, gamma, beta, clip=True):
    r"""(M15)  C_t = g_t + gamma beta / (1 - beta) (g_t - g_prev), clipped to norm 1,
    M <- beta M + (1 - beta) C~_t.  ``clip=False`` is the authors' ignored ``clip_c=False``."""
    c = corrected_gradient(g, g_prev, gamma, beta)
    return momentum(m, clip_tensor(c) if clip else c, beta)


def mars_m_direction(m, ns_steps=5, ns_coefficients="authors", orthogonalizer="newton_schulz"):
    r"""(M16)  O = NS5(M) with eps 1e-7 (the authors normalise after the transpose; in exact
    arithmetic that is the same matrix, ||X^T||_F = ||X||_F), its steps' coefficients
    ``ns_schedule(ns_coefficients)`` (M13a); ``orthogonalizer="gram_newton_schulz"``: the same
    iteration through the Gram matrix (M13b)."""
    if orthogonalizer == "gram_newton_schulz":
        return gram_newton_schulz(m, steps=ns_steps, eps=MARS_M_NS_EPS,
                                  coefficients=ns_coefficients)
    return newton_schulz(m, steps=ns_steps, eps=MARS_M_NS_EPS, coefficients=ns_coefficients)


def mars_m_step(p, o, lr, weight_decay, scale):
    r"""(M17)  p <- p (1 - lr lambda) - lr scale O, scale = 0.2 sqrt(max(A, B))."""
    return p * (1.0 - lr * weight_decay) - lr * scale * o


def efficient_buffer(buf, g, gamma, beta):
    r"""(M18)  buf <- beta buf + ((1 - gamma)(1 - beta) / beta) g  (no g_{t-1} kept)."""
    return beta * buf + ((1.0 - gamma) * (1.0 - beta) / beta) * g


def efficient_argument(buf, g, gamma, beta):
    r"""(M18)  gamma g + beta buf: the unclipped MARS-M momentum M_t (MT12)."""
    return gamma * g + beta * buf


def backup_adamw_step(p, g, m, v, k, lr, betas, eps, weight_decay):
    r"""The AdamW backup of the non-matrix parameters, eps *before* the bias correction:

    m <- lerp(m, g, 1 - b1),  v <- lerp(v, g^2, 1 - b2),  u = m / (eps + sqrt(v)),
    p <- p (1 - lr lambda) - lr (sqrt(bc2) / bc1) u.   Returns (p, m, v).
    """
    b1, b2 = betas
    m = b1 * m + (1.0 - b1) * g
    v = b2 * v + (1.0 - b2) * g * g
    bc1, bc2 = 1.0 - b1**k, 1.0 - b2**k
    u = m / (eps + np.sqrt(v))
    return p * (1.0 - lr * weight_decay) - lr * (np.sqrt(bc2) / bc1) * u, m, v
