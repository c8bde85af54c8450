r"""MKOR's factor algebra as pure tensor functions (spec MKOR.md K7-K14).

Every function here is O(d^2) in the factor size (mat-vecs and one outer product),
has no host synchronisation (conditions are ``torch.where`` on 0-d tensors), and never
calls a matrix inverse, solve or eigendecomposition. They mirror the NumPy oracle
(``reference/mkor/factors.py``) function for function and
can be timed alone (e.g. ``factor_update`` or ``ema_inverse_update`` for a
complexity benchmark).

Notation: J is a stored *inverse* factor (L^{-1} or R^{-1}), v its rank-1 vector,
``stat_decay`` the factor EMA decay (the spec's gamma, K8), zeta the stabiliser's weight on J,
``threshold`` its epsilon (K12). The hyperparameters keep MKOR's names; none has a default
here: ``MKOR``'s signature is where each default is written.
"""
import torch

from .config import COLUMNS

__all__ = [
    "sherman_morrison", "ema_inverse_update", "released_inverse_update",
    "rank1_inverse_update", "max_entry_norm", "needs_stabilising", "stabilise",
    "reset_factor", "symmetrise", "factor_update", "precondition",
    "rescale", "RELEASED_BLEND", "RELEASED_THRESHOLD",
]

# Hard-coded in the released code (K10, K12): J' = 0.95 J + (1 - 0.95) I, threshold 2 (the
# paper gives no epsilon: MKOR's default ``threshold`` is this one in both variants).
RELEASED_BLEND = 0.95
RELEASED_THRESHOLD = 2.0


def _eye_like(J):
    return torch.eye(J.shape[-1], dtype=J.dtype, device=J.device)


# A stack of factors (E, d, d) -- fused MoE experts, each its own layer -- runs the same
# expressions batched: a per-matrix number (E,) meets a vector through _vec and a matrix
# through _mat. On one (d, d) factor they are the identity, so its arithmetic is unchanged.
def _vec(x, J):
    return x if J.dim() == 2 or x.dim() == 0 else x.unsqueeze(-1)


def _mat(x, J):
    return x if J.dim() == 2 or x.dim() == 0 else x[..., None, None]


def _mv(J, v):
    return J @ v if J.dim() == 2 else (J @ v.unsqueeze(-1)).squeeze(-1)


def _dot(v, u):
    return torch.dot(v, u) if v.dim() == 1 else torch.linalg.vecdot(v, u)


def sherman_morrison(J, v):
    r"""Sherman-Morrison rank-1 update of an inverse (K7).

    .. math:: \mathrm{SM}(J, v) = J - \frac{(Jv)(v^T J)}{1 + v^T J v} = (J^{-1} + v v^T)^{-1}.

    For SPD J the denominator is >= 1 (KT2), so it never divides by a small number.
    """
    Jv = J @ v
    vJ = v @ J
    return J - torch.outer(Jv, vJ) / (1 + torch.dot(v, Jv))


def ema_inverse_update(J, v, stat_decay):
    r"""Exact inverse of the factor EMA, variant ``"paper"`` (K8), symmetrised.

    With J = L_{t-1}^{-1}, \rho = ``stat_decay`` (the spec's \gamma) and
    L_t = \rho L_{t-1} + (1-\rho) v v^T:

    .. math::
        J_t = \frac{1}{\rho}\Big(J - \frac{(1-\rho)\,(Jv)(v^T J)}
                                     {\rho + (1-\rho)\, v^T J v}\Big)
            = \big(\rho J^{-1} + (1-\rho) v v^T\big)^{-1}.
    """
    Jv = J @ v
    vJ = v @ J
    denominator = stat_decay + (1 - stat_decay) * torch.dot(v, Jv)
    return symmetrise((J - (1 - stat_decay) * torch.outer(Jv, vJ) / denominator) / stat_decay)


def released_inverse_update(J, v):
    r"""The released code's update, variant ``"released"`` (K10), symmetrised.

    .. math:: J' = 0.95\,J + 0.05\,I, \qquad J_t = \mathrm{SM}(J', v) = (J'^{-1} + v v^T)^{-1}.

    The blend acts on the *inverse* and the rank-1 weight is 1 (``stat_decay`` unused).
    """
    blended = RELEASED_BLEND * J + (1 - RELEASED_BLEND) * _eye_like(J)
    return symmetrise(sherman_morrison(blended, v))


def rank1_inverse_update(J, v, *, variant, stat_decay):
    """The SM step of a variant: K8 (``"paper"``) or K10 (``"released"``, which ignores
    ``stat_decay``)."""
    if variant == "paper":
        return ema_inverse_update(J, v, stat_decay)
    if variant == "released":
        return released_inverse_update(J, v)
    raise ValueError(f"variant must be 'paper' or 'released', got {variant!r}")


def max_entry_norm(J):
    r"""\max_{ij} |J_{ij}|: the stabiliser's test quantity (K12); a 0-d tensor, one O(d^2) pass
    ((E,), one per matrix, for a stack of E factors).

    As max(-min J, max J) from one ``aminmax`` pass: ``vector_norm(ord=inf)`` measured slower
    on CPU (``figures/bench/README.md``), and ``abs().amax()`` writes a temporary.  NaN
    propagates."""
    # a stack: amin and amax over each matrix (aminmax along a dim measured 700x slower on CPU)
    low, high = torch.aminmax(J) if J.dim() == 2 else (J.amin(dim=(-2, -1)), J.amax(dim=(-2, -1)))
    return torch.maximum(-low, high)


def needs_stabilising(J, threshold, norm="max_entry"):
    """norm(J) > threshold as a 0-d bool tensor; NaN counts as True (unlike the code).
    Only the O(d^2) ``"max_entry"`` norm is offered (the oracle's spectral one is O(d^3))."""
    if norm != "max_entry":
        raise ValueError(f"norm must be 'max_entry' (the only O(d^2) norm), got {norm!r}")
    return ~(max_entry_norm(J) <= threshold)


def stabilise(J, zeta):
    r"""Stabiliser blend (K11): \zeta J + (1 - \zeta) I, a convex combination of SPD matrices."""
    return zeta * J + (1 - zeta) * _eye_like(J)


def reset_factor(J, *, reset="blend", zeta=0.9):
    """The stabiliser's action (K11/K12): blend towards I, or replace by I."""
    if reset == "blend":
        return stabilise(J, zeta)
    if reset == "identity":
        return _eye_like(J)
    raise ValueError(f"stabilizer_reset must be 'blend' or 'identity', got {reset!r}")


def symmetrise(J):
    r"""(J + J^T)/2: removes the round-off asymmetry SM updates accumulate (spec 2.5)."""
    return (J + J.transpose(-1, -2)) / 2


def _as_flag(flag, like):
    # torch.full is a device-side fill: a Python bool never costs a host-to-device copy.
    if isinstance(flag, torch.Tensor):
        return flag
    return torch.full((), bool(flag), dtype=torch.bool, device=like.device)


class _Plan:
    """The control flow one factor update shares with its rank-k twin
    (:func:`~.rank_k.rank_k_factor_update`): the options (left None: the ``variant``'s
    column, :data:`~.config.COLUMNS`) validated, the stabiliser's flag, \\hat J's coefficients
    \\hat J = \\alpha J + \\beta I (the released blend included), and, given the update's affine
    form J_t = A J + B I - w (...), the reset and first-update overrides of (A, B, w) and the
    flag the update returns. Every condition is a ``torch.where`` on 0-d (or per-matrix)
    tensors: no host sync."""

    def __init__(self, J, variant, zeta, threshold, norm, stabilizer_timing, stabilizer_reset,
                 first_update, reset_flag):
        column = COLUMNS.get(variant)
        if column is None:
            raise ValueError(f"variant must be 'paper' or 'released', got {variant!r}")
        timing = stabilizer_timing or column["stabilizer_timing"]
        reset = stabilizer_reset or column["stabilizer_reset"]
        first_mode = first_update or column["first_update"]
        if timing not in ("before_sm", "deferred"):
            raise ValueError(f"stabilizer_timing must be 'before_sm' or 'deferred', got {timing!r}")
        if reset not in ("blend", "identity"):
            raise ValueError(f"stabilizer_reset must be 'blend' or 'identity', got {reset!r}")
        if first_mode not in ("sm", "identity"):
            raise ValueError(f"first_update must be 'sm' or 'identity', got {first_mode!r}")
        scalar = lambda x: J.new_full((), x)  # noqa: E731  (a device-side fill, no copy)
        alpha_r, beta_r = (zeta, 1.0 - zeta) if reset == "blend" else (0.0, 1.0)
        flag = _as_flag(reset_flag, J)
        fired = None
        if timing == "before_sm":  # \hat J = reset(J) when the stabiliser fires, else J
            fired = flag | needs_stabilising(J, threshold, norm)
            alpha = torch.where(fired, scalar(alpha_r), scalar(1.0))
            beta = torch.where(fired, scalar(beta_r), scalar(0.0))
        else:
            alpha, beta = scalar(1.0), scalar(0.0)
        if variant == "released":  # K10's blend of the inverse, J' = 0.95 \hat J + 0.05 I
            alpha, beta = RELEASED_BLEND * alpha, RELEASED_BLEND * beta + (1 - RELEASED_BLEND)
        self.J, self.threshold, self.norm, self.scalar = J, threshold, norm, scalar
        self.timing, self.first_mode, self.reset_to = timing, first_mode, (alpha_r, beta_r)
        self.flag, self.fired, self.alpha, self.beta = flag, fired, alpha, beta
        self.is_first = None

    def coefficients(self, A, B, w, first):
        """(A, B, w) of J_t = A J + B I - w (...) with a deferred reset (J_t = reset(J), the
        update dropped) and the first update's identity (J_t = I) applied."""
        scalar, (alpha_r, beta_r), flag = self.scalar, self.reset_to, self.flag
        if self.timing == "deferred":  # a flagged factor is reset instead of updated
            A = torch.where(flag, scalar(alpha_r), A)
            B = torch.where(flag, scalar(beta_r), B)
            w = torch.where(flag, scalar(0.0), w)
        if self.first_mode == "identity":  # the first update sets J = I and drops v
            self.is_first = is_first = _as_flag(first, self.J)
            A = torch.where(is_first, scalar(0.0), A)
            B = torch.where(is_first, scalar(1.0), B)
            w = torch.where(is_first, scalar(0.0), w)
        return A, B, w

    def fired_after(self, J_new):
        """The stabiliser flag the update returns: before the step ("before_sm") or of J_t
        ("deferred"), never on the first update's identity."""
        fired = (needs_stabilising(J_new, self.threshold, self.norm)
                 if self.timing == "deferred" else self.fired)
        return fired & ~self.is_first if self.first_mode == "identity" else fired


def factor_update(J, v, *, variant, stat_decay, zeta, threshold, norm="max_entry",
                  stabilizer_timing=None, stabilizer_reset=None, first_update=None,
                  first=False, reset_flag=False, out=None):
    r"""One factor's whole update (ALG lines 5-8; K8, K10, K11, K12). No host sync.

    ``stabilizer_timing="before_sm"`` (paper):

    .. math::
        f = r \lor \|J\| > \varepsilon, \qquad
        \hat J = f\ ?\ \mathrm{reset}(J) : J, \qquad J_t = \mathrm{step}(\hat J, v)

    ``"deferred"`` (released code): J_t = r ? reset(J) : step(J, v) (v dropped on a
    reset), and f = \|J_t\| > \varepsilon flags the factor for the *next* update.
    Here r is ``reset_flag``, reset() is the blend \zeta J + (1-\zeta)I or I, step() is
    :func:`rank1_inverse_update`, and NaN norms count as exceeding. With
    ``first_update="identity"`` and ``first``, J_t = I and f = False (v dropped).

    Every case is one affine map of J: with \hat J = \alpha J + \beta I and u = \hat J v,

    .. math::
        J_t = \kappa\alpha\, J + \kappa\beta\, I - w\, u u^T,\qquad
        (\kappa, w) = \Big(\frac1\rho, \frac{1-\rho}{\rho(\rho + (1-\rho) v^T u)}\Big)
        \text{ (K8)},\quad \Big(1, \frac1{1 + v^T u}\Big) \text{ (K10)},

    so the update reads J once for J v and once to write J_t (plus one max-entry pass), and
    never materialises \hat J, the identity or a blend (\rho = ``stat_decay``).  ``-w u u^T`` is applied as
    ``-a a^T`` with a = \sqrt{w} u, which keeps J_t exactly symmetric (w >= 0 for SPD J).

    ``first`` and ``reset_flag`` may be Python bools or 0-d bool tensors. Options left
    None take the ``variant``'s column (spec section 4; :data:`~.config.COLUMNS`). Returns
    ``(J_t, f)`` with f a 0-d bool tensor; J_t is written into ``out`` when given (a buffer
    shaped like J, not J).
    Mirrors ``reference.mkor.factors.factor_update``.
    """
    plan = _Plan(J, variant, zeta, threshold, norm, stabilizer_timing, stabilizer_reset,
                 first_update, reset_flag)
    alpha, beta, scalar = plan.alpha, plan.beta, plan.scalar
    u = _vec(alpha, J) * _mv(J, v) + _vec(beta, J) * v
    q = _dot(v, u)
    if variant == "paper":
        kappa = 1.0 / stat_decay
        w = (1 - stat_decay) / (stat_decay * (stat_decay + (1 - stat_decay) * q))
    else:
        kappa, w = 1.0, 1.0 / (1 + q)
    A, B, w = plan.coefficients(kappa * alpha, kappa * beta, w, first)
    a = u * _vec(torch.sqrt(w), J)
    if J.dim() == 2:
        J_new = torch.mul(J, A, out=out).addr_(a, a, alpha=-1.0)
    else:  # each matrix minus its own a a^T
        J_new = torch.mul(J, _mat(A, J), out=out).baddbmm_(
            a.unsqueeze(-1), a.unsqueeze(-2), alpha=-1.0)
    J_new.diagonal(dim1=-2, dim2=-1).add_(_vec(B, J))
    return J_new, plan.fired_after(J_new)


def precondition(L_inv, R_inv, grad_W, grad_b=None, work=None):
    r"""Kronecker preconditioning (K13, ALG line 9).

    .. math:: \hat G = [\nabla W \,|\, \nabla b] \in \mathbb{R}^{d_{out}\times d_{in}'},
              \qquad \Delta = L^{-1} \hat G R^{-1},

    with conv weights in the (C_out, C_in*kh*kw) layout of ``unfold2d``. Returns
    (Delta_W shaped like grad_W, Delta_b or None). ``work``: optional pair of
    (d_out, d_in) buffers that receive the weight blocks of \hat G R^{-1} and Delta, so a
    step allocates no matrix (on CPU a fresh 4 MB tensor costs ~1,000 page faults).
    """
    if any(F is not None and F.dim() == 3 for F in (L_inv, R_inv)):
        return _precondition_stack(L_inv, R_inv, grad_W, grad_b)
    d_out = grad_W.shape[0]
    G = grad_W.reshape(d_out, -1)
    X, D = work if work is not None else (None, None)
    if L_inv is None or R_inv is None:  # a side left at the identity (size guard)
        return _one_sided(L_inv, R_inv, G, grad_b, D, grad_W.shape)
    if grad_b is None:
        X = torch.mm(G, R_inv, out=X)
        return torch.mm(L_inv, X, out=D).reshape(grad_W.shape), None
    # [G | b] R^{-1} without concatenating: with R^{-1} = [[R11, r12], [r21^T, r22]],
    # the weight block is G R11 + b r21^T and the bias column G r12 + r22 b. (One GEMM
    # against R^{-1}[:d, :] would give both, but a d x (d+1) output measured slower on CPU
    # than a d x d one plus the mat-vec: figures/bench/README.md.)
    d = G.shape[1]
    X = torch.mm(G, R_inv[:d, :d], out=X).addr_(grad_b.reshape(-1), R_inv[d, :d])
    x_b = torch.addmv(R_inv[d, d] * grad_b.reshape(-1), G, R_inv[:d, d])
    return (torch.mm(L_inv, X, out=D).reshape(grad_W.shape),
            (L_inv @ x_b).reshape(grad_b.shape))


def _precondition_stack(L_inv, R_inv, grad_W, grad_b):
    r"""precondition() of a stack of experts, each its own layer: \Delta_e = L_e^{-1}
    [
abla W_e | 
abla b_e] R_e^{-1}, batched (one product per shape for all E), the bias
    column joined to the weight columns (E small matrices, so no block trick)."""
    G = grad_W if grad_b is None else torch.cat([grad_W, grad_b.unsqueeze(-1)], dim=-1)
    if R_inv is not None:
        G = G @ R_inv
    if L_inv is not None:
        G = L_inv @ G
    if grad_b is None:
        return G, None
    return G[..., :-1], G[..., -1]


def _one_sided(L_inv, R_inv, G, grad_b, out, shape):
    """precondition() with one factor the identity: L^{-1} Ghat or Ghat R^{-1}."""
    if L_inv is None and R_inv is None:
        return G.clone().reshape(shape), None if grad_b is None else grad_b.clone()
    if R_inv is None:
        return (torch.mm(L_inv, G, out=out).reshape(shape),
                None if grad_b is None else L_inv @ grad_b.reshape(-1))
    d = G.shape[1]
    if grad_b is None:
        return torch.mm(G, R_inv, out=out).reshape(shape), None
    W = torch.mm(G, R_inv[:d, :d], out=out).addr_(grad_b.reshape(-1), R_inv[d, :d])
    return W.reshape(shape), torch.addmv(R_inv[d, d] * grad_b.reshape(-1), G, R_inv[:d, d])


def rescale(delta_W, delta_b, grad_W, grad_b=None, mode="joint", out_W=None, gate=None):
    r"""Norm-preserving rescale of the preconditioned step (K14, ALG line 10).

    .. math::
        s = \frac{\|[\nabla W | \nabla b]\|_F}{\|[\Delta W | \Delta b]\|_F} \ (\text{joint}),
        \qquad
        s = \frac{\|\nabla W\|_F + \|\nabla b\|_2}{\|\Delta W\|_F + \|\Delta b\|_2}
            \ (\text{sum\_of\_norms}),

    output (s Delta_W, s Delta_b), computed in place in Delta. Zero guard (KT6), as the
    oracle: when the gradient norm is 0 or the update norm is 0 or not finite, the raw
    gradient is returned, so nothing here produces NaN or inf. All tests are
    ``torch.where`` on 0-d tensors (no host sync). ``out_W`` (may be ``grad_W`` itself)
    receives the weight block, so no matrix is allocated. ``gate`` (engine, not paper): a
    bool tensor (per expert for a stack), False where the raw gradient must be returned
    (a layer whose factors have taken no statistic yet).
    """
    has_b = grad_b is not None
    if grad_W.dim() == 3:  # a stack of experts: one s per expert
        return _rescale_stack(delta_W, delta_b, grad_W, grad_b, mode, out_W, gate)
    if mode == "joint":
        grad_norm = torch.linalg.vector_norm(grad_W).square()
        delta_norm = torch.linalg.vector_norm(delta_W).square()
        if has_b:
            grad_norm = grad_norm + torch.linalg.vector_norm(grad_b).square()
            delta_norm = delta_norm + torch.linalg.vector_norm(delta_b).square()
        grad_norm, delta_norm = grad_norm.sqrt(), delta_norm.sqrt()
    elif mode == "sum_of_norms":
        grad_norm = torch.linalg.vector_norm(grad_W)
        delta_norm = torch.linalg.vector_norm(delta_W)
        if has_b:
            grad_norm = grad_norm + torch.linalg.vector_norm(grad_b)
            delta_norm = delta_norm + torch.linalg.vector_norm(delta_b)
    else:
        raise ValueError(f"rescale mode must be 'joint' or 'sum_of_norms', got {mode!r}")
    usable = (grad_norm != 0) & (delta_norm > 0) & torch.isfinite(delta_norm)
    if gate is not None:
        usable = usable & gate
    # A safe denominator keeps the branch where() discards free of 0/0.
    s = grad_norm / torch.where(usable, delta_norm, torch.ones_like(delta_norm))
    # A finite ||Delta|| means every entry of Delta is finite, and |s Delta_i| <= ||grad||, so
    # s Delta cannot overflow: ``usable`` is the whole guard (no per-entry isfinite pass).
    out_W = torch.where(usable, delta_W.mul_(s), grad_W, out=out_W)
    out_b = torch.where(usable, delta_b.mul_(s), grad_b) if has_b else None
    return out_W, out_b


def _rescale_stack(delta_W, delta_b, grad_W, grad_b, mode, out_W, gate=None):
    """rescale() of each expert of a stack with its own norms (the same rule and guard)."""
    def norm(x, dims):
        return torch.linalg.vector_norm(x, dim=dims)
    has_b = grad_b is not None
    if mode not in ("joint", "sum_of_norms"):
        raise ValueError(f"rescale mode must be 'joint' or 'sum_of_norms', got {mode!r}")
    joint = mode == "joint"
    grad_norm = norm(grad_W, (-2, -1)).square() if joint else norm(grad_W, (-2, -1))
    delta_norm = norm(delta_W, (-2, -1)).square() if joint else norm(delta_W, (-2, -1))
    if has_b:
        grad_norm = grad_norm + (norm(grad_b, -1).square() if joint else norm(grad_b, -1))
        delta_norm = delta_norm + (norm(delta_b, -1).square() if joint else norm(delta_b, -1))
    if joint:
        grad_norm, delta_norm = grad_norm.sqrt(), delta_norm.sqrt()
    usable_e = (grad_norm != 0) & (delta_norm > 0) & torch.isfinite(delta_norm)
    if gate is not None:
        usable_e = usable_e & gate
    s = grad_norm / torch.where(usable_e, delta_norm, torch.ones_like(delta_norm))
    out_W = torch.where(usable_e[:, None, None], delta_W * s[:, None, None], grad_W, out=out_W)
    out_b = torch.where(usable_e[:, None], delta_b * s[:, None], grad_b) if has_b else None
    return out_W, out_b
