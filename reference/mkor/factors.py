"""MKOR factor inverses: Sherman-Morrison updates, the stabiliser (MKOR.md 2.2-2.3), and
preconditioning and rescaling with them (K13, K14).

MKOR stores only the inverses J = L^{-1} (left, from g_bar) and J = R^{-1} (right,
from a_bar) and updates them in O(d^2) with rank-1 Sherman-Morrison steps (K7). Three
versions of that step exist and they differ:

* "paper" (K8): the exact inverse of the factor EMA L_t = rho L_{t-1} + (1-rho) v v^T.
* "released" (K10): what the authors' code runs, J' = 0.95 J + 0.05 I, then SM(J', v).
* Algorithm 1 line 7 as printed (K9): not an inverse; kept only for tests.

rho is the factor EMA decay, MKOR's ``stat_decay`` (the spec's gamma; named apart from
MARS's gamma). Every function here works elementwise through ``@``/``np.outer``, so it accepts float
arrays and also NumPy object arrays of sympy symbols (the symbolic proofs run the same
code). No function here calls an O(d^3) routine except ``spectral_norm``.
"""
from dataclasses import dataclass, replace

import numpy as np

# Hard-coded in the released code (K10, K12); named here so they are not magic numbers.
RELEASED_BLEND = 0.95
RELEASED_THRESHOLD = 2.0


def symmetrise(J):
    """(J + J^T) / 2: both variants are symmetric in exact arithmetic (section 2.5)."""
    return (J + J.T) / 2


def sherman_morrison(J, v):
    r"""Sherman-Morrison rank-1 update of an inverse (K7).

        SM(J, v) = J - (J v)(v^T J) / (1 + v^T J v) = (J^{-1} + v v^T)^{-1}

    The denominator is >= 1 whenever J is positive semi-definite (KT2).
    """
    Jv = J @ v
    vJ = v @ J
    return J - np.outer(Jv, vJ) / (1 + v @ Jv)


def ema_inverse_update(J, v, stat_decay):
    r"""Variant "paper": exact inverse of the factor EMA (K8).

    With J = L_{t-1}^{-1} (after stabilisation) and L_t = rho L_{t-1} + (1-rho) v v^T:

        J_t = (1/rho) (J - (1-rho) J v v^T J / (rho + (1-rho) v^T J v))

    which equals SM(J/rho, sqrt(1-rho) v) = (rho J^{-1} + (1-rho) v v^T)^{-1}.
    The output is symmetrised, (J_t + J_t^T)/2.
    """
    Jv = J @ v
    vJ = v @ J
    denominator = stat_decay + (1 - stat_decay) * (v @ Jv)
    return symmetrise((J - (1 - stat_decay) * np.outer(Jv, vJ) / denominator) / stat_decay)


def released_inverse_update(J, v):
    r"""Variant "released": the authors' code (K10).

        J' = 0.95 J + 0.05 I,    J_t = SM(J', v) = (J'^{-1} + v v^T)^{-1}

    0.95/0.05 are hard-coded there and ``stat_decay`` is unused; the rank-1 weight is 1.
    This blends the *inverse* with I; it is not an EMA of the factor. Symmetrised.
    """
    blended = RELEASED_BLEND * J + (1 - RELEASED_BLEND) * np.eye(J.shape[0])
    return symmetrise(sherman_morrison(blended, v))


def printed_algorithm1_update(J, v, stat_decay):
    r"""Algorithm 1, line 7, exactly as printed (K9). NEVER USE THIS TO TRAIN.

        J_t = rho J + (1-rho) / (rho^2 (1 + rho (1-rho) v^T J v)) J v v^T J

    It is not the inverse of rho J^{-1} + (1-rho) v v^T (a + where a - belongs, and
    misplaced rhos); the correct formula is ``ema_inverse_update``. Kept only so the
    tests can show the difference.
    """
    Jv = J @ v
    rho = stat_decay
    coefficient = (1 - rho) / (rho**2 * (1 + rho * (1 - rho) * (v @ Jv)))
    return rho * J + coefficient * np.outer(Jv, v @ J)


def max_entry_norm(J):
    """max_ij |J_ij|: the released code's stabiliser test (K12). O(d^2)."""
    return float(np.max(np.abs(J)))


def spectral_norm(J):
    """Largest singular value ||J||_2, an alternative stabiliser norm (section 4).

    This is an O(d^3) SVD; the factor update stays O(d^2) only with "max_entry".
    """
    return float(np.linalg.norm(J, 2))


NORMS = {"max_entry": max_entry_norm, "spectral": spectral_norm}


def stabilise(J, zeta):
    r"""The paper's stabiliser blend (K11): zeta J + (1 - zeta) I.

    zeta is the weight on J (the code's ``stabilization_factor`` is 1 - zeta). A convex
    combination of SPD matrices, so SPD is kept for zeta in [0, 1].
    """
    return zeta * J + (1 - zeta) * np.eye(J.shape[0])


def _check(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


@dataclass(frozen=True)
class FactorOptions:
    """Per-factor choices where the paper and the released code differ (section 4).

    stabilizer_timing: "before_sm" (paper, Alg. 1 lines 5-6: test, blend, then SM in the
        same update) or "deferred" (code: test after the SM step; a flagged factor is
        reset at the *next* update instead of being SM-updated, K12).
    stabilizer_reset: "blend" (zeta J + (1-zeta) I, paper) or "identity" (J <- I, what
        the released code actually does, K12).
    first_update: "sm" (SM step from J_0 = I, paper) or "identity" (code: the first
        update sets J = I and drops that step's vector, K12).
    """

    stabilizer_timing: str = "before_sm"
    stabilizer_reset: str = "blend"
    first_update: str = "sm"

    def __post_init__(self):
        _check("stabilizer_timing", self.stabilizer_timing, ("before_sm", "deferred"))
        _check("stabilizer_reset", self.stabilizer_reset, ("blend", "identity"))
        _check("first_update", self.first_update, ("sm", "identity"))


# The two columns of section 4's table, per factor.
VARIANT_OPTIONS = {
    "paper": FactorOptions("before_sm", "blend", "sm"),
    "released": FactorOptions("deferred", "identity", "identity"),
}


def _exceeds(value, threshold):
    """value > threshold, but NaN counts as exceeding (the code's `NaN > 2` is False)."""
    return not value <= threshold


def _norm_fn(norm):
    if callable(norm):
        return norm
    _check("norm", norm, tuple(NORMS))
    return NORMS[norm]


def rank1_inverse_update(J, v, *, variant="paper", stat_decay=0.95):
    """Dispatch to the SM step of a variant: K8 ("paper") or K10 ("released")."""
    _check("variant", variant, tuple(VARIANT_OPTIONS))
    if variant == "paper":
        return ema_inverse_update(J, v, stat_decay)
    return released_inverse_update(J, v)


def reset_factor(J, *, reset="blend", zeta=0.9):
    """The stabiliser's action (K11/K12): blend towards I, or replace by I."""
    return stabilise(J, zeta) if reset == "blend" else np.eye(J.shape[0])


def factor_update(J, v, *, variant="paper", stat_decay=0.95, zeta=0.9, threshold=2.0,
                  norm="max_entry", options=None, first=False, reset_flag=False,
                  stabilizer_timing=None, stabilizer_reset=None, first_update=None):
    r"""One factor's whole update in paper order (K8/K10 with K11/K12).

    "before_sm" timing (paper, Algorithm 1 lines 5-8):
        if norm(J) > threshold (NaN counts) or reset_flag:  J <- stabilise(J)   (K11)
        J <- SM step of the variant                                  (K8 or K10)
        fired = whether the stabiliser acted in this call.

    "deferred" timing (released code, K12):
        if reset_flag:  J <- reset(J), and v is dropped (no SM step)
        else:           J <- SM step of the variant
        fired = norm(J_new) > threshold (NaN counts as True), i.e. "flag this factor for the next update";
        the caller stores it and passes it back as ``reset_flag`` (and couples a and g
        if it wants the code's behaviour).

    ``first`` with first_update="identity": return (I, False) and drop v.

    Args:
        J: the stored inverse (d x d), symmetric positive definite.
        v: this update's rank-1 vector (a_bar for R^{-1}, g_bar for L^{-1}).
        variant: "paper" or "released"; also picks the default ``options``.
        stat_decay: rho (only "paper" uses it).
        zeta: weight on J in the blend reset.
        threshold: the stabiliser's threshold on ``norm`` (code: 2).
        norm: "max_entry" (default, O(d^2)), "spectral" (O(d^3)) or a callable.
        options: a FactorOptions; None means VARIANT_OPTIONS[variant].
        stabilizer_timing, stabilizer_reset, first_update: override single fields of
            ``options`` (the torch port's keyword style); None keeps them.
        first: whether this is the factor's first update.
        reset_flag: a stabiliser request from outside (a deferred flag, or the other
            factor of the layer under coupling).

    Returns:
        (J_new, fired).
    """
    _check("variant", variant, tuple(VARIANT_OPTIONS))
    options = VARIANT_OPTIONS[variant] if options is None else options
    overrides = {"stabilizer_timing": stabilizer_timing, "stabilizer_reset": stabilizer_reset,
                 "first_update": first_update}
    overrides = {name: value for name, value in overrides.items() if value is not None}
    if overrides:
        options = replace(options, **overrides)
    norm_fn = _norm_fn(norm)
    if first and options.first_update == "identity":
        return np.eye(J.shape[0]), False
    if options.stabilizer_timing == "before_sm":
        fired = bool(reset_flag or _exceeds(norm_fn(J), threshold))
        if fired:
            J = reset_factor(J, reset=options.stabilizer_reset, zeta=zeta)
        return rank1_inverse_update(J, v, variant=variant, stat_decay=stat_decay), fired
    if reset_flag:
        J_new = reset_factor(J, reset=options.stabilizer_reset, zeta=zeta)
    else:
        J_new = rank1_inverse_update(J, v, variant=variant, stat_decay=stat_decay)
    return J_new, _exceeds(norm_fn(J_new), threshold)


def needs_stabilising(J, threshold=2.0, norm="max_entry"):
    """The stabiliser's test alone, norm(J) > threshold (K11/K12); NaN counts as True."""
    return _exceeds(_norm_fn(norm)(J), threshold)


# ---------------------------------------------------------------- preconditioning (K13, K14)

def precondition(L_inv, R_inv, grad_W, grad_b=None):
    r"""Kronecker-factored preconditioning (K13; Algorithm 1 line 9).

        G_hat = [grad_W.reshape(d_out, -1) | grad_b],    Delta = L^{-1} G_hat R^{-1}

    then Delta is split back into a weight part with grad_W's shape (conv weights
    (out, in, kh, kw) use the (out, in*kh*kw) layout, matching ``unfold2d``) and a
    bias column.

    Returns:
        (delta_W, delta_b); delta_b is None when grad_b is None.
    """
    grad_W = np.asarray(grad_W, dtype=np.float64)
    d_out = grad_W.shape[0]
    G_hat = grad_W.reshape(d_out, -1)
    if grad_b is not None:
        G_hat = np.concatenate([G_hat, np.reshape(grad_b, (d_out, 1))], axis=1)
    delta = L_inv @ G_hat @ R_inv
    if grad_b is None:
        return delta.reshape(grad_W.shape), None
    return delta[:, :-1].reshape(grad_W.shape), delta[:, -1].copy()


def _norm(W, b, mode):
    """||[W|b]||_F ("joint") or ||W||_F + ||b||_2 ("sum_of_norms")."""
    w_norm = float(np.linalg.norm(np.ravel(W)))
    b_norm = 0.0 if b is None else float(np.linalg.norm(np.ravel(b)))
    if mode == "joint":
        return float(np.hypot(w_norm, b_norm))
    if mode == "sum_of_norms":
        return w_norm + b_norm
    raise ValueError(f"rescale mode must be 'joint' or 'sum_of_norms', got {mode!r}")


def rescale(delta_W, delta_b, grad_W, grad_b=None, mode="joint"):
    r"""Rescale the preconditioned step to the gradient's norm (K14; Alg. 1 line 10).

        "joint" (project default):  s = ||[grad_W | grad_b]||_F / ||[dW | db]||_F
        "sum_of_norms" (code):      s = (||grad_W||_F + ||grad_b||_2) / (||dW||_F + ||db||_2)

    and returns (s dW, s db). Degenerate cases return the gradient unchanged, never NaN:
    a zero gradient (nothing to scale to), and a zero or non-finite Delta or s with a
    nonzero gradient (the preconditioner lost the direction, so there is no meaningful
    scale; the code keeps the raw gradient when s is NaN and does not handle inf).
    """
    grad_norm = _norm(grad_W, grad_b, mode)
    delta_norm = _norm(delta_W, delta_b, mode)
    if grad_norm == 0.0 or not (0.0 < delta_norm < np.inf):
        return grad_W, grad_b
    s = grad_norm / delta_norm
    if not np.isfinite(s):
        return grad_W, grad_b
    # A finite but huge s can still overflow an entry; detect that instead of warning.
    with np.errstate(over="ignore"):
        scaled_W = s * np.asarray(delta_W)
        scaled_b = None if delta_b is None else s * np.asarray(delta_b)
    if not (np.all(np.isfinite(scaled_W)) and (scaled_b is None or np.all(np.isfinite(scaled_b)))):
        return grad_W, grad_b
    return scaled_W, scaled_b
