r"""MKOR's per-expert equations on fused mixture-of-experts modules, NumPy float64 (issue 31;
spec MKOR.md K3, K6, K8-K14 and "Mixture-of-experts in transformers 5").

The forward model and its rows are a problem, not an equation: ``reference/common/moe.py``
(``expert_rows`` gives each expert's input and output-gradient rows of both projections).
Preconditioning treats each expert's projection as its own ``nn.Linear`` layer, so every
quantity here is the 2-D oracle's, applied to one expert's rows: rank-1 vectors (K3, K6) by
``linear_rank1_vectors``, factor updates (K8-K12) by ``factor_update``, and preconditioning
with the rescale (K13, K14) by ``precondition`` and ``rescale``. An expert routed no pair has
0 rows: no vector, no factor update (``present`` False). K-FAC's per-expert factors (K19) are
K-FAC's: ``reference/baselines/kfac.py``. Independent of the torch port (NumPy only).
"""
import numpy as np

from reference.common.moe import expert_pairs, linear_layout
from reference.mkor.factors import factor_update, precondition, rescale
from reference.mkor.rank_k import group_means
from reference.mkor.vectors import linear_rank1_vectors

__all__ = [
    # per-expert statistics and updates (K6, K8-K14)
    "expert_rank1_vectors", "expert_group_vectors", "present_stack", "expert_factor_updates",
    "expert_precondition",
]


def expert_rank1_vectors(rows, has_bias, projection=None):
    r"""Each expert's rank-1 vectors (K3, K6), ``linear_rank1_vectors`` on its own rows:

        a_bar_e = (1/n_e) sum_i [a_i | 1],   g_bar_e = (1/n_e) sum_i (n_e g_i) = sum_i g_i

    (so g_bar_e is expert e's bias gradient). ``rows``: (a, g) per expert, or ``expert_rows``'
    dicts with ``projection`` "up" or "down". None for an expert with no rows.
    """
    return [None if a.shape[0] == 0 else linear_rank1_vectors(a, g, has_bias)
            for a, g in expert_pairs(rows, projection)]


def expert_group_vectors(rows, rank, has_bias, projection=None):
    r"""Rank-k MKOR's group means per expert (KC7): each expert's own n_e (real) rows in
    token order -- sample order; ``expert_rows`` lists them slot-major, so its dicts are
    re-ordered by ``tokens`` -- cut into k groups (``group_means``), R_g = n_e. An expert with
    fewer than k rows has one group per row (k' = n_e, the one-row-per-group endpoint: its
    K-FAC factors); one with no rows has None (no update, as for rank 1)."""
    pairs = expert_pairs(rows, projection)
    if rows and isinstance(rows[0], dict):
        orders = [np.argsort(r["tokens"], kind="stable") for r in rows]
        pairs = [(a[order], g[order]) for (a, g), order in zip(pairs, orders)]
    return [None if a.shape[0] == 0 else group_means(a, g, rank, has_bias) for a, g in pairs]


def present_stack(vectors, dim):
    """(V, present): the (E, dim) stack of per-expert vectors (zeros where None) and the (E,)
    bool mask of the experts that have one."""
    present = np.array([v is not None for v in vectors], dtype=bool)
    V = np.zeros((len(vectors), dim))
    for e, v in enumerate(vectors):
        if v is not None:
            V[e] = v
    return V, present


def _per_expert(flag, e):
    return bool(flag[e]) if np.ndim(flag) else bool(flag)


def expert_factor_updates(J_stack, v_stack, present, first=False, reset_flag=False, **options):
    r"""The 2-D factor update (K8-K12, ``factor_update``) of every present expert:

        J_e <- factor_update(J_e, v_e, **options)   if present[e],   J_e unchanged otherwise

    Args:
        J_stack: (E, d, d) the stored inverses; v_stack: (E, d) or a list (None where absent).
        present: (E,) bool, False for an expert routed no rows this step.
        first, reset_flag: a bool for all experts or an (E,) array of per-expert flags.
        options: ``factor_update``'s keywords (variant, stat_decay, zeta, threshold, norm, ...).

    Returns:
        (J_new (E, d, d), fired (E,) bool; False for an absent expert).
    """
    J_stack = np.asarray(J_stack, dtype=np.float64)
    J_new, fired = J_stack.copy(), np.zeros(J_stack.shape[0], dtype=bool)
    for e in range(J_stack.shape[0]):
        if not present[e]:
            continue
        J_new[e], fired[e] = factor_update(
            J_stack[e], np.asarray(v_stack[e], dtype=np.float64),
            first=_per_expert(first, e), reset_flag=_per_expert(reset_flag, e), **options)
    return J_new, fired


def expert_precondition(L_inv_stack, R_inv_stack, grad_W_stack, grad_b_stack=None,
                        mode="joint", transposed=False):
    r"""Every expert preconditioned and rescaled as its own layer (K13, K14):

        Delta_e = L_e^{-1} [grad_W_e | grad_b_e] R_e^{-1},   s_e = ||G_hat_e|| / ||Delta_e||

    (``precondition`` then ``rescale`` with ``mode``; s_e is each expert's own).
    ``grad_W_stack`` is (E, d_out, d_in), or (E, d_in, d_out) with ``transposed`` (the
    result keeps the input's layout). Returns (delta_W stack, delta_b stack or None).
    """
    grad_W_stack = np.asarray(grad_W_stack, dtype=np.float64)
    out_W, out_b = np.empty_like(grad_W_stack), None
    if grad_b_stack is not None:
        grad_b_stack = np.asarray(grad_b_stack, dtype=np.float64)
        out_b = np.empty_like(grad_b_stack)
    for e in range(grad_W_stack.shape[0]):
        grad_W = linear_layout(grad_W_stack[e], transposed)
        grad_b = None if grad_b_stack is None else grad_b_stack[e]
        delta_W, delta_b = precondition(L_inv_stack[e], R_inv_stack[e], grad_W, grad_b)
        delta_W, delta_b = rescale(delta_W, delta_b, grad_W, grad_b, mode=mode)
        out_W[e] = delta_W.T if transposed else delta_W
        if out_b is not None:
            out_b[e] = delta_b
    return out_W, out_b
