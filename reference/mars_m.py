"""MARS-M (MARS on Muon, arXiv 2510.21800) in NumPy float64, one function per equation (M15-M18).

Matrices: the MARS-approx correction with beta = ``momentum`` (M2), the per-tensor clip (M3),
the momentum (M15), Newton-Schulz (M16) and a step scaled by 0.2 sqrt(max(A, B)) (M17).
Everything else: an AdamW backup whose eps sits before the bias correction.  ``MARS_M_Efficient``
(M18) keeps no g_{t-1} and never clips.  ``MARSMReference`` strings the equations together in
the official code's order; it is the oracle for ``torch_impl.MARSM``.
"""
from dataclasses import dataclass

import numpy as np

from .mars import clip_tensor, correction_coefficient, corrected_gradient, momentum
from .matrix_functions import newton_schulz

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


def mars_m_direction(m, ns_steps=5):
    r"""(M16)  O = NS5(M) with eps 1e-7 (the authors normalise after the transpose; in exact
    arithmetic that is the same matrix, ||X^T||_F = ||X||_F)."""
    return newton_schulz(m, steps=ns_steps, eps=MARS_M_NS_EPS)


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


@dataclass
class MARSMConfig:
    """The official ``MARS_M`` keywords and defaults (spec 2.6), ``clip_c`` made to work
    (True: the authors' behaviour, which clips whatever ``clip_c`` says) and ``efficient``."""
    lr: float = 1e-3
    weight_decay: float = 0.1
    momentum: float = 0.95
    ns_steps: int = 5
    gamma: float = 0.025
    clip_c: bool = True
    is_approx: bool = True
    adamw_betas: tuple = (0.9, 0.95)
    adamw_eps: float = 1e-8
    efficient: bool = False


class MARSMReference:
    """The whole optimizer over float64 arrays; ``rules[i]`` is "mars_m" or "adamw".

    ``step(grads, prev_grads=None)`` returns the new parameters; exact mode (``is_approx=False``)
    takes prev_grads = grad f(x_{t-1}, xi_t) from step 2 on, as ``reference.mars``.
    """

    def __init__(self, params, rules, config=None):
        self.config = config or MARSMConfig()
        self.params = [np.array(p, dtype=np.float64) for p in params]
        self.rules = list(rules)
        self.lr = self.config.lr
        self.k = 0
        self.buf = [np.zeros_like(p) for p in self.params]      # M (or the efficient buf)
        self.last_grad = [np.zeros_like(p) for p in self.params]
        self.exp_avg = [np.zeros_like(p) for p in self.params]  # the backup's moments
        self.exp_avg_sq = [np.zeros_like(p) for p in self.params]

    def step(self, grads, prev_grads=None):
        cfg = self.config
        self.k += 1
        grads = [np.asarray(g, dtype=np.float64) for g in grads]
        if not cfg.is_approx and self.k > 1:
            if prev_grads is None:
                raise ValueError("exact mode needs prev_grads = grad f(x_{t-1}, xi_t)")
            self.last_grad = [np.asarray(g, dtype=np.float64) for g in prev_grads]
        for i, (p, g, rule) in enumerate(zip(self.params, grads, self.rules)):
            if rule == "adamw":
                self.params[i], self.exp_avg[i], self.exp_avg_sq[i] = backup_adamw_step(
                    p, g, self.exp_avg[i], self.exp_avg_sq[i], self.k, self.lr,
                    cfg.adamw_betas, cfg.adamw_eps, cfg.weight_decay)
                continue
            if cfg.efficient:
                self.buf[i] = efficient_buffer(self.buf[i], g, cfg.gamma, cfg.momentum)
                m = efficient_argument(self.buf[i], g, cfg.gamma, cfg.momentum)
            else:
                m = self.buf[i] = mars_m_momentum(self.buf[i], g, self.last_grad[i], cfg.gamma,
                                                  cfg.momentum, cfg.clip_c)
            o = mars_m_direction(m, cfg.ns_steps)
            self.params[i] = mars_m_step(p, o, self.lr, cfg.weight_decay, match_rms_scale(p.shape))
        if cfg.is_approx:
            self.last_grad = [g.copy() for g in grads]
        return [p.copy() for p in self.params]


def mars_m_trajectory(x0, rules, grad, batches, config=None):
    """Run MARS-M from x0 with a gradient oracle ``grad(x, xi)`` (exact mode evaluates
    grad(x_{t-1}, xi_t) itself).  Returns [x_0, x_1, ...]."""
    opt = MARSMReference(x0, rules, config)
    xs, x_prev = [[p.copy() for p in opt.params]], None
    for xi in batches:
        x = xs[-1]
        prev = grad(x_prev, xi) if (not opt.config.is_approx and x_prev is not None) else None
        g = grad(x, xi)
        x_prev = x
        xs.append(opt.step(g, prev))
    return xs
