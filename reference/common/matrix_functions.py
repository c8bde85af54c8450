"""Orthogonalizers for MARS-Shampoo and Muon, in NumPy float64 (M11, M13, M13a-M13c).

All map a matrix M = U diag(s) V^T to (approximately) its polar factor U V^T:

* ``orthogonalize_svd`` is the paper's box (M11): exactly U V^T from a thin SVD.
* ``newton_schulz`` is the official code's five-step quintic (M13): cheap, matmul-only,
  and only approximately orthogonal -- its singular values land in [0.640, 1.2024]
  rather than at 1 (see ``theory_tests/common/test_newton_schulz.py`` for the derivation).
  Its coefficients may be a per-step schedule (M13a, ``ns_schedule``): the authors' triple at
  every step, or Polar Express's minimax polynomials (Amsel et al., arXiv 2505.16932),
  derived here from their definition (``optimal_quintic``, ``polar_express_coefficients``).
* ``gram_newton_schulz`` (M13b) is the same iteration on the small Gram matrix X X^T:
  two rectangular products per restart block instead of two per step (paper appendix F).

``over_matrices`` states what a stack of matrices (MoE experts stored as one (E, A, B)
parameter, issue 31) is to every matrix equation: its matrices, each on its own.
"""
import numpy as np

# (a, b, c) of the quintic p(s) = a s + b s^3 + c s^5, chosen (Jordan 2024) to maximise the
# slope at 0 while keeping the five-fold iterate of (0, 1] inside a band around 1.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_SCHEDULES = ("authors", "polar_express")  # the named schedules of ``ns_schedule``

# Polar Express's offline stage (paper section 4.4 and appendix G): singular values of the
# normalised matrix are assumed in [PE_LOWER, 1] (bf16's resolution); early polynomials are
# made on [max(l, PE_CUSHION u), u] (less oscillatory, Chen & Chow); each but the limit
# polynomial is evaluated at x / PE_SAFETY (room for round-off above the upper bound).
PE_LOWER, PE_CUSHION, PE_SAFETY = 1e-3, 0.02407327424182761, 1.01


def newton_schulz(M, steps=5, eps=1e-7, coefficients=NS_COEFFICIENTS):
    r"""Quintic Newton-Schulz orthogonalization (M13).

    X_0 = M / (||M||_F + eps), transposed when A > B so that X X^T is the small Gram matrix;
    then for k = 0, ..., steps - 1:  Q = X X^T,  X <- a_k X + (b_k Q + c_k Q^2) X;  transposed
    back, with (a_k, b_k, c_k) the k-th triple of ``ns_schedule(coefficients, steps)``.
    Step k maps every singular value s of X to a_k s + b_k s^3 + c_k s^5 and keeps the vectors.
    """
    M = np.asarray(M, dtype=np.float64)
    X = M / (np.linalg.norm(M) + eps)
    tall = M.shape[0] > M.shape[1]
    if tall:
        X = X.T
    for a, b, c in ns_schedule(coefficients, steps):
        Q = X @ X.T
        X = a * X + (b * Q + c * (Q @ Q)) @ X
    return X.T if tall else X


def ns_schedule(coefficients, steps):
    r"""(M13a) The (a_k, b_k, c_k) of each of ``steps`` Newton-Schulz steps.

    ``coefficients`` is one triple (every step, as ``torch.optim.Muon``'s ``ns_coefficients``),
    a sequence of triples (step k takes the k-th; the last repeats), ``"authors"`` (the
    official quintic, ``NS_COEFFICIENTS``) or ``"polar_express"`` (``polar_express_coefficients``).
    """
    if isinstance(coefficients, str):
        if coefficients == "authors":
            return (tuple(NS_COEFFICIENTS),) * steps
        if coefficients == "polar_express":
            return polar_express_coefficients(steps)
        raise ValueError(f"ns_coefficients: expected one of {NS_SCHEDULES}, a triple (a, b, c) "
                         f"or a sequence of triples, got {coefficients!r}")
    try:  # one triple of numbers, or a sequence of triples
        flat = len(coefficients) == 3 and all(np.ndim(x) == 0 for x in coefficients)
        triples = [tuple(float(x) for x in t) for t in ([coefficients] if flat else coefficients)]
    except TypeError:
        triples = []
    if not triples or any(len(t) != 3 for t in triples):
        raise ValueError(f"ns_coefficients: expected (a, b, c) triples, got {coefficients!r}")
    return tuple(triples[min(k, len(triples) - 1)] for k in range(steps))


def optimal_quintic(lower, upper):
    r"""(M13c) The odd quintic p(x) = a x + b x^3 + c x^5 that minimises
    max_{x in [l, u]} |1 - p(x)| (Polar Express's per-step problem, paper section 4.2).

    At the optimum 1 - p equioscillates: p(l) = 1 - E, p(q) = 1 + E, p(r) = 1 - E,
    p(u) = 1 + E, with q < r the interior critical points (p'(q) = p'(r) = 0).  Remez's exchange
    solves those four equations for (a, b, c, E) with q, r fixed, then moves q, r to the roots of
    p' = a + 3b x^2 + 5c x^4 (a quadratic in x^2), until E settles.  As l -> u the system
    degenerates and the optimum tends to the degree-5 Newton-Schulz polynomial of 1/u,
    (15 (x/u) - 10 (x/u)^3 + 3 (x/u)^5) / 8, taken once l/u >= 1 - 5e-6.
    """
    if not 0 < lower <= upper:
        raise ValueError(f"optimal_quintic: need 0 < lower <= upper, got {lower}, {upper}")
    if lower / upper >= 1 - 5e-6:
        return 15 / 8 / upper, -10 / 8 / upper**3, 3 / 8 / upper**5
    q, r = lower + (upper - lower) / 4, upper - (upper - lower) / 4
    error = None
    for _ in range(100):
        nodes = np.array([lower, q, r, upper])
        system = np.column_stack([nodes, nodes**3, nodes**5, [1.0, -1.0, 1.0, -1.0]])
        a, b, c, new_error = np.linalg.solve(system, np.ones(4))
        x2 = (-3 * b + np.array([-1.0, 1.0]) * np.sqrt(9 * b * b - 20 * a * c)) / (10 * c)
        q, r = np.sqrt(x2)
        if error is not None and abs(new_error - error) <= 1e-15:
            break
        error = new_error
    return float(a), float(b), float(c)


def polar_express_coefficients(steps, lower=PE_LOWER, cushion=PE_CUSHION, safety=PE_SAFETY):
    r"""(M13c) Polar Express's schedule for ``steps`` steps, from its definition (appendix G).

    Greedy on the interval [l_k, u_k] that holds the singular values before step k, from
    [``lower``, 1]: p_k = ``optimal_quintic``(max(l_k, cushion u_k), u_k), rescaled by
    2 / (p_k(l_k) + p_k(u_k)) so that [l_k, u_k] maps onto [l_{k+1}, u_{k+1}] = [p_k(l_k),
    2 - p_k(l_k)], centred on 1; once l_k / u_k >= 1 - 5e-6 the interval has collapsed onto 1 and
    every further step takes the limit polynomial (15/8, -10/8, 3/8), as the paper lists it.
    Then the paper's finite-precision guard: every polynomial but the limit one is evaluated
    at x / ``safety``, and the first once more -- the paper's normalisation by ``safety``
    ||M||_F folded into it, so that the iteration keeps the authors' M / (||M||_F + eps).
    """
    lo, hi, out = lower, 1.0, []
    for k in range(steps):
        if lo / hi >= 1 - 5e-6:  # collapsed onto 1: the limit polynomial, as the paper lists it
            out.append((15 / 8, -10 / 8, 3 / 8))
            continue
        a, b, c = optimal_quintic(max(lo, cushion * hi), hi)
        t = 2 / (quintic(lo, (a, b, c)) + quintic(hi, (a, b, c)))
        a, b, c = a * t, b * t, c * t
        lo = quintic(lo, (a, b, c))
        hi = 2 - lo
        for _ in range(1 + (k == 0)):
            a, b, c = a / safety, b / safety**3, c / safety**5
        out.append((a, b, c))
    return tuple(out)


def gram_restarts(steps):
    """(M13b) The steps before which ``gram_newton_schulz`` rebuilds X and X X^T: a first
    block of two steps, then blocks of three (2, 5, 8, ...)."""
    return tuple(range(2, steps, 3))


def gram_flops(rows, cols, steps, restarts=None):
    r"""(M13b) Multiply-adds of the standard and the Gram iteration on an A x B matrix, in
    units of n^3 (n = min(A, B), alpha = max(A, B) / n), as ``(standard, gram)``.

    Standard: each step Q = X X^T, Q^2 and (bQ + cQ^2) X: (2 alpha + 1).  Gram, per block of
    r steps: X X^T at its start and R X at its end (2 alpha), and per step Y^2 (1), R <- H R
    (1, not at a block's first step) and Y <- H Y H (2, not at its last): 2 alpha + 4r - 3.
    """
    n, big = min(rows, cols), max(rows, cols)
    alpha = big / n if n else 0.0
    restarts = gram_restarts(steps) if restarts is None else restarts
    edges = [0] + [k for k in restarts if 0 < k < steps] + [steps]
    blocks = [hi - lo for lo, hi in zip(edges, edges[1:]) if hi > lo]
    return steps * (2 * alpha + 1), sum(2 * alpha + 4 * r - 3 for r in blocks)


def gram_pays(rows, cols, steps, restarts=None):
    """(M13b) Whether the Gram iteration costs fewer flops than the standard one
    (``gram_flops``): for the default restarts, when the aspect ratio exceeds 1.5."""
    standard, gram = gram_flops(rows, cols, steps, restarts)
    return min(rows, cols) > 0 and gram < standard


def shifted_gram(X, shift, restart=False):
    """(M13b) The Gram matrix ``gram_newton_schulz`` starts a block from, Y = X X^T lifted
    by a multiple of I: s ||Y||_F for the first block (the worst case of Y's round-off,
    ||E||_2 <= s ||Y||_F, since X_0 may be low rank), s ||Y||_F / sqrt(n) at a ``restart``
    (s times the root mean square of Y's n eigenvalues: the typical round-off there, where
    the worst case costs accuracy); s = ``shift``."""
    Y = X @ X.T
    lift = np.linalg.norm(Y) / (np.sqrt(len(Y)) if restart else 1.0)
    return Y + shift * lift * np.eye(len(Y))


def gram_newton_schulz(M, steps=5, eps=1e-7, coefficients=NS_COEFFICIENTS, restarts=None,
                       shift=None):
    r"""(M13b) Newton-Schulz through the Gram matrix (Polar Express appendix F).

    Step k of ``newton_schulz`` is X <- H_k X with H_k = a_k I + b_k Y + c_k Y^2, Y = X X^T,
    and H_k is a polynomial in Y, so that X_k = R_k X_0 and Y_k = R_k Y_0 R_k^T with
    R_{k+1} = H_k R_k and Y_{k+1} = H_k Y_k H_k: the iteration runs on n x n matrices, and
    X = R X is formed only at a restart (before each step of ``restarts``, default
    ``gram_restarts``: X <- R X, Y <- X X^T, R <- I) and at the end.  Restarts keep R's
    conditioning bounded.  Every Y formed from X (the first and each restart's) is shifted
    (``shifted_gram``: by s ||Y_0||_F, then s ||Y||_F / sqrt(n)) with s = ``shift``
    (``None``: the unit roundoff of the iteration's dtype, float64's here), which covers the
    round-off of a low-precision X X^T and keeps it positive definite.  A matrix where the
    Gram form costs no fewer flops (``gram_pays``) takes ``newton_schulz`` instead.  In exact
    arithmetic and at s = 0 the two iterations agree.
    """
    M = np.asarray(M, dtype=np.float64)
    schedule = ns_schedule(coefficients, steps)
    restarts = gram_restarts(steps) if restarts is None else tuple(restarts)
    if not gram_pays(*M.shape, steps, restarts):
        return newton_schulz(M, steps, eps, schedule)
    shift = np.finfo(np.float64).eps / 2 if shift is None else shift
    X = M / (np.linalg.norm(M) + eps)
    tall = M.shape[0] > M.shape[1]
    if tall:
        X = X.T
    eye = np.eye(X.shape[0])
    Y, R = shifted_gram(X, shift), eye
    for k, (a, b, c) in enumerate(schedule):
        if k in restarts:
            X = R @ X
            Y, R = shifted_gram(X, shift, restart=True), eye
        H = a * eye + b * Y + c * (Y @ Y)
        R = H @ R
        if k + 1 < steps and k + 1 not in restarts:
            Y = H @ Y @ H
    X = R @ X
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
    singular value (the basis of the bounds proved in the tests; one triple)."""
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
