"""MARS-M in NumPy float64: ``MARSMReference`` strings the equations of ``mars_m_equations``
(M15-M18) together in the official code's order; it is the oracle for ``torch_impl.MARSM``.
A stack of matrices (``matrix_batch_dims`` = k >= 1, issue 31) takes (M15)-(M18) on each of
its matrices on its own (``reference.common.matrix_functions.over_matrices``).
"""
from dataclasses import dataclass

import numpy as np

from .mars_m_equations import (backup_adamw_step, efficient_argument, efficient_buffer,
    mars_m_direction, mars_m_momentum, mars_m_step, match_rms_scale)
from ..common.matrix_functions import over_matrices


@dataclass
class MARSMConfig:
    """The official ``MARS_M`` keywords and defaults (spec 2.6), ``clip_c`` made to work
    (True: the authors' behaviour, which clips whatever ``clip_c`` says) and ``efficient``."""
    lr: float = 1e-3
    weight_decay: float = 0.1
    momentum: float = 0.95
    ns_steps: int = 5
    ns_coefficients: object = "authors"  # (M13a): a triple, a sequence of them, or a name
    orthogonalizer: str = "newton_schulz"  # or "gram_newton_schulz" (M13b)
    gamma: float = 0.025
    clip_c: bool = True
    is_approx: bool = True
    adamw_betas: tuple = (0.9, 0.95)
    adamw_eps: float = 1e-8
    efficient: bool = False
    matrix_batch_dims: int = 0  # leading dims of a "mars_m" tensor that index its matrices


class MARSMReference:
    """The whole optimizer over float64 arrays; ``rules[i]`` is "mars_m" or "adamw".
    A "mars_m" array has ndim ``matrix_batch_dims`` + 2: a matrix, or a stack of them.

    ``step(grads, prev_grads=None)`` returns the new parameters; exact mode (``is_approx=False``)
    takes prev_grads = grad f(x_{t-1}, xi_t) from step 2 on, as ``reference.mars.mars``.
    """

    def __init__(self, params, rules, config=None):
        self.config = config or MARSMConfig()
        self.params = [np.array(p, dtype=np.float64) for p in params]
        self.rules = list(rules)
        ndim = self.config.matrix_batch_dims + 2
        bad = [p.shape for p, r in zip(self.params, self.rules) if r == "mars_m" and p.ndim != ndim]
        if bad:
            raise ValueError(f"matrix_batch_dims: 'mars_m' arrays must have ndim {ndim}, got {bad}")
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
            self.params[i], self.buf[i] = over_matrices(
                self._matrix_step, cfg.matrix_batch_dims, p, g, self.buf[i], self.last_grad[i])
        if cfg.is_approx:
            self.last_grad = [g.copy() for g in grads]
        return [p.copy() for p in self.params]

    def _matrix_step(self, p, g, buf, g_prev):
        """(M15)-(M18) on one A x B matrix: returns its new value and momentum buffer."""
        cfg = self.config
        if cfg.efficient:
            buf = efficient_buffer(buf, g, cfg.gamma, cfg.momentum)
            m = efficient_argument(buf, g, cfg.gamma, cfg.momentum)
        else:
            m = buf = mars_m_momentum(buf, g, g_prev, cfg.gamma, cfg.momentum, cfg.clip_c)
        o = mars_m_direction(m, cfg.ns_steps, cfg.ns_coefficients, cfg.orthogonalizer)
        return mars_m_step(p, o, self.lr, cfg.weight_decay, match_rms_scale(p.shape)), buf


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
