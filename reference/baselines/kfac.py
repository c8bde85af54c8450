"""K-FAC baseline in NumPy float64, the KAISA form (K19, MKOR.md 2.8).

K-FAC approximates a layer's Fisher block by A (x) G with
A = E[a a^T] (inputs, d_in' x d_in') and G = E[g g^T] (output gradients, d_out x d_out),
keeps both as EMAs, and every ``inv_freq`` steps eigendecomposes them (O(d^3); MKOR's
point is to avoid this). The update is the damped Kronecker solve
V = (G (x) A + damping I)^{-1} G_hat, written with the eigenbases (K19). A KL-clip then
caps the step's predicted change in the model's output distribution.

A fused mixture-of-experts projection is E such layers (issue 31): ``expert_kfac_factors``
gives each expert its own factors from its own rows (the rows are the problem's,
``reference/common/moe.py``).
"""
from dataclasses import dataclass

import numpy as np

from reference.common.moe import expert_pairs


def _rows(x):
    """Flatten every leading dimension into rows: (..., d) -> (N, d) (K-FAC's own: the
    baselines import nothing from ``reference/mkor``)."""
    x = np.asarray(x, dtype=np.float64)
    return x.reshape(-1, x.shape[-1])


def kfac_factors(a_rows, g_rows, has_bias=False, rows_per_sample=1):
    r"""Kronecker factors from one batch (K19, rows as K3).

        A = (1/R) sum_r a_r a_r^T        with a_r = [a_r | 1] when has_bias
        G = (1/N) sum_r (N g_r)(N g_r)^T = N sum_r g_r g_r^T

    over the R rows, N = R / rows_per_sample samples. g_rows is the gradient of the loss
    averaged over the N samples, so N g_r is a sample's own gradient (K3). Leading dimensions
    are flattened into rows; a Conv2d contributes its L unfolded patches per sample
    (``rows_per_sample`` = L), a Linear on (B, T, d) tokens T rows per sample.
    """
    a, g = _rows(a_rows), _rows(g_rows)
    rows = a.shape[0]
    samples = rows / rows_per_sample
    if has_bias:
        a = np.concatenate([a, np.ones((rows, 1))], axis=1)
    g = samples * g
    return a.T @ a / rows, g.T @ g / samples


def expert_kfac_factors(rows, has_bias=False, projection=None):
    r"""Each expert's K-FAC factors (K19), ``kfac_factors`` on its own n_e rows as the 2-D
    Linear layer (one row per sample):

        A_e = (1/n_e) sum_i [a_i | 1][a_i | 1]^T,    G_e = n_e sum_i g_i g_i^T

    (G_e = (1/n_e) sum_i (n_e g_i)(n_e g_i)^T: K3's per-sample gradients). None for an expert
    with no rows.
    """
    return [None if a.shape[0] == 0 else kfac_factors(a, g, has_bias=has_bias)
            for a, g in expert_pairs(rows, projection)]


def ema(old, new, decay):
    """Factor EMA (K19): decay * old + (1 - decay) * new; ``old`` None gives ``new``."""
    return new if old is None else decay * old + (1 - decay) * new


def damped_inverse(F, damping):
    """(F + damping I)^{-1} by an explicit inverse: the "inverse" method (O(d^3))."""
    return np.linalg.inv(F + damping * np.eye(F.shape[0]))


def eigen_decompose(F):
    """F = Q diag(lam) Q^T for symmetric PSD F; eigenvalues clipped at 0, since
    rounding can make a PSD factor's smallest ones slightly negative."""
    lam, Q = np.linalg.eigh((F + F.T) / 2)
    return np.maximum(lam, 0.0), Q


def _grad_matrix(grad_W, grad_b):
    """G_hat = [grad_W.reshape(d_out, -1) | grad_b]."""
    grad_W = np.asarray(grad_W, dtype=np.float64)
    G_hat = grad_W.reshape(grad_W.shape[0], -1)
    if grad_b is not None:
        G_hat = np.concatenate([G_hat, np.reshape(grad_b, (-1, 1))], axis=1)
    return G_hat


def eigen_precondition_from(QA, lamA, QG, lamG, G_hat, damping):
    r"""The eigen form with precomputed bases (K19):

        V = Q_G [ (Q_G^T G_hat Q_A) / (lam_G lam_A^T + damping) ] Q_A^T    (elementwise /)
    """
    return QG @ ((QG.T @ G_hat @ QA) / (np.outer(lamG, lamA) + damping)) @ QA.T


def eigen_precondition(A, G, grad, damping):
    r"""K-FAC step in eigen form (K19): V = (G (x) A + damping I)^{-1} applied to grad,

        V = Q_G [ (Q_G^T grad Q_A) / (lam_G lam_A^T + damping) ] Q_A^T

    with A = Q_A diag(lam_A) Q_A^T and G = Q_G diag(lam_G) Q_G^T; grad is the
    (d_out x d_in') matrix G_hat.
    """
    lamA, QA = eigen_decompose(A)
    lamG, QG = eigen_decompose(G)
    return eigen_precondition_from(QA, lamA, QG, lamG, np.asarray(grad, dtype=np.float64),
                                   damping)


def inverse_precondition(A, G, grad, damping):
    """K-FAC step in inverse form: (G + damping I)^{-1} grad (A + damping I)^{-1}."""
    return damped_inverse(G, damping) @ grad @ damped_inverse(A, damping)


def kl_clip(updates, grads, lr, kl_clip_value):
    r"""KL-clip scale (K19), over all layers:

        nu = min(1, sqrt(kl_clip / |sum_m lr^2 <V_m, G_hat_m>|))

    so that nu^2 |sum lr^2 <V, G_hat>| <= kl_clip. Returns 1 when the sum is 0.
    """
    vg_sum = sum(float(np.sum(v * g)) for v, g in zip(updates, grads)) * lr**2
    if vg_sum == 0.0:
        return 1.0
    return min(1.0, float(np.sqrt(kl_clip_value / abs(vg_sum))))


@dataclass
class KFACConfig:
    """K-FAC defaults (K19): damping 1e-3, factor_decay 0.95, kl_clip 1e-3.

    ``factor_freq`` and ``inv_freq`` are KAISA's factor_update_steps and
    inv_update_steps; ``method`` is "eigen" or "inverse"; ``kl_clip`` None turns the
    clip off; ``lr`` is the learning rate the clip assumes.
    """

    factor_freq: int = 1
    inv_freq: int = 1
    factor_decay: float = 0.95
    damping: float = 1e-3
    kl_clip: float = 1e-3
    lr: float = 0.1
    method: str = "eigen"


class KFACReference:
    """Whole-model K-FAC step (K19), float64.

    ``layers``: one dict per layer with ``A_new``, ``G_new`` (from ``kfac_factors``;
    needed on factor steps, else may be None), ``grad_W``, ``grad_b``. Factors are
    EMA'd when ``steps % factor_freq == 0`` (the first update takes the batch factor
    as is), decomposed when ``steps % inv_freq == 0``, every layer is preconditioned
    with the latest decomposition, and all updates are scaled by one KL-clip factor.
    """

    def __init__(self, config=None):
        self.config = KFACConfig() if config is None else config
        if self.config.method not in ("eigen", "inverse"):
            raise ValueError(f"method must be 'eigen' or 'inverse', got {self.config.method!r}")
        self.steps = 0
        self.A, self.G, self.decomposed = [], [], []

    def _update_factors(self, layers):
        c = self.config
        if not self.A:
            self.A, self.G = [None] * len(layers), [None] * len(layers)
            self.decomposed = [None] * len(layers)
        for m, layer in enumerate(layers):
            self.A[m] = ema(self.A[m], layer["A_new"], c.factor_decay)
            self.G[m] = ema(self.G[m], layer["G_new"], c.factor_decay)

    def _decompose(self):
        c = self.config
        for m, (A, G) in enumerate(zip(self.A, self.G)):
            if c.method == "eigen":
                self.decomposed[m] = (eigen_decompose(A), eigen_decompose(G))
            else:
                self.decomposed[m] = (damped_inverse(A, c.damping), damped_inverse(G, c.damping))

    def _apply(self, m, G_hat):
        first, second = self.decomposed[m]
        if self.config.method == "eigen":
            (lamA, QA), (lamG, QG) = first, second
            return eigen_precondition_from(QA, lamA, QG, lamG, G_hat, self.config.damping)
        return second @ G_hat @ first

    def step(self, layers):
        """Returns a list of (delta_W, delta_b) for the backbone (usually SGD)."""
        c = self.config
        if self.steps % c.factor_freq == 0:
            self._update_factors(layers)
        if self.steps % c.inv_freq == 0:
            self._decompose()
        if not self.decomposed or self.decomposed[0] is None:
            raise ValueError("no factors yet: the first step must be a factor/inverse step")
        grads = [_grad_matrix(layer["grad_W"], layer.get("grad_b")) for layer in layers]
        updates = [self._apply(m, G_hat) for m, G_hat in enumerate(grads)]
        nu = 1.0 if c.kl_clip is None else kl_clip(updates, grads, c.lr, c.kl_clip)
        out = []
        for layer, V in zip(layers, updates):
            shape = np.shape(layer["grad_W"])
            if layer.get("grad_b") is None:
                out.append((nu * V.reshape(shape), None))
            else:
                out.append((nu * V[:, :-1].reshape(shape), nu * V[:, -1]))
        self.steps += 1
        return out
