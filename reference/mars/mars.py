"""MARS in NumPy float64: ``MARSReference`` strings the equations of ``mars_equations``
(M1-M14) together in the official code's order; it is the oracle for ``torch_impl.MARS``.
"""
from dataclasses import dataclass

import numpy as np

from .mars_equations import (adamw_step, amsgrad_max, clip_global, clip_matrices,
    corrected_gradient, lion_step, matrix_batch_dims_of, momentum, route, second_moment,
    shampoo_step, takes_mars_path)
from ..common.matrix_functions import over_matrices


@dataclass
class MARSConfig:
    """Hyperparameters; names and defaults are the official class's (spec section 3),
    plus the documented deviations (section 4)."""
    lr: float = 3e-3
    betas: tuple = (0.95, 0.99)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    gamma: float = 0.025
    is_approx: bool = True
    mars_type: str = "mars-adamw"
    optimize_1d: bool = False
    lr_1d: float = 3e-3
    betas_1d: tuple = (0.9, 0.95)
    weight_decay_1d: float = 0.1
    clip_scope: str = "tensor"
    orthogonalizer: str = "newton_schulz"
    ns_steps: int = 5
    ns_coefficients: object = "authors"  # (M13a): a triple, a sequence of them, or a name
    weight_decay_1d_source: str = "constructor"
    matrix_batch_dims: int = 0  # leading dims of a stack that index its matrices (issue 31)


class MARSReference:
    """The whole optimizer over a list of float64 arrays (one parameter group).

    ``step(grads, prev_grads=None)`` returns the new parameters.  In approx mode the
    correction uses the stored raw g_{t-1}; in exact mode the caller passes
    prev_grads = grad f(x_{t-1}, xi_t) (ignored at step 1, where g_prev = 0 in both modes).
    ``lr`` may be changed between steps (a schedule); the 1-D learning rate follows it through
    the constructor ratio r = lr_1d / lr (spec 2.5).
    """

    def __init__(self, params, config=None):
        self.config = config or MARSConfig()
        self.params = [np.array(p, dtype=np.float64) for p in params]
        self.lr = self.config.lr
        self.lr_1d_factor = self.config.lr_1d / self.config.lr if self.config.lr > 0 else 0.0
        self.k = 0
        zeros = [np.zeros_like(p) for p in self.params]
        self.exp_avg = [z.copy() for z in zeros]
        self.exp_avg_sq = [z.copy() for z in zeros]
        self.max_exp_avg_sq = [z.copy() for z in zeros]
        self.last_grad = [z.copy() for z in zeros]

    def step(self, grads, prev_grads=None):
        cfg, b1 = self.config, self.config.betas[0]
        self.k += 1
        grads = [np.asarray(g, dtype=np.float64) for g in grads]
        if not cfg.is_approx and self.k > 1:
            if prev_grads is None:
                raise ValueError("exact mode needs prev_grads = grad f(x_{t-1}, xi_t)")
            self.last_grad = [np.asarray(g, dtype=np.float64) for g in prev_grads]
        on_mars = [takes_mars_path(p.shape[self._batch_dims(p):], cfg.optimize_1d)
                   for p in self.params]

        corrected = [corrected_gradient(g, gp, cfg.gamma, b1) if mars else None
                     for g, gp, mars in zip(grads, self.last_grad, on_mars)]
        corrected = self._clip(corrected)

        for i, (p, g, c) in enumerate(zip(self.params, grads, corrected)):
            if c is None:
                self.params[i] = self._fallback(i, p, g)
            else:
                self.params[i] = self._mars_update(i, p, c)
        if cfg.is_approx:
            self.last_grad = [g.copy() for g in grads]  # the raw g, never c~ (spec B1, F1)
        return [p.copy() for p in self.params]

    def _clip(self, corrected):
        scope = self.config.clip_scope
        if scope == "tensor":  # each matrix of a stack on its own
            return [None if c is None else clip_matrices(c, self._batch_dims(c))
                    for c in corrected]
        if scope == "global":
            live = [c for c in corrected if c is not None]
            clipped = iter(clip_global(live))
            return [None if c is None else next(clipped) for c in corrected]
        return corrected

    def _mars_update(self, i, p, c):
        cfg, b1, b2 = self.config, *self.config.betas
        m = self.exp_avg[i] = momentum(self.exp_avg[i], c, b1)
        kind = route(p.shape, cfg.mars_type, cfg.optimize_1d, cfg.matrix_batch_dims)
        if kind == "lion":
            return lion_step(p, m, self.lr, cfg.weight_decay)
        if kind == "shampoo":  # (M12) on each matrix of a stack, with that matrix's s
            return over_matrices(
                lambda p_i, m_i: shampoo_step(p_i, m_i, self.lr, b1, cfg.eps, cfg.weight_decay,
                                              cfg.orthogonalizer, cfg.ns_steps,
                                              ns_coefficients=cfg.ns_coefficients),
                self._batch_dims(p), p, m)
        # mars-adamw, and the non-2-D tensors of mars-shampoo with optimize_1d
        v = self.exp_avg_sq[i] = second_moment(self.exp_avg_sq[i], c, b2)
        if cfg.amsgrad:
            v = self.max_exp_avg_sq[i] = amsgrad_max(self.max_exp_avg_sq[i], v)
        return adamw_step(p, m, v, self.k, self.lr, b1, b2, cfg.eps, cfg.weight_decay)

    def _batch_dims(self, x):
        """The leading dims of ``x`` that index matrices (``matrix_batch_dims_of``)."""
        return matrix_batch_dims_of(np.shape(x), self.config.matrix_batch_dims)

    def _fallback(self, i, p, g):
        r"""(M14)  AdamW on the raw g with betas_1d, lr r*lr and weight_decay_1d."""
        cfg, (b1, b2) = self.config, self.config.betas_1d
        wd = cfg.weight_decay_1d if cfg.weight_decay_1d_source == "constructor" else cfg.weight_decay
        m = self.exp_avg[i] = momentum(self.exp_avg[i], g, b1)
        v = self.exp_avg_sq[i] = second_moment(self.exp_avg_sq[i], g, b2)
        return adamw_step(p, m, v, self.k, self.lr * self.lr_1d_factor, b1, b2, cfg.eps, wd)


def mars_trajectory(x0, grad, batches, config=None):
    """Run MARS from x0 over ``batches`` with a gradient oracle ``grad(x, xi)``.

    Exact mode evaluates grad(x_{t-1}, xi_t) itself -- the new batch at the old point --
    which is what ``torch_impl.MARS`` obtains by re-running the closure at x_{t-1}.
    Returns [x_0, x_1, ...].
    """
    opt = MARSReference(x0, config)
    xs, x_prev = [[p.copy() for p in opt.params]], None
    for xi in batches:
        x = xs[-1]
        g = grad(x, xi)
        prev = grad(x_prev, xi) if (not opt.config.is_approx and x_prev is not None) else None
        x_prev = x
        xs.append(opt.step(g, prev))
    return xs
