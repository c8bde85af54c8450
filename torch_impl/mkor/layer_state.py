"""One preconditioned layer's state and its two operations (K2-K14), kept apart from the
hooks and the schedule in :mod:`.preconditioner`.

State per layer: the inverse factors ``L_inv`` (d_out x d_out) and ``R_inv`` (d_in' x d_in'),
0-d counters ``updates_a``/``updates_g`` (accepted updates), ``skipped`` (non-finite updates
refused), ``fired`` (stabiliser actions) and the deferred reset flags ``reset_a``/``reset_g``.
Every decision is a ``torch.where`` on 0-d tensors: nothing here synchronises with the device.
"""
import math

import torch

from .factors import (factor_update, max_entry_norm, needs_stabilising, precondition,
                      rescale)

__all__ = ["initial_layer_state", "update_layer_factors", "precondition_layer", "Workspace"]


def initial_layer_state(layer, factor_dtype):
    """Identity factors and zero counters on the layer's device."""
    dev = layer.module.weight.device
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    false = torch.zeros((), dtype=torch.bool, device=dev)
    return {"L_inv": torch.eye(layer.d_out, dtype=factor_dtype, device=dev),
            "R_inv": torch.eye(layer.d_in, dtype=factor_dtype, device=dev),
            "updates_a": zero.clone(), "updates_g": zero.clone(),
            "reset_a": false.clone(), "reset_g": false.clone(),
            "skipped": zero.clone(), "fired": zero.clone()}


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


def update_layer_factors(s, a_bar, g_bar, present, o, workspace=None):
    """R_inv <- U(R_inv, a_bar), L_inv <- U(L_inv, g_bar) with the options ``o`` (K8-K12);
    a non-finite vector or result is refused and counted.  ``present``: None on one process,
    else a 0-d bool saying whether any rank captured the layer. With a ``workspace`` the new
    factor is computed in a borrowed buffer and written into the stored one (no allocation)."""
    cd = o.compute_dtype
    deferred = o.stabilizer_timing == "deferred"
    coupled = o.stabilizer_coupling == "coupled"
    common = dict(variant=o.variant, gamma=o.stat_decay, zeta=o.zeta,
                  threshold=o.threshold, norm=o.stabilizer_norm,
                  stabilizer_timing=o.stabilizer_timing,
                  stabilizer_reset=o.stabilizer_reset, first_update=o.first_update)
    R, L = s["R_inv"].to(cd), s["L_inv"].to(cd)
    if deferred:
        flag_a, flag_g = s["reset_a"], s["reset_g"]
    elif coupled:  # both factors tested before either is touched
        flag_a = flag_g = needs_stabilising(R, o.threshold) | needs_stabilising(L, o.threshold)
    else:
        flag_a = flag_g = False

    def update(key, J, v, first, flag):
        buf = None if workspace is None else workspace.views([J.shape], cd, J.device)[0]
        J_new, fired = factor_update(J, v, first=first, reset_flag=flag, out=buf, **common)
        # Non-finite statistics (or an overflowing update) never enter a factor; a NaN or
        # inf entry shows in the max-entry norm, so no elementwise isfinite pass is needed.
        ok = torch.isfinite(v).all() & torch.isfinite(max_entry_norm(J_new))
        if present is not None:
            s["skipped"] = s["skipped"] + (present & ~ok).long()
            ok = ok & present
        else:
            s["skipped"] = s["skipped"] + (~ok).long()
        if buf is not None and s[key].dtype == cd:  # J is the stored factor: update in place
            torch.where(ok, J_new, J, out=s[key])
        else:
            s[key] = torch.where(ok, J_new, J).to(o.factor_dtype)
        return ok, fired

    ok_a, fired_a = update("R_inv", R, a_bar, s["updates_a"] == 0, flag_a)
    ok_g, fired_g = update("L_inv", L, g_bar, s["updates_g"] == 0, flag_g)
    s["updates_a"] = s["updates_a"] + ok_a.long()
    s["updates_g"] = s["updates_g"] + ok_g.long()
    s["fired"] = s["fired"] + (ok_a & fired_a).long() + (ok_g & fired_g).long()
    if deferred:  # a skipped factor keeps its pending flag
        fa = torch.where(ok_a, fired_a, s["reset_a"])
        fg = torch.where(ok_g, fired_g, s["reset_g"])
        either = fa | fg
        s["reset_a"], s["reset_g"] = (either, either) if coupled else (fa, fg)


def precondition_layer(layer, s, o, workspace=None):
    """.grad <- s Delta, Delta = L_inv [grad W | grad b] R_inv (K13, K14), in place.
    ``workspace``: a :class:`Workspace` lending the two GEMM outputs (none allocated)."""
    weight, bias = layer.module.weight, layer.module.bias
    if weight.grad is None:
        return
    if weight.grad.is_sparse:
        raise RuntimeError(f"{layer.name}: MKOR does not support sparse gradients")
    cd = torch.promote_types(weight.grad.dtype, o.compute_dtype)
    grad_W = weight.grad.to(cd)
    grad_b = None
    if layer.has_bias:  # a frozen or unused bias still owns a column of R
        grad_b = (bias.grad.to(cd) if bias.grad is not None
                  else torch.zeros(layer.d_out, dtype=cd, device=weight.device))
    pd = o.precondition_dtype or cd  # the two GEMMs may run in bf16/fp16 (rescale stays in cd)
    shape = (layer.d_out, layer.d_in - layer.has_bias)  # d_in counts the bias column
    work = None if workspace is None else workspace.views([shape, shape], pd, grad_W.device)
    delta_W, delta_b = precondition(s["L_inv"].to(pd), s["R_inv"].to(pd), grad_W.to(pd),
                                    None if grad_b is None else grad_b.to(pd), work)
    if pd != cd:
        delta_W = delta_W.to(cd)
        delta_b = None if delta_b is None else delta_b.to(cd)
    in_place = grad_W is weight.grad  # no dtype cast: write the result straight into .grad
    delta_W, delta_b = rescale(delta_W, delta_b, grad_W, grad_b, o.rescale,
                               out_W=weight.grad if in_place else None)
    if not in_place:
        weight.grad.copy_(delta_W)
    if layer.has_bias and bias.grad is not None:
        bias.grad.copy_(delta_b)
