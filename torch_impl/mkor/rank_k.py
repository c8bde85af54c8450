r"""Rank-k MKOR in PyTorch (issue 46 item 6; KC7, KC8), mirroring ``reference/mkor/rank_k.py``.

**KC7, additively.** The rows of one capture (one forward call's rows, leading dimensions
flattened row-major) are cut into k contiguous groups with ``torch.tensor_split``'s sizes;
:func:`group_row_sums` gives each group's sum of the real rows and their count, so that the
hooks can add them over calls, micro-batches and ranks like rank-1 MKOR's sums. A group is
therefore *the union over every capture of the step of that capture's j-th piece*: with one
capture (one forward, one backward, one process) exactly KC7's group j; under gradient
accumulation, several calls of a module, or DDP, group j pools the j-th pieces of all of them
(so DDP over P ranks equals one process accumulating the ranks' batches as P micro-batches,
exactly). :func:`vectors_from_group_sums` turns the sums into the group means

    a_bar_j = S^a_j / n_j,     g_bar_j = (sum_j' n_j') S^g_j / (n_j D),

n_j the real rows of group j, S^g_j the sum of its gradient rows divided by the rows per
sample (K4's units: :func:`~.vectors.grad_row_sum`), D the divisor of the gradients (the
ranks P under DDP's averaging, ``grad_accum_steps``, the loss scale). With the loss the mean
over the N real samples, N g_r is row r's own gradient (K3), and (sum n) S^g_j / n_j =
N (sum_{r in j} g_r) / n_j for a Linear (rows = samples) and B (sum_{r in j} g_r) / n_j for a
Conv2d (S^g and n in units of L rows): KC7's mean of R_g g_r. A group with no real row has
n_j = 0: its mean is 0 and it is not counted in k' (``groups``), so it contributes nothing to
(1/k') sum_j v_j v_j^T (a zero column of U adds nothing to U U^T, and in the Woodbury form its
row and column of C are c0 e_j: it decouples exactly).

**KC8.** :func:`rank_k_factor_update` is :func:`~.factors.factor_update`'s affine form with the
Woodbury term: with \hat J = alpha J + beta I (stabiliser, released blend), Y = \hat J U and
C = c0 I_k + U^T Y (c0 = rho k'/(1-rho) "paper", k' "released"), C = L_C L_C^T (Cholesky of the
k x k matrix, no error check: no host sync) and Z = L_C^{-1} Y^T,

    J_t = kappa alpha J + kappa beta I - kappa Z^T Z       (kappa = 1/rho paper, 1 released),

O(k d^2 + k^3), exactly symmetric (Z^T Z is a Gram matrix), never a d x d inverse. A C that
is not positive definite (a NaN) makes J_t NaN, which the caller refuses (``overflow``).
Batched over a leading stack dimension (fused experts): J (E, d, d), V (E, k, d).
"""
import torch

from .factors import RELEASED_BLEND, _Plan

__all__ = [
    "group_index", "group_row_sums", "vectors_from_group_sums", "group_vectors", "group_means",
    "linear_group_vectors", "conv2d_group_vectors", "woodbury_ema_inverse_update",
    "woodbury_released_update", "rank_k_inverse_update", "rank_k_factor_update",
]


def group_index(n, rank, device=None):
    """The group of each of ``n`` rows at positions 0..n-1 cut into ``rank`` contiguous
    groups (``tensor_split`` sizes: the first n mod k groups hold q + 1 = n // k + 1 rows)."""
    return _group_of(torch.arange(n, device=device), n, rank)


def _group_of(position, n, rank):
    """The group of a row at ``position`` among ``n`` rows (an int, or a tensor per row)."""
    q, r = n // rank, n % rank
    long_rows = r * (q + 1)  # rows in the r long groups
    short = q.clamp(min=1) if isinstance(q, torch.Tensor) else max(q, 1)  # q = 0: unused
    return torch.where(position < long_rows, position // (q + 1),
                       r + (position - long_rows) // short)


def _expert_positions(experts, num_experts):
    """Each routed row's position among its expert's rows (in row order) and its expert's
    row count: a stable sort, no loop over experts and no host sync."""
    counts = torch.zeros(num_experts, dtype=torch.long, device=experts.device).index_add_(
        0, experts, torch.ones_like(experts))
    order = torch.sort(experts, stable=True).indices
    start = counts.cumsum(0) - counts
    position = torch.empty_like(experts)
    position[order] = torch.arange(experts.numel(), device=experts.device) - start[experts[order]]
    return position, counts[experts]


def group_row_sums(rows, rank, mask=None, experts=None, num_experts=None):
    r"""(sums, counts) of the real rows of each group (KC7, additive form): rows (*lead, d)
    flattened row-major and cut into ``rank`` groups; ``mask`` (shape ``lead``, True = real)
    keeps padded rows out of their group (replaced by 0, so a non-finite padded row cannot
    leak), which keeps its place in the cut. Shapes (k, d) and (k,). For a stack of experts
    (``experts``: each routed row's expert, rows in token order) each expert's own *real* rows
    are cut, in token order: (E, k, d) and (E, k) -- an expert is its own layer over the real
    tokens routed to it, so a padded pair has no place in its cut (as if never routed, like
    rank 1's twin Linear). Counts are int64."""
    flat = rows.reshape(-1, rows.shape[-1])
    keep = None if mask is None else mask.reshape(-1)
    kept = flat if keep is None else torch.where(keep.unsqueeze(-1), flat, 0)
    ones = (torch.ones(flat.shape[0], dtype=torch.long, device=flat.device) if keep is None
            else keep.long())
    if experts is None:
        index, slots = group_index(flat.shape[0], rank, flat.device), rank
    else:  # a padded pair is routed to a sentinel expert E (dropped): the cut is the real rows'
        routed = experts if keep is None else torch.where(keep, experts, num_experts)
        position, n = _expert_positions(routed, num_experts + 1)
        index, slots = routed * rank + _group_of(position, n, rank), (num_experts + 1) * rank
    sums = flat.new_zeros(slots, flat.shape[-1]).index_add_(0, index, kept)
    counts = torch.zeros(slots, dtype=torch.long, device=flat.device).index_add_(0, index, ones)
    if experts is not None:
        used = num_experts * rank
        return sums[:used].view(num_experts, rank, -1), counts[:used].view(num_experts, rank)
    return sums, counts


def vectors_from_group_sums(a_sums, counts, g_sums, divide=1):
    r"""(A, G, present, groups) from the summed statistics (module docstring): A (.., k, d_in')
    and G (.., k, d_out) the group means (0 for an empty group), ``groups`` = k' the groups
    holding a real row and ``present`` = k' > 0 (per expert for a stack). ``divide``: D."""
    n = counts.to(a_sums.dtype)
    safe = n.clamp(min=1).unsqueeze(-1)
    total = n.sum(dim=-1, keepdim=True).unsqueeze(-1)  # sum_j n_j
    A = a_sums / safe
    G = g_sums * (total / (safe * divide))
    groups = (counts > 0).sum(dim=-1)
    return A, G, groups > 0, groups


def group_vectors(a_stat, g_sum, has_bias, divide=1):
    """(A, G, present, groups) of a rank-k layer from MKOR's summed statistics: the input
    statistic ``a_stat`` (.., k, d_in + 1) holds the group counts as its last column (with a
    bias, that column is the bias column itself), ``g_sum`` (.., k, d_out) the gradient sums
    (:func:`vectors_from_group_sums`)."""
    counts = a_stat[..., -1]
    return vectors_from_group_sums(a_stat if has_bias else a_stat[..., :-1], counts, g_sum,
                                   divide)


def group_means(a_rows, g_rows, rank, has_bias, rows_per_sample=1, mask=None):
    """KC7 on rows in sample order, mirroring the oracle: (A (k, d_in'), G (k, d_out),
    counts (k,)), an empty group's rows 0 with count 0 (the oracle drops them). ``g_rows``:
    the gradient of the loss averaged over the real samples."""
    a_sums, counts = group_row_sums(a_rows, rank, mask)
    if has_bias:
        a_sums = torch.cat([a_sums, counts.unsqueeze(-1).to(a_sums.dtype)], dim=-1)
    g_sums, _ = group_row_sums(g_rows, rank, mask)
    A, G, _, _ = vectors_from_group_sums(a_sums, counts, g_sums / rows_per_sample)
    return A, G, counts


def linear_group_vectors(a, g_out, rank, has_bias, mask=None):
    """KC7 for a Linear layer (:func:`group_means` of its rows)."""
    return group_means(a, g_out, rank, has_bias, 1, mask)


def conv2d_group_vectors(x, g_out, rank, kernel_size, stride, padding, dilation, has_bias):
    """KC7 for a Conv2d: the B L patches in sample order, R_g = B (K4)."""
    patches = torch.nn.functional.unfold(x, kernel_size, dilation=dilation, padding=padding,
                                         stride=stride).transpose(1, 2)
    g_rows = g_out.flatten(2).transpose(1, 2)
    return group_means(patches, g_rows, rank, has_bias, rows_per_sample=patches.shape[1])


def _groups(V, groups):
    if groups is None:
        return V.new_full(V.shape[:-2], float(V.shape[-2]))
    if isinstance(groups, torch.Tensor):
        return groups.to(V.dtype)
    return V.new_full(V.shape[:-2], float(groups))


def _c0(variant, stat_decay, groups):
    """C's diagonal shift: rho/w with w = (1-rho)/k' (paper), 1/w with w = 1/k' (released)."""
    k = groups.clamp(min=1)
    return k * (stat_decay / (1 - stat_decay)) if variant == "paper" else k


def _woodbury_gram(J_hat_V, V, c0):
    """Z with Z^T Z = Y C^{-1} Y^T, Y = \\hat J U (given as ``J_hat_V`` = Y^T, (.., k, d)) and
    C = c0 I + U^T Y: the Cholesky factor of the k x k C, a triangular solve; NaN where C is
    not positive definite (no error check, so no host sync)."""
    k = V.shape[-2]
    C = V @ J_hat_V.transpose(-1, -2)
    C = C + c0[..., None, None] * torch.eye(k, dtype=C.dtype, device=C.device)
    chol, info = torch.linalg.cholesky_ex(C)
    Z = torch.linalg.solve_triangular(chol, J_hat_V, upper=False)
    return torch.where((info == 0)[..., None, None], Z, torch.nan)


def woodbury_ema_inverse_update(J, V, stat_decay, groups=None):
    r"""KC8 "paper": (rho J^{-1} + ((1-rho)/k') V^T V)^{-1} = (J - Z^T Z) / rho."""
    Z = _woodbury_gram(V @ J, V, _c0("paper", stat_decay, _groups(V, groups)))
    return (J - Z.transpose(-1, -2) @ Z) / stat_decay


def woodbury_released_update(J, V, groups=None):
    r"""KC8 "released": J' = 0.95 J + 0.05 I, (J'^{-1} + (1/k') V^T V)^{-1} = J' - Z^T Z."""
    blended = RELEASED_BLEND * J + (1 - RELEASED_BLEND) * torch.eye(
        J.shape[-1], dtype=J.dtype, device=J.device)
    Z = _woodbury_gram(V @ blended, V, _groups(V, groups))
    return blended - Z.transpose(-1, -2) @ Z


def rank_k_inverse_update(J, V, *, variant, stat_decay, groups=None):
    """The Woodbury step of a variant (KC8)."""
    if variant == "paper":
        return woodbury_ema_inverse_update(J, V, stat_decay, groups)
    if variant == "released":
        return woodbury_released_update(J, V, groups)
    raise ValueError(f"variant must be 'paper' or 'released', got {variant!r}")


def _per(x, J, extra):
    """A 0-d or per-matrix (E,) number broadcast against ``extra`` trailing dims."""
    return x if x.dim() == 0 else x.reshape(x.shape + (1,) * extra)


def rank_k_factor_update(J, V, *, variant, stat_decay, zeta, threshold, norm="max_entry",
                         stabilizer_timing=None, stabilizer_reset=None, first_update=None,
                         first=False, reset_flag=False, groups=None, out=None):
    r"""One factor's update with k group means ``V`` (.., k, d): the control flow of
    :func:`~.factors.factor_update` (K11/K12, first update) with KC8's Woodbury step, in its
    affine form J_t = A J + B I - s Z^T Z (module docstring), no host sync. ``groups``: k'
    (a number or a per-matrix tensor; default k). Returns ``(J_t, fired)``; J_t is written
    into ``out`` when given. Mirrors ``reference.mkor.rank_k.rank_k_factor_update``."""
    plan = _Plan(J, variant, zeta, threshold, norm, stabilizer_timing, stabilizer_reset,
                 first_update, reset_flag)
    alpha, beta, scalar = plan.alpha, plan.beta, plan.scalar
    J_hat_V = _per(alpha, J, 2) * (V @ J) + _per(beta, J, 2) * V  # (\hat J U)^T
    Z = _woodbury_gram(J_hat_V, V, _c0(variant, stat_decay, _groups(V, groups)))
    kappa = 1.0 / stat_decay if variant == "paper" else 1.0
    A, B, s = plan.coefficients(kappa * alpha, kappa * beta, scalar(kappa), first)
    # s = 0 (a reset, the first update) drops the Woodbury term, even a NaN one
    Z = torch.where(_per(s, J, 2) > 0, Z * _per(torch.sqrt(s), J, 2), 0)
    J_new = torch.mul(J, _per(A, J, 2), out=out)
    J_new = J_new.baddbmm_(Z.transpose(-1, -2), Z, alpha=-1.0) if J.dim() == 3 else \
        J_new.addmm_(Z.transpose(-1, -2), Z, alpha=-1.0)
    J_new.diagonal(dim1=-2, dim2=-1).add_(_per(B, J, 1))
    return J_new, plan.fired_after(J_new)
