r"""Rank-k MKOR, NumPy float64 (issue 46 item 6; equations KC7, KC8).

Rank-1 MKOR keeps one vector per factor, the mean of all the rows (K3, K6). Rank-k MKOR keeps
k: the rows of a capture, in sample order, are cut into k contiguous groups and each group
gives its own mean.

KC7 (group means). The R rows of a capture (leading dimensions flattened row-major, so sample
order) are cut into k contiguous groups with ``np.array_split``'s sizes (the first R mod k
groups one row longer). With the mask's real rows only (a padded row belongs to its group by
position but never enters its mean):

    a_bar_j = mean_{r in j, real} [a_r | 1],        g_bar_j = mean_{r in j, real} (R_g g_r),

R_g the per-sample multiplier of rank-1 MKOR: the number of real samples N = (real rows) /
(rows per sample), i.e. the rows for a Linear and the batch size B for a Conv2d (K3, K4). The
factor statistics are

    A ~ (1/k') sum_j a_bar_j a_bar_j^T,             G ~ (1/k') sum_j g_bar_j g_bar_j^T

over the k' groups that hold a real row (an empty group has no mean and contributes nothing:
neither a term nor a count). k = 1 is rank-1 MKOR (K3/K6): one group of every row.
Endpoints: one row per group (k = R) gives K-FAC's A = (1/R) sum_r a a^T and
G = (1/R) sum_r (R g)(R g)^T = R sum_r g g^T (K19, ``reference.baselines.kfac.kfac_factors``);
groups = samples gives K-FAC-reduce (KC5) with empirical columns.

KC8 (Woodbury). With J = L^{-1} (after the stabiliser), U = [v_1 ... v_k'] (d x k') and the
EMA weight w = (1 - rho)/k':

    (rho L + w U U^T)^{-1} = (1/rho) [J - J U (rho/w I_k' + U^T J U)^{-1} U^T J]   ("paper"),

and for the "released" variant, J' = 0.95 J + 0.05 I and weight 1/k':

    (J'^{-1} + (1/k') U U^T)^{-1} = J' - J' U (k' I_k' + U^T J' U)^{-1} U^T J'.

Cost O(k d^2 + k^3): two d x d by d x k products and one k x k solve; no d x d inverse,
solve or decomposition. k' = 1 is K8 / K10 (Sherman-Morrison). The stabiliser (K11/K12) and
the rescale (K14) are rank-1 MKOR's, unchanged. The k x k solve is a parameter so that the
symbolic proofs run this very code on sympy object arrays.
"""
import numpy as np

from reference.mkor.factors import (RELEASED_BLEND, VARIANT_OPTIONS, _check, _exceeds,
                                    _norm_fn, reset_factor, symmetrise)
from reference.mkor.vectors import _append_one, _rows, unfold2d

__all__ = [
    # KC7: groups and their means
    "group_index", "group_means", "linear_group_vectors", "conv2d_group_vectors",
    # KC8: Woodbury updates of the inverse, and the whole factor update
    "woodbury_ema_inverse_update", "woodbury_released_update", "rank_k_inverse_update",
    "rank_k_factor_update",
]


def group_index(n, rank):
    """The group of each of ``n`` rows cut into ``rank`` contiguous groups, with
    ``np.array_split``'s sizes (stated with it, so the two cannot disagree)."""
    index = np.empty(n, dtype=np.int64)
    for j, part in enumerate(np.array_split(np.arange(n), rank)):
        index[part] = j
    return index


def group_means(a_rows, g_rows, rank, has_bias, rows_per_sample=1, mask=None):
    r"""KC7 on rows already in sample order (module docstring).

    Args:
        a_rows: (R, d_in) input rows; g_rows: (R, d_out) rows of the gradient of the loss
            averaged over the real samples.
        rank: k, the number of groups.
        has_bias: append the bias column 1 to a.
        rows_per_sample: L for a Conv2d's patches, 1 for a Linear's rows.
        mask: None or (R,) bool, True for a real row.

    Returns:
        (A_bar (k', d_in'), G_bar (k', d_out)): the means of the k' groups that hold a real
        row, in group order (empty groups dropped).
    """
    a, g = _rows(a_rows), _rows(g_rows)
    if a.shape[0] != g.shape[0]:
        raise ValueError(f"a has {a.shape[0]} rows but g has {g.shape[0]}")
    real = np.ones(a.shape[0], dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    samples = real.sum() / rows_per_sample  # R_g: the real samples
    index = group_index(a.shape[0], rank)
    A, G = [], []
    for j in range(rank):
        members = (index == j) & real
        if not members.any():
            continue  # an empty group has no mean and contributes nothing
        a_mean = a[members].mean(axis=0)
        A.append(_append_one(a_mean) if has_bias else a_mean)
        G.append((samples * g[members]).mean(axis=0))
    width = a.shape[1] + has_bias
    return (np.array(A).reshape(-1, width), np.array(G).reshape(-1, g.shape[1]))


def linear_group_vectors(a, g_out, rank, has_bias, mask=None):
    """KC7 for a Linear layer: ``group_means`` of its rows (every leading dimension
    flattened row-major); ``mask`` has the leading shape of ``a`` (True = real row)."""
    return group_means(a, g_out, rank, has_bias, 1,
                       None if mask is None else np.asarray(mask).reshape(-1))


def conv2d_group_vectors(x, g_out, rank, kernel_size, stride, padding, dilation, has_bias):
    """KC7 for a Conv2d: the rows are the B L patches in sample order (sample-major, then
    output position), R_g = B (K4)."""
    patches = unfold2d(x, kernel_size, dilation=dilation, padding=padding, stride=stride)
    batch, depth, positions = patches.shape
    g_out = np.asarray(g_out, dtype=np.float64)
    a_rows = patches.transpose(0, 2, 1).reshape(batch * positions, depth)
    g_rows = g_out.reshape(batch, g_out.shape[1], -1).transpose(0, 2, 1)
    return group_means(a_rows, g_rows.reshape(batch * positions, -1), rank, has_bias,
                       rows_per_sample=positions)


def _solve(C, B):
    """The k x k solve C^{-1} B (looked up at call time, so a test can watch it)."""
    return np.linalg.solve(C, B)


def woodbury_ema_inverse_update(J, V, stat_decay, solve=None):
    r"""KC8, variant "paper": the exact inverse of the factor EMA with k' = len(V) vectors,

        (rho J^{-1} + ((1-rho)/k') U U^T)^{-1}
            = (1/rho) [J - J U (rho k'/(1-rho) I + U^T J U)^{-1} U^T J],   U = V^T,

    symmetrised. ``V``: (k', d), one group mean per row. k' = 1 is K8."""
    k = V.shape[0]
    Y = J @ V.T                                      # J U, d x k
    C = stat_decay * k / (1 - stat_decay) * np.eye(k, dtype=J.dtype) + V @ Y
    return symmetrise((J - Y @ (solve or _solve)(C, Y.T)) / stat_decay)


def woodbury_released_update(J, V, solve=None):
    r"""KC8, variant "released": J' = 0.95 J + 0.05 I, then

        (J'^{-1} + (1/k') U U^T)^{-1} = J' - J' U (k' I + U^T J' U)^{-1} U^T J',

    symmetrised (``stat_decay`` unused, as in K10). k' = 1 is K10."""
    k = V.shape[0]
    blended = RELEASED_BLEND * J + (1 - RELEASED_BLEND) * np.eye(J.shape[0], dtype=J.dtype)
    Y = blended @ V.T
    C = k * np.eye(k, dtype=J.dtype) + V @ Y
    return symmetrise(blended - Y @ (solve or _solve)(C, Y.T))


def rank_k_inverse_update(J, V, *, variant="paper", stat_decay=0.95):
    """The Woodbury step of a variant (KC8): "paper" or "released"."""
    _check("variant", variant, tuple(VARIANT_OPTIONS))
    if variant == "paper":
        return woodbury_ema_inverse_update(J, V, stat_decay)
    return woodbury_released_update(J, V)


def rank_k_factor_update(J, V, *, variant="paper", stat_decay=0.95, zeta=0.9, threshold=2.0,
                         norm="max_entry", first=False, reset_flag=False,
                         stabilizer_timing=None, stabilizer_reset=None, first_update=None):
    """One factor's update with k' group means ``V`` (k', d): ``factor_update``'s control
    flow (the stabiliser's timing and reset, K11/K12; the first update, K12) with the
    Woodbury step (KC8) in place of Sherman-Morrison. Returns (J_new, fired)."""
    _check("variant", variant, tuple(VARIANT_OPTIONS))
    column = VARIANT_OPTIONS[variant]
    timing = stabilizer_timing or column.stabilizer_timing
    reset = stabilizer_reset or column.stabilizer_reset
    first_mode = first_update or column.first_update
    norm_fn = _norm_fn(norm)
    V = np.asarray(V, dtype=np.float64).reshape(-1, J.shape[0])
    if first and first_mode == "identity":
        return np.eye(J.shape[0]), False
    if timing == "before_sm":
        fired = bool(reset_flag or _exceeds(norm_fn(J), threshold))
        if fired:
            J = reset_factor(J, reset=reset, zeta=zeta)
        return rank_k_inverse_update(J, V, variant=variant, stat_decay=stat_decay), fired
    if reset_flag:
        J_new = reset_factor(J, reset=reset, zeta=zeta)
    else:
        J_new = rank_k_inverse_update(J, V, variant=variant, stat_decay=stat_decay)
    return J_new, _exceeds(norm_fn(J_new), threshold)
