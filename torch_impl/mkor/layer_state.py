"""One preconditioned layer's state and its two operations (K2-K14), kept apart from the
hooks and the schedule in :mod:`.preconditioner`; each operation reads its own record of the
options (:class:`~.config.FactorRule`, :class:`~.config.PreconditionRule`).

State per layer: the inverse factors ``L_inv`` (d_out x d_out) and ``R_inv`` (d_in' x d_in'),
0-d counters ``updates_a``/``updates_g`` (accepted updates), ``non_finite`` (updates refused
because a statistic vector held a NaN or inf), ``overflow`` (updates refused because the
vectors were finite but the updated factor was not), ``no_rows`` (factor updates the layer
sat out because no rows reached it: an MoE expert routed no tokens, on every rank), ``fired``
(stabiliser actions) and the deferred reset flags ``reset_a``/``reset_g``.
Every decision is a ``torch.where`` on 0-d tensors: nothing here synchronises with the device.
"""
import functools
import math

import torch

from .factors import (factor_update, max_entry_norm, needs_stabilising, precondition,
                      rescale)
from .rank_k import rank_k_factor_update
from ..kronecker.factor_storage import store_factor
from ..kronecker.placement import gradients_of

__all__ = ["initial_layer_state", "update_layer_factors", "precondition_layer", "Workspace"]


def initial_layer_state(layer, factor_dtype, device=None):
    """Identity factors and zero counters on ``device`` (default: the layer's); a side the
    size guard leaves at the identity (``layer.identity_L`` / ``identity_R``) stores no
    factor."""
    dev = layer.module.weight.device if device is None else device
    stack = () if layer.experts is None else (layer.kept,)  # a counter per (held) expert
    zero = torch.zeros(stack, dtype=torch.int64, device=dev)
    false = torch.zeros(stack, dtype=torch.bool, device=dev)
    state = {"updates_a": zero.clone(), "updates_g": zero.clone(),
             "reset_a": false.clone(), "reset_g": false.clone(),
             "non_finite": zero.clone(), "overflow": zero.clone(), "no_rows": zero.clone(),
             "fired": zero.clone()}
    if not layer.identity_L:
        state["L_inv"] = _identities(stack, layer.d_out, factor_dtype, dev)
    if not layer.identity_R:
        state["R_inv"] = _identities(stack, layer.d_in, factor_dtype, dev)
    return state


def _identities(stack, d, dtype, device):
    eye = torch.eye(d, dtype=dtype, device=device)
    return eye if not stack else eye.expand(*stack, d, d).clone()


def _per_matrix(flag, J):
    """A per-matrix flag ((E,) for a stack of experts) broadcast against the factors."""
    return flag if J.dim() == 2 or flag.dim() == 0 else flag[..., None, None]


class Workspace:
    """Reusable outputs for the big products of :func:`precondition_layer` and
    :func:`update_layer_factors`: two flat buffers per (dtype, device), grown to the largest
    layer and viewed at each call's shapes. Layers are processed one after another, so one
    pair serves them all (memory: about two of the largest layer's gradients)."""

    def __init__(self):
        self._buffers = {}

    def views(self, shapes, dtype, device):
        """One view per shape (at most two), each on its own buffer, grown when too small."""
        bufs = self._buffers.setdefault((dtype, torch.device(device)), [None, None])
        out = []
        for i, shape in enumerate(shapes):
            n = math.prod(shape)
            if bufs[i] is None or bufs[i].numel() < n:
                bufs[i] = torch.empty(n, dtype=dtype, device=device)
            out.append(bufs[i][:n].view(shape))
        return tuple(out)


def update_layer_factors(s, a_bar, g_bar, present, rule, workspace=None, groups=None,
                         seeds=None):
    """R_inv <- U(R_inv, a_bar), L_inv <- U(L_inv, g_bar) by the factor ``rule``
    (a :class:`~.config.FactorRule`: K8-K12);
    a non-finite vector or result is refused and counted.  ``present``: None when the layer
    has rows, False when it has none (counted in ``no_rows``, nothing else happens), or a
    0-d bool tensor saying whether it has rows (no host sync). With a ``workspace`` the new
    factor is computed in a borrowed buffer and written into the stored one (no allocation).
    ``groups``: None for rank-1 vectors; for rank k (KC7/KC8) ``a_bar`` and ``g_bar`` hold k
    group means as rows ((.., k, d)) and ``groups`` the groups holding a row (k', a 0-d or
    per-expert tensor), and the factors take the Woodbury step. ``seeds``: None (a factor
    narrower than the compute dtype is written rounded to nearest) or {"R_inv": int,
    "L_inv": int}, the LP2 seeds of this update's writes, rounded stochastically (LP1,
    symmetric: :func:`~torch_impl.kronecker.factor_storage.store_factor`; LP5)."""
    if present is False:
        s["no_rows"] = s["no_rows"] + 1
        return
    if present is not None:
        s["no_rows"] = s["no_rows"] + (~present).long()
    cd = rule.compute_dtype
    deferred = rule.stabilizer_timing == "deferred"
    coupled = rule.stabilizer_coupling == "coupled"
    R = s["R_inv"].to(cd) if "R_inv" in s else None
    L = s["L_inv"].to(cd) if "L_inv" in s else None
    if deferred:
        flag_a, flag_g = s["reset_a"], s["reset_g"]
    elif coupled:  # both factors tested before either is touched
        flag_a = flag_g = _any_needs_stabilising([R, L], rule.threshold)
    else:
        flag_a = flag_g = False

    def update(key, J, v, first, flag):
        if J is None:  # an identity side (size guard): nothing to update
            return None, None
        buf = None if workspace is None else workspace.views([J.shape], cd, J.device)[0]
        step = factor_update if groups is None else functools.partial(
            rank_k_factor_update, groups=groups)
        J_new, fired = step(
            J, v, variant=rule.variant, stat_decay=rule.stat_decay, zeta=rule.zeta,
            threshold=rule.threshold, norm=rule.stabilizer_norm,
            stabilizer_timing=rule.stabilizer_timing, stabilizer_reset=rule.stabilizer_reset,
            first_update=rule.first_update, first=first, reset_flag=flag, out=buf)
        # Non-finite statistics (or an overflowing update) never enter a factor; a NaN or
        # inf entry shows in the max-entry norm, so no elementwise isfinite pass is needed.
        finite_v = torch.isfinite(v).all(dim=-1)  # per expert for a stack
        if groups is not None:  # every group mean of the layer (of each expert)
            finite_v = finite_v.all(dim=-1)
        finite_J = torch.isfinite(max_entry_norm(J_new))
        bad_v, bad_J = ~finite_v, finite_v & ~finite_J
        ok = finite_v & finite_J
        if present is not None:
            bad_v, bad_J, ok = present & bad_v, present & bad_J, ok & present
        s["non_finite"] = s["non_finite"] + bad_v.long()
        s["overflow"] = s["overflow"] + bad_J.long()
        keep = _per_matrix(ok, J)
        if buf is not None and s[key].dtype == cd:  # J is the stored factor: update in place
            torch.where(keep, J_new, J, out=s[key])
        else:
            s[key] = store_factor(torch.where(keep, J_new, J), rule.factor_dtype,
                                  None if seeds is None else seeds[key])
        return ok, fired

    ok_a, fired_a = update("R_inv", R, a_bar, s["updates_a"] == 0, flag_a)
    ok_g, fired_g = update("L_inv", L, g_bar, s["updates_g"] == 0, flag_g)
    for ok, fired, counter in ((ok_a, fired_a, "updates_a"), (ok_g, fired_g, "updates_g")):
        if ok is not None:
            s[counter] = s[counter] + ok.long()
            s["fired"] = s["fired"] + (ok & fired).long()
    if deferred:  # a skipped factor keeps its pending flag
        fa = s["reset_a"] if ok_a is None else torch.where(ok_a, fired_a, s["reset_a"])
        fg = s["reset_g"] if ok_g is None else torch.where(ok_g, fired_g, s["reset_g"])
        either = fa | fg
        s["reset_a"], s["reset_g"] = (either, either) if coupled else (fa, fg)


def _any_needs_stabilising(factors, threshold):
    flags = [needs_stabilising(J, threshold) for J in factors if J is not None]
    return flags[0] | flags[1] if len(flags) == 2 else flags[0]


def precondition_layer(layer, s, rule, workspace=None, owner=None):
    """.grad <- s Delta, Delta = L_inv [grad W | grad b] R_inv (K13, K14), in place, by the
    ``rule`` (a :class:`~.config.PreconditionRule`: rescale mode and GEMM dtypes).
    ``workspace``: a :class:`Workspace` lending the two GEMM outputs (none allocated).
    The weight matrix is read and written through the layer type (a transposed view for
    transformers' Conv1D). A bias without a gradient this step (frozen after discovery,
    or unused) takes part in the product as 0 but not in the rescale, so the rescaled
    weight step has exactly the weight gradient's norm. FSDP2-sharded gradients are
    gathered whole, preconditioned, and written back to this rank's rows
    (:mod:`torch_impl.kronecker.placement`);
    with an ``owner`` (rank, group), only that rank gathers and preconditions them."""
    module = layer.module
    weight = module.weight
    if weight.grad is None:
        return
    if weight.grad.is_sparse:
        raise RuntimeError(f"{layer.name}: MKOR does not support sparse gradients")
    with gradients_of(layer, owner) as grads:
        if grads.weight is not None:  # None: another rank owns and computes this layer
            _precondition_gradients(layer, s, rule, workspace, grads)


def _precondition_gradients(layer, s, rule, workspace, grads):
    module = layer.module
    matrix = grads.matrix(layer)
    cd = torch.promote_types(matrix.dtype, rule.compute_dtype)
    grad_W = matrix.to(cd)
    grad_b = None
    bias_grad = grads.bias if layer.has_bias else None
    stack = () if layer.experts is None else (layer.kept,)
    if layer.has_bias:  # an unused bias still owns a column of R
        grad_b = (bias_grad.to(cd) if bias_grad is not None
                  else torch.zeros(*stack, layer.d_out, dtype=cd, device=grad_W.device))
    pd = rule.precondition_dtype or cd  # the two GEMMs may run in bf16/fp16 (rescale stays in cd)
    shape = (*stack, layer.d_out, layer.d_in - layer.has_bias)  # d_in counts the bias column
    work = None if workspace is None else workspace.views([shape, shape], pd, grad_W.device)
    L_inv, R_inv = s.get("L_inv"), s.get("R_inv")
    delta_W, delta_b = precondition(None if L_inv is None else L_inv.to(pd),
                                    None if R_inv is None else R_inv.to(pd), grad_W.to(pd),
                                    None if grad_b is None else grad_b.to(pd), work)
    if pd != cd:
        delta_W = delta_W.to(cd)
        delta_b = None if delta_b is None else delta_b.to(cd)
    # No dtype cast and a view of the gradient: write the result straight into it.
    in_place = grad_W is matrix and (matrix is grads.weight or matrix._base is grads.weight)
    counted_b = bias_grad is not None
    # factors that never took a statistic transform nothing: the raw gradient (per expert)
    seen = (s["updates_a"] + s["updates_g"]) > 0
    delta_W, delta_b = rescale(delta_W, delta_b if counted_b else None, grad_W,
                               grad_b if counted_b else None, rule.rescale,
                               out_W=matrix if in_place else None, gate=seen)
    if not in_place:
        if grads.sharded:
            matrix.copy_(delta_W)
        else:
            layer.type.set_grad_matrix(module, delta_W)
    if counted_b:
        bias_grad.copy_(delta_b)