"""The rows a fused experts forward really multiplied, recorded from the forward itself: the
brute force the recomputed rows of ``torch_impl/kronecker/experts/transformers.py`` are
checked against (issue 45).

:class:`ProductRecorder` is entered by a forward pre-hook on the experts module and left by
its forward hook; while the forward runs it records, below autocast (a ``TorchDispatchMode``:
the operands the kernels really got), every matrix product (``mm``, ``addmm``, ``bmm``,
``_grouped_mm``) and keeps its result, on which a gradient hook then records the gradient
autograd formed the weight's gradient from. :meth:`ProductRecorder.rows` sorts each product
out to a projection and an expert by comparing its weight operand with the module's
parameters (random weights: one expert's matrix equals no other's), so it needs no
knowledge of which experts implementation ran: eager (one product per expert), batched_mm
(one matrix per pair), grouped_mm (one product over the experts' contiguous runs)."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ProductRecorder", "record_products"]

aten = torch.ops.aten
_PRODUCTS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten._grouped_mm.default}


class ProductRecorder(TorchDispatchMode):
    """Records (op, args, result) of every matrix product while entered (module docstring)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _PRODUCTS:
            self.calls.append((func, args, kwargs, out))
        return out

    def hook_gradients(self):
        """A gradient hook on every recorded result (call after the forward)."""
        self.grads = [None] * len(self.calls)
        for i, (_, _, _, out) in enumerate(self.calls):
            if out.requires_grad:
                out.register_hook(lambda g, i=i: self.grads.__setitem__(i, g.detach()))

    def rows(self, projections):
        """{name: {expert: (a, g)}} of every recorded product: ``projections`` is
        [(name, weight parameter, transposed)]; a product whose weight operand is none of
        them (a router's or a shared expert's) is left out."""
        out = {name: {} for name, _, _ in projections}
        for (func, args, kwargs, _), g in zip(self.calls, self.grads):
            if g is None:
                continue
            for e, name, a, g_rows in _split(func, args, kwargs, g, projections):
                rows = out[name].setdefault(e, ([], []))
                rows[0].append(a)
                rows[1].append(g_rows)
        return {name: {e: (torch.cat(a), torch.cat(g)) for e, (a, g) in by_e.items()}
                for name, by_e in out.items()}


def _as_stored(matrix, transposed):
    """One expert's operand as the product used it ((d_in, d_out): rows @ it), in the
    parameter's storage layout."""
    return matrix if transposed else matrix.T


def _which(operand, projections):
    """(name, expert) whose matrix (cast to the operand's dtype) equals this (d_in, d_out)
    operand, or None."""
    for name, weight, transposed in projections:
        w = weight.detach().to(operand.dtype)
        for e in range(w.shape[0]):
            stored = _as_stored(w[e], transposed)
            if stored.shape == operand.shape and torch.equal(stored, operand):
                return name, e
    return None


def _split(func, args, kwargs, g, projections):
    """[(expert, name, a, g)] of one recorded product."""
    if func is aten.mm.default or func is aten.addmm.default:
        x, w = (args[0], args[1]) if func is aten.mm.default else (args[1], args[2])
        found = _which(w, projections)
        return [] if found is None else [(found[1], found[0], x, g)]
    if func is aten.bmm.default:  # batched_mm, one matrix per pair: x (S, 1, d_in) @
        first, second = args       # W_sel (S, d_in, d_out) stored transposed, else
        transposed = first.shape[1] == 1  # W_sel (S, d_out, d_in) @ x (S, d_in, 1)
        out = []
        for i in range(first.shape[0]):
            if transposed:
                x, w, gi = first[i], second[i], g[i]
            else:
                x, w, gi = second[i].T, first[i].T, g[i].T
            found = _which(w, projections)
            if found is not None:
                out.append((found[1], found[0], x, gi))
        return out
    if func is aten._grouped_mm.default:  # x sorted by expert @ W (E, d_in, d_out), offsets
        x, w = args[0], args[1]
        offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
        out, start = [], 0
        for e, end in enumerate(offs.tolist()):
            if end > start:
                found = _which(w[e], projections)
                if found is not None:
                    out.append((found[1], found[0], x[start:end], g[start:end]))
            start = end
        return out
    return []


def record_products(module):
    """Enter a :class:`ProductRecorder` around every forward of ``module``; returns
    (recorder, remove): call ``recorder.hook_gradients()`` after the forward."""
    recorder = ProductRecorder()

    def enter(mod, args, kwargs):
        recorder.__enter__()

    def leave(mod, args, kwargs, output):
        recorder.__exit__(None, None, None)
    handles = [module.register_forward_pre_hook(enter, with_kwargs=True),
               module.register_forward_hook(leave, with_kwargs=True, always_call=True)]
    return recorder, lambda: [h.remove() for h in handles]
