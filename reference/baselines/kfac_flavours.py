r"""K-FAC's flavours in NumPy float64: which columns, which rows (issue 46, KC1–KC6, KC9).

K-FAC approximates a layer's curvature block (KC1, w.r.t. θ = [W | b].reshape(-1) of the
(d_out, d_in + 1) matrix, row-major, a bias being a last input column of 1s) by kron(G, A).
A flavour is two choices:

* ``fisher_type``, the columns backpropagated to the layer output (KC2, KC3): "type-2" the C
  columns of a square root of each data point's loss Hessian, "mc" the gradients at M targets
  sampled from the model, "empirical" the gradient at the data's own target;
* ``kfac_approx``, how the S shared positions of a sample (tokens, patches) enter: "expand"
  (KC4, every position a row) or "reduce" (KC5, positions summed within each sample first).

Shapes: rows ``a`` (N, S, d_in) (or (N, d_in), S = 1) and backpropagated columns ``g``
(K, N, S, d_out): column k for ALL data points at once, as one backward pass gives it. Only
kron(G, A) is the method's; how a scalar is split between A and G is ours (A an average, G
carrying R and the sums), stated once here.

The loss is ``L = R Σ_n ℓ_n`` over its data points (KC1): cross-entropy ℓ = −log softmax(f)_y,
MSE ℓ = Σ_c (f_c − y_c)²; outputs and targets arrive as (P, C) data points (the caller puts a
CE class dim last). MKOR's rank-1 statistic (KC6) is written here in the same terms, from rows,
so that its position among the flavours can be tested without importing MKOR's oracle.
"""
import numpy as np

__all__ = [
    "KINDS", "FISHER_TYPES", "reduction_factor", "softmax", "ce_hessian_sqrt",
    "mse_hessian_sqrt", "hessian_sqrt", "loss_output_gradient", "sample_targets",
    "kfac_columns", "expand_factors", "reduce_factors", "expert_expand_factors",
    "mkor_rank1_factors", "kronecker_rearrange", "best_kronecker",
]

KINDS = ("ce", "mse")
FISHER_TYPES = ("type-2", "mc", "empirical")


def _kind(kind):
    if kind not in KINDS:
        raise ValueError(f"loss kind must be one of {KINDS}, got {kind!r}")
    return kind


def _points(outputs):
    outputs = np.asarray(outputs, dtype=np.float64)
    if outputs.ndim != 2:
        raise ValueError(f"outputs must be (P, C) data points, got shape {outputs.shape}")
    return outputs


def reduction_factor(kind, reduction, points, numel):
    r"""R of KC1, L = R Σ_n ℓ_n: 1 for "sum"; for "mean" 1/P (CE: one term per data point)
    or 1/numel (MSE: torch divides by every element of the output)."""
    _kind(kind)
    if reduction == "sum":
        return 1.0
    if reduction != "mean":
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    return 1.0 / (points if kind == "ce" else numel)


def softmax(outputs):
    """p = softmax(f) per data point, shifted by the max (no overflow)."""
    z = _points(outputs)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def ce_hessian_sqrt(outputs):
    r"""KC2, cross-entropy: H_n = diag(p) − p pᵀ = S_n S_nᵀ with

        S_n = diag(√p) − p √pᵀ      (C × C, per data point: (P, C, C))

    since S Sᵀ = diag(p) − 2 p pᵀ + p (√pᵀ√p) pᵀ and √pᵀ√p = Σ p = 1.
    """
    p = softmax(outputs)
    root = np.sqrt(p)
    return np.einsum("pc,cd->pcd", root, np.eye(p.shape[1])) - p[:, :, None] * root[:, None, :]


def mse_hessian_sqrt(outputs):
    r"""KC2, MSE (ℓ = Σ_c (f_c − y_c)²): H_n = 2 I = S_n S_nᵀ with S_n = √2 I, (P, C, C)."""
    P, C = _points(outputs).shape
    return np.broadcast_to(np.sqrt(2.0) * np.eye(C), (P, C, C)).copy()


def hessian_sqrt(kind, outputs):
    """KC2: S_n for every data point, (P, C, C); R is not in it (G carries R, KC4/KC5)."""
    return ce_hessian_sqrt(outputs) if _kind(kind) == "ce" else mse_hessian_sqrt(outputs)


def loss_output_gradient(kind, outputs, targets):
    r"""∇_f ℓ_n at the given targets, (P, C): CE p − e_y (labels (P,)), MSE 2 (f − y)."""
    f = _points(outputs)
    if _kind(kind) == "ce":
        labels = np.asarray(targets)
        return softmax(f) - np.eye(f.shape[1])[labels]
    return 2.0 * (f - np.asarray(targets, dtype=np.float64))


def sample_targets(kind, outputs, rng):
    r"""KC3: ỹ_n drawn from the model's predictive distribution at f_n.

    CE: ỹ ~ Categorical(softmax(f_n)) (inverse CDF of one uniform per point). MSE:
    ỹ = f_n + ε/√2, ε ~ N(0, I): the Gaussian N(f, I/2) whose NLL is ℓ = ‖f − y‖² up to
    constants, so E[∇ℓ ∇ℓᵀ] = E[2ε·2εᵀ/2] = 2 I = H (Fisher = GGN).
    """
    f = _points(outputs)
    if _kind(kind) == "ce":
        cdf = np.cumsum(softmax(f), axis=1)
        u = rng.random((f.shape[0], 1))
        return np.minimum((u > cdf).sum(axis=1), f.shape[1] - 1)
    return f + rng.standard_normal(f.shape) / np.sqrt(2.0)


def kfac_columns(kind, fisher_type, outputs, targets, *, samples=1, rng=None):
    r"""The output-space columns a flavour backpropagates, (K, P, C) (KC2, KC3):

    * "type-2": K = C, column c = S_n[:, c] for every n (Σ_c col colᵀ = H_n);
    * "mc": K = M = ``samples``, column m = ∇_f ℓ_n(ỹ_nm) / √M with ỹ from
      :func:`sample_targets` (``rng`` a numpy Generator), so Σ_m → E_ỹ as M grows;
    * "empirical": K = 1, the data's own ∇_f ℓ_n(y_n) (equivalently (1/R) ∂L/∂f_n).
    """
    _kind(kind)
    if fisher_type == "type-2":
        return np.ascontiguousarray(hessian_sqrt(kind, outputs).transpose(2, 0, 1))
    if fisher_type == "mc":
        if rng is None or samples < 1:
            raise ValueError("fisher_type='mc' needs a numpy Generator rng and samples >= 1")
        draws = [sample_targets(kind, outputs, rng) for _ in range(samples)]
        return np.stack([loss_output_gradient(kind, outputs, y) for y in draws]) / np.sqrt(samples)
    if fisher_type == "empirical":
        return loss_output_gradient(kind, outputs, targets)[None]
    raise ValueError(f"fisher_type must be one of {FISHER_TYPES}, got {fisher_type!r}")


def _shared_rows(a, g):
    """(N, S, d_in) rows and (K, N, S, d_out) columns, a 2-D a / 3-D g read as S = 1."""
    a = np.asarray(a, dtype=np.float64)
    g = np.asarray(g, dtype=np.float64)
    if a.ndim == 2:
        a = a[:, None, :]
    if g.ndim == 3:
        g = g[:, :, None, :]
    if a.ndim != 3 or g.ndim != 4 or g.shape[1:3] != a.shape[:2]:
        raise ValueError(f"rows a {a.shape} and columns g {g.shape} must be (N, S, d_in) "
                         f"and (K, N, S, d_out)")
    if a.shape[0] * a.shape[1] == 0:
        raise ValueError("no rows: K-FAC's A is an average over rows")
    return a, g


def _with_bias(a, has_bias):
    """[a | 1]: the bias is a weight column whose input is always 1."""
    if not has_bias:
        return a
    return np.concatenate([a, np.ones(a.shape[:-1] + (1,))], axis=-1)


def expand_factors(a, g, R, has_bias=False):
    r"""KC4, K-FAC-expand: every shared position a row of its own,

        A = (1/(N S)) Σ_{n,s} a_ns a_nsᵀ,    G = R Σ_n Σ_s Σ_k g_nsk g_nskᵀ.

    Exact (kron(G, A) = GGN block, type-2 columns) for deep linear nets whose loss treats every
    position as a data point (per-token targets): there ∂f/∂y is the same for every row.
    """
    a, g = _shared_rows(a, g)
    rows = _with_bias(a, has_bias).reshape(-1, a.shape[-1] + has_bias)
    cols = g.reshape(-1, g.shape[-1])
    return rows.T @ rows / (a.shape[0] * a.shape[1]), R * cols.T @ cols


def reduce_factors(a, g, R, has_bias=False):
    r"""KC5, K-FAC-reduce: the S positions of a sample reduced first,

        ā_n = (1/S) Σ_s [a_ns | 1],   ĝ_nk = Σ_s g_nsk,
        A = (1/N) Σ_n ā_n ā_nᵀ,       G = R Σ_n Σ_k ĝ_nk ĝ_nkᵀ.

    Exact for deep linear nets whose shared dim is reduced (mean or sum) before the loss
    (reduce setting): there J_n = ρ S M (I ⊗ ā_nᵀ), ρ = 1 or 1/S. With S = 1 it is KC4.
    """
    a, g = _shared_rows(a, g)
    a_bar = _with_bias(a, has_bias).mean(axis=1)
    g_hat = g.sum(axis=2).reshape(-1, g.shape[-1])
    return a_bar.T @ a_bar / a.shape[0], R * g_hat.T @ g_hat


def expert_expand_factors(a, g, routes, experts, R, has_bias=False):
    r"""KC4 per expert of a fused-expert layer (token t routed to expert ``routes[t]``):
    expert e's factors from its own rows, a (T, d_in) and g (K, T, d_out) restricted to
    {t : routes[t] = e} (each token one row, S = 1); None for an expert routed no token."""
    routes = np.asarray(routes)
    out = []
    for e in range(experts):
        mine = routes == e
        out.append(expand_factors(np.asarray(a)[mine], np.asarray(g)[:, mine], R, has_bias)
                   if mine.any() else None)
    return out


def mkor_rank1_factors(a, g_loss, has_bias=False):
    r"""KC6, MKOR's rank-1 statistic (K3, K6) in K-FAC's terms: (ā āᵀ, ḡ ḡᵀ) with

        ā = mean over ALL rows of [a_r | 1],     ḡ = Σ over ALL rows of g_r,

    g_loss the gradient of the training loss L w.r.t. the layer output (MKOR's N g_r averaged
    is this sum). For one sample (N = 1) ā āᵀ is KC5's A and ḡ = ĝ, so kron(ḡḡᵀ, āāᵀ) =
    R · kron(G, A) of KC5 with empirical columns: R = 1/S for a loss averaged over S rows, 1
    for a sum. For N > 1 it is the reduce over the whole batch, not over each sample.
    """
    rows = _with_bias(np.asarray(a, dtype=np.float64), has_bias)
    rows = rows.reshape(-1, rows.shape[-1])
    g = np.asarray(g_loss, dtype=np.float64)
    a_bar, g_bar = rows.mean(axis=0), g.reshape(-1, g.shape[-1]).sum(axis=0)
    return np.outer(a_bar, a_bar), np.outer(g_bar, g_bar)


def kronecker_rearrange(block, d_out, width):
    r"""KC9's rearrangement 𝓡: (d_out·w)² block → (d_out², w²) with 𝓡(G ⊗ A) = vec(G) vec(A)ᵀ,

        𝓡[(i, j), (k, l)] = block[i w + k, j w + l].
    """
    block = np.asarray(block, dtype=np.float64)
    if block.shape != (d_out * width, d_out * width):
        raise ValueError(f"block {block.shape} is not ({d_out}·{width})²")
    return block.reshape(d_out, width, d_out, width).transpose(0, 2, 1, 3).reshape(
        d_out * d_out, width * width)


def best_kronecker(block, d_out, width):
    r"""KC9, Van Loan–Pitsianis: ‖B − G ⊗ A‖_F = ‖𝓡(B) − vec(G) vec(A)ᵀ‖_F, so the top
    singular pair σ u vᵀ of 𝓡(B) gives the Frobenius-optimal G = σ·unvec(u), A = unvec(v)
    (sign: tr A ≥ 0; the product does not depend on it)."""
    U, s, Vt = np.linalg.svd(kronecker_rearrange(block, d_out, width))
    G, A = s[0] * U[:, 0].reshape(d_out, d_out), Vt[0].reshape(width, width)
    return (G, A) if np.trace(A) >= 0 else (-G, -A)
