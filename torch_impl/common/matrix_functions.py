"""Orthogonalizers for MARS-Shampoo and MARS-M, in PyTorch (M11, M13, M13a-M13c); mirrors
reference/common/matrix_functions.py.

Each accepts a matrix or a batch of same-shape matrices (..., A, B), so that equal-shape
parameters share one batched call (``sharding.orthogonalize_by_shape``), and a stack of matrices (fused
MoE experts, one (E, A, B) parameter; ``matrix_batch_dims``, issue 31) is orthogonalised
matrix by matrix: the normalisation, the transpose of tall matrices and the iteration are each
matrix's own.  ``newton_schulz`` takes a per-step coefficient schedule (``ns_schedule``: the
authors' quintic or Polar Express's); ``gram_newton_schulz`` runs the same iteration on the
small Gram matrix.
"""
import math

import torch

from .sharding import is_dtensor, on_matrices

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_SCHEDULES = ("authors", "polar_express")

# Polar Express (Amsel et al., arXiv 2505.16932, Algorithm 1): the greedy minimax quintics for
# singular values in [1e-3, 1], as the paper lists them (the oracle derives them from their
# definition: reference.common.matrix_functions.polar_express_coefficients); the last is the
# limit every later step takes.  PE_SAFETY: each but the limit is evaluated at x / 1.01.
POLAR_EXPRESS_COEFFICIENTS = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
PE_SAFETY = 1.01


def ns_schedule(coefficients, steps):
    r"""(M13a) The (a_k, b_k, c_k) of each of ``steps`` Newton-Schulz steps, a tuple.

    ``coefficients``: one triple (every step: ``torch.optim.Muon``'s ``ns_coefficients``), a
    sequence of triples (step k takes the k-th, the last repeats), ``"authors"``
    (``NS_COEFFICIENTS``) or ``"polar_express"``: the paper's polynomials, each but the limit
    one evaluated at x / 1.01, and the first once more -- the paper's normalisation by
    1.01 ||M||_F folded into it, so that the normalisation stays M / (||M||_F + eps).
    """
    if isinstance(coefficients, str):
        if coefficients == "authors":
            return (tuple(NS_COEFFICIENTS),) * steps
        if coefficients == "polar_express":
            return tuple(_polar_express_step(k) for k in range(steps))
        raise ValueError(f"ns_coefficients: expected one of {NS_SCHEDULES}, a triple (a, b, c) "
                         f"or a sequence of triples, got {coefficients!r}")
    try:
        flat = len(coefficients) == 3 and all(not hasattr(x, "__len__") for x in coefficients)
        triples = [tuple(float(x) for x in t) for t in ([coefficients] if flat else coefficients)]
    except TypeError:
        triples = []
    if not triples or any(len(t) != 3 for t in triples):
        raise ValueError(f"ns_coefficients: expected (a, b, c) triples, got {coefficients!r}")
    return tuple(triples[min(k, len(triples) - 1)] for k in range(steps))


def _polar_express_step(k):
    a, b, c = POLAR_EXPRESS_COEFFICIENTS[min(k, len(POLAR_EXPRESS_COEFFICIENTS) - 1)]
    if k >= len(POLAR_EXPRESS_COEFFICIENTS) - 1:
        return a, b, c
    t = PE_SAFETY * (PE_SAFETY if k == 0 else 1.0)
    return a / t, b / t**3, c / t**5


def newton_schulz(M, steps=5, eps=1e-7, dtype=torch.bfloat16, coefficients=NS_COEFFICIENTS,
                  cast_first=False):
    r"""Quintic Newton-Schulz orthogonalization (M13).

    .. math::
        X_0 = \frac{M}{\|M\|_F + \epsilon},\qquad
        Q = X X^\top,\quad X \leftarrow a_k X + (b_k Q + c_k Q^2)X \quad(k = 0, \dots,
        \text{steps} - 1),

    with (a_k, b_k, c_k) from ``ns_schedule(coefficients, steps)`` (one triple: every step);

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
    schedule = ns_schedule(coefficients, steps)
    tall = M.size(-2) > M.size(-1)
    if cast_first:
        X = M.to(dtype)
        X = X.mT if tall else X
        X = X / (torch.linalg.matrix_norm(X, keepdim=True) + eps)
    else:
        X = (M / (torch.linalg.matrix_norm(M, keepdim=True) + eps)).to(dtype)
        X = X.mT if tall else X
    mm = torch.addmm if X.dim() == 2 else torch.baddbmm
    for a, b, c in schedule:  # b Q X + c Q^2 X = (b Q + c Q^2) X: two products with X, not three
        Q = X @ X.mT
        X = mm(X, mm(Q, Q, Q, beta=b, alpha=c), X, beta=a)
    if tall:
        X = X.mT
    return X if cast_first else X.to(M.dtype)


def gram_restarts(steps):
    """(M13b) The steps before which ``gram_newton_schulz`` rebuilds X and X X^T: a first
    block of two steps, then blocks of three (2, 5, 8, ...)."""
    return tuple(range(2, steps, 3))


def gram_flops(rows, cols, steps, restarts=None):
    r"""(M13b) Multiply-adds of the standard and the Gram iteration on an A x B matrix, in
    units of n^3 (n = min(A, B), alpha = max(A, B) / n), as ``(standard, gram)``: per step
    2 alpha + 1; per restart block of r steps 2 alpha + 4r - 3 (the oracle's docstring)."""
    n, big = min(rows, cols), max(rows, cols)
    alpha = big / n if n else 0.0
    restarts = gram_restarts(steps) if restarts is None else restarts
    edges = [0] + [k for k in restarts if 0 < k < steps] + [steps]
    blocks = [hi - lo for lo, hi in zip(edges, edges[1:]) if hi > lo]
    return steps * (2 * alpha + 1), sum(2 * alpha + 4 * r - 3 for r in blocks)


def gram_pays(rows, cols, steps, restarts=None):
    """(M13b) Whether the Gram iteration costs fewer flops than the standard one (for the
    default restarts: an aspect ratio above 1.5)."""
    standard, gram = gram_flops(rows, cols, steps, restarts)
    return min(rows, cols) > 0 and gram < standard


def shifted_gram(X, shift, scale=None, restart=False):
    """(M13b) Y = X X^T (times ``scale``^2, the normalisation, when given) lifted by
    s ||Y||_F I for the first block, s ||Y||_F / sqrt(n) I at a ``restart`` (n x n Y; the
    oracle's docstring says why), s = ``shift``: the Gram matrix a block starts from."""
    Y = X @ X.mT if scale is None else (X @ X.mT) * scale.square()
    lift = torch.linalg.matrix_norm(Y) / (math.sqrt(Y.size(-1)) if restart else 1.0)
    Y.diagonal(dim1=-2, dim2=-1).add_(shift * lift.unsqueeze(-1))
    return Y


def gram_newton_schulz(M, steps=5, eps=1e-7, dtype=torch.bfloat16, coefficients=NS_COEFFICIENTS,
                       cast_first=False, restarts=None, shift=None):
    r"""(M13b) ``newton_schulz`` through the n x n Gram matrix (n = min(A, B)).

    .. math::
        Y_0 = X_0 X_0^\top + s\,\|X_0 X_0^\top\|_F I,\quad R_0 = I,\qquad
        H_k = a_k I + b_k Y_k + c_k Y_k^2,\quad R_{k+1} = H_k R_k,\quad
        Y_{k+1} = H_k Y_k H_k,

    and X = R X_0 formed only before each step of ``restarts`` (default ``gram_restarts``:
    X <- R X, Y <- X X^T, R <- I) and at the end: two rectangular products per block instead
    of two per step.  X_0 = M / (||M||_F + eps) enters only through Y_0 and R X_0, so the
    normalisation is applied to n x n matrices.  The shift s (``shift``; ``None``: the unit
    roundoff of ``dtype``, 2^-8 for bf16) covers the round-off E of X X^T rounded to
    ``dtype`` (|E_ij| <= s |Y_ij|): every Gram matrix formed from X is lifted
    (``shifted_gram``), Y_0 by the worst case s ||Y_0||_F, a restart's by s ||Y||_F / sqrt(n),
    and stays positive definite, where a rounded X X^T of a low-rank or ill-conditioned X has
    negative eigenvalues that the next steps' slopes (8.1^2 per step for Polar Express, 3.4^2
    for the authors') blow up to inf (measured: paper_notes/orthogonalisation.md).
    Restarts bound R's conditioning.  Computed in ``dtype``; ``cast_first`` and the returned
    dtype as ``newton_schulz``.  A matrix where the Gram form costs no fewer flops
    (``gram_pays``: nearly square) runs ``newton_schulz``.
    """
    if is_dtensor(M):
        return on_matrices(gram_newton_schulz, M, steps, eps, dtype, coefficients, cast_first,
                           restarts, shift)
    restarts = gram_restarts(steps) if restarts is None else tuple(restarts)
    if not gram_pays(M.size(-2), M.size(-1), steps, restarts):
        return newton_schulz(M, steps, eps, dtype, coefficients, cast_first)
    if M.dim() > 3:
        return over_matrices(gram_newton_schulz, M.dim() - 2, M, steps, eps, dtype,
                             coefficients, cast_first, restarts, shift)
    schedule = ns_schedule(coefficients, steps)
    shift = torch.finfo(dtype).eps / 2 if shift is None else shift
    X = M.to(dtype)
    scale = 1.0 / (torch.linalg.matrix_norm(X if cast_first else M, keepdim=True) + eps)
    scale = scale.to(dtype)  # 1 / (||M||_F + eps), one per matrix
    X = X.mT if M.size(-2) > M.size(-1) else X
    mm = torch.addmm if X.dim() == 2 else torch.baddbmm
    Y, R = shifted_gram(X, shift, scale), None
    for k, (a, b, c) in enumerate(schedule):
        if k in restarts:
            X = (R * scale) @ X
            Y, R, scale = shifted_gram(X, shift, restart=True), None, torch.ones_like(scale)
        H = mm(Y, Y, Y, beta=b, alpha=c)
        H.diagonal(dim1=-2, dim2=-1).add_(a)
        R = H if R is None else H @ R
        if k + 1 < steps and k + 1 not in restarts:
            Y = H @ Y @ H
    X = (R * scale) @ X
    if M.size(-2) > M.size(-1):
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


def over_matrices(fn, matrix_batch_dims, M, *args):
    r"""``fn`` of each matrix of a stack M (``matrix_batch_dims`` leading dims, then A x B),
    for a batched ``fn`` that maps (n, A, B) to (n, A', B'): the leading dims are flattened
    into one, ``fn`` runs once on all the matrices, and the result gets them back.  The twin of
    the oracle's explicit loop (``reference.common.matrix_functions.over_matrices``): a batched
    ``fn`` treats each matrix on its own, so the two say the same."""
    if matrix_batch_dims == 0:
        return fn(M, *args)
    batch = M.shape[:matrix_batch_dims]
    out = fn(M.reshape(-1, *M.shape[matrix_batch_dims:]), *args)
    return out.reshape(*batch, *out.shape[1:])
