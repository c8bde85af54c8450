"""Orthogonalizers for MARS-Shampoo, in PyTorch (M11, M13); mirrors reference/common/matrix_functions.py.

Both accept a matrix or a batch of same-shape matrices (..., A, B), so that equal-shape
parameters can share one batched call, and a stack of matrices (fused MoE experts, one
(E, A, B) parameter; ``matrix_batch_dims``, issue 31) is orthogonalised matrix by matrix: the
normalisation, the transpose of tall matrices and the iteration are each matrix's own.
"""
import torch

from .sharding import is_dtensor, on_matrices

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(M, steps=5, eps=1e-7, dtype=torch.bfloat16, coefficients=NS_COEFFICIENTS,
                  cast_first=False):
    r"""Quintic Newton-Schulz orthogonalization (M13).

    .. math::
        X_0 = \frac{M}{\|M\|_F + \epsilon},\qquad
        Q = X X^\top,\quad X \leftarrow aX + (bQ + cQ^2)X \quad(\text{``steps`` times}),

    computed in ``dtype`` (``bfloat16`` as the official code; ``float32``/``float64`` for
    accuracy), on the wide orientation (transposed when A > B), returned in M's dtype.
    The normalisation happens in M's dtype and is rounded to ``dtype`` once (the official code
    rounds M first, then divides: the two differ by one rounding of ``dtype``).
    ``cast_first=True`` is the MARS-M authors' order instead: round M to ``dtype``, transpose,
    then normalise in ``dtype``; the result is then returned in ``dtype`` (they add the bf16
    matrix to the parameter).
    A batch (..., A, B) is a stack of independent matrices: each is normalised by its own
    Frobenius norm.  A sharded M (DTensor, e.g. under FSDP2) is orthogonalised as whole
    matrices (``sharding.on_matrices``: on each rank's shard where it holds whole matrices).
    """
    if is_dtensor(M):
        return on_matrices(newton_schulz, M, steps, eps, dtype, coefficients, cast_first)
    if M.dim() > 3:  # baddbmm takes one batch dim
        return over_matrices(newton_schulz, M.dim() - 2, M, steps, eps, dtype, coefficients,
                             cast_first)
    a, b, c = coefficients
    tall = M.size(-2) > M.size(-1)
    if cast_first:
        X = M.to(dtype)
        X = X.mT if tall else X
        X = X / (torch.linalg.matrix_norm(X, keepdim=True) + eps)
    else:
        X = (M / (torch.linalg.matrix_norm(M, keepdim=True) + eps)).to(dtype)
        X = X.mT if tall else X
    mm = torch.addmm if X.dim() == 2 else torch.baddbmm
    for _ in range(steps):  # b Q X + c Q^2 X = (b Q + c Q^2) X: two products with X, not three
        Q = X @ X.mT
        X = mm(X, mm(Q, Q, Q, beta=b, alpha=c), X, beta=a)
    if tall:
        X = X.mT
    return X if cast_first else X.to(M.dtype)


def orthogonalize_svd(M):
    r"""Polar factor :math:`U\,\mathrm{diag}(1[s_i > \tau])\,V^\top` of :math:`M = U\,\mathrm{diag}(s)\,V^\top`
    (M11), with the matrix-rank tolerance :math:`\tau = \max(s)\max(A,B)\,\epsilon_{dtype}`;
    zero maps to zero.  No host synchronisation: the rank test is a mask, not a branch.
    A batch (..., A, B) is a stack of independent matrices (each its own tolerance); a sharded
    M (DTensor, e.g. under FSDP2) is orthogonalised as whole matrices (``sharding.on_matrices``).
    """
    if is_dtensor(M):
        return on_matrices(orthogonalize_svd, M)
    if M.numel() == 0:  # an empty matrix is its own polar factor (and has no max singular value)
        return M.clone()
    U, s, Vh = torch.linalg.svd(M, full_matrices=False)
    tol = s.amax(dim=-1, keepdim=True) * max(M.shape[-2:]) * torch.finfo(M.dtype).eps
    return (U * (s > tol).unsqueeze(-2).to(U.dtype)) @ Vh


def over_matrices(fn, batch_dims, M, *args):
    r"""``fn`` of each matrix of a stack M (``batch_dims`` leading dims, then A x B), for a
    batched ``fn`` that maps (n, A, B) to (n, A', B'): the leading dims are flattened into one,
    ``fn`` runs once on all the matrices, and the result gets them back.  The twin of the
    oracle's explicit loop (``reference.common.matrix_functions.over_matrices``): a batched
    ``fn`` treats each matrix on its own, so the two say the same."""
    if batch_dims == 0:
        return fn(M, *args)
    batch = M.shape[:batch_dims]
    out = fn(M.reshape(-1, *M.shape[batch_dims:]), *args)
    return out.reshape(*batch, *out.shape[1:])
