"""Orthogonalizers for MARS-Shampoo and Muon, in NumPy float64 (M11, M13).

Both map a matrix M = U diag(s) V^T to (approximately) its polar factor U V^T:

* ``orthogonalize_svd`` is the paper's box (M11): exactly U V^T from a thin SVD.
* ``newton_schulz`` is the official code's five-step quintic (M13): cheap, matmul-only,
  and only approximately orthogonal -- its singular values land in [0.640, 1.2024]
  rather than at 1 (see ``theory_tests/common/test_newton_schulz.py`` for the derivation).

``over_matrices`` states what a stack of matrices (MoE experts stored as one (E, A, B)
parameter, issue 31) is to every matrix equation: its matrices, each on its own.
"""
import numpy as np

# (a, b, c) of the quintic p(s) = a s + b s^3 + c s^5, chosen (Jordan 2024) to maximise the
# slope at 0 while keeping the five-fold iterate of (0, 1] inside a band around 1.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(M, steps=5, eps=1e-7, coefficients=NS_COEFFICIENTS):
    r"""Quintic Newton-Schulz orthogonalization (M13).

    X_0 = M / (||M||_F + eps), transposed when A > B so that X X^T is the small Gram matrix;
    then ``steps`` times:  Q = X X^T,  X <- a X + (b Q + c Q^2) X;  transposed back.
    Each step maps every singular value s of X to a s + b s^3 + c s^5 and keeps the vectors.
    """
    a, b, c = coefficients
    M = np.asarray(M, dtype=np.float64)
    X = M / (np.linalg.norm(M) + eps)
    tall = M.shape[0] > M.shape[1]
    if tall:
        X = X.T
    for _ in range(steps):
        Q = X @ X.T
        X = a * X + (b * Q + c * (Q @ Q)) @ X
    return X.T if tall else X


def orthogonalize_svd(M):
    r"""Polar factor of M = U diag(s) V^T (thin SVD), the paper's MARS-Shampoo box (M11).

    Returns U diag(1[s_i > tol]) V^T with tol = max(s) max(A, B) eps_f64 (the matrix-rank
    tolerance): U V^T for full-rank M, the partial isometry onto M's range otherwise, and 0 for
    M = 0 -- so the result never depends on the arbitrary singular vectors of null directions.
    """
    M = np.asarray(M, dtype=np.float64)
    U, s, Vt = np.linalg.svd(M, full_matrices=False)
    keep = s > s.max(initial=0.0) * max(M.shape) * np.finfo(np.float64).eps
    return (U * keep) @ Vt


def quintic(s, coefficients=NS_COEFFICIENTS):
    """The scalar map p(s) = a s + b s^3 + c s^5 that one Newton-Schulz step applies to each
    singular value (the basis of the bounds proved in the tests)."""
    a, b, c = coefficients
    return a * s + b * s**3 + c * s**5


def over_matrices(fn, batch_dims, *stacks):
    r"""A stack of matrices as its matrices: ``fn`` applied to each matrix on its own.

    ``stacks`` share one shape (n_1, ..., n_k, A, B) whose ``batch_dims`` = k leading dims
    index independent A x B matrices; k = 0 is one matrix, ``fn(*stacks)``.  Returns ``out``
    with out[i] = fn(stacks[0][i], stacks[1][i], ...) for every index i of those k dims (a
    tuple of such stacks where ``fn`` returns a tuple).  An explicit loop, so that the oracle
    says it in so many words: the per-tensor clip (M3), Newton-Schulz's normalisation and
    transpose (M13, M16) and the shape scales s = sqrt(max(1, A/B)) (M12) and
    0.2 sqrt(max(A, B)) (M17) hold for each matrix of a stack exactly as for a 2-D parameter.
    """
    if batch_dims == 0:
        return fn(*stacks)
    batch = np.shape(stacks[0])[:batch_dims]
    if not all(n > 0 for n in batch):
        raise ValueError(f"over_matrices: an empty stack {np.shape(stacks[0])} has no matrix")
    outs = single = None
    for i in np.ndindex(*batch):
        result = fn(*(np.asarray(s)[i] for s in stacks))
        if outs is None:
            single = not isinstance(result, tuple)
            outs = [np.empty(batch + np.shape(r)) for r in ((result,) if single else result)]
        for out, r in zip(outs, (result,) if single else result):
            out[i] = r
    return outs[0] if single else tuple(outs)
