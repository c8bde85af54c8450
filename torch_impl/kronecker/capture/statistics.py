"""The per-layer statistics of a :class:`~.capture.Capture`: sums over every forward + backward
pair since the last reset, in the owner's additive form (``input_stat`` / ``grad_stat``).

**Stale statistics.** Statistics committed during a backward are *settled* when that backward
accumulates the layer's ``weight.grad`` (a post-accumulate-grad hook calls :meth:`settle`). If
a later commit, or the step, finds ``weight.grad`` None after statistics were settled, their
gradient was cleared (``zero_grad()`` of the model or the backbone, a skipped step): they are
dropped, so they can never leak into a later step. Nothing depends on whether ``.grad`` exists
at forward time, so a recompute that precedes the first accumulation, or several uses of one
weight, lose nothing. (Gradients zeroed in place, ``set_to_none=False``, cannot be told apart
from accumulation: call the preconditioner's own ``zero_grad`` then.)

**Precision.** Statistics are computed with autocast disabled, in the rows' dtype promoted to
float32 by the owner's functions, so a bf16 forward never produces bf16 factors.
"""
import contextlib

import torch

__all__ = ["LayerStatistics"]


class _Stats:
    """Accumulated statistics of one layer since the last reset. ``settled``: everything
    committed so far has been accumulated into ``weight.grad``."""

    __slots__ = ("pending", "a_sum", "a_count", "g_sum", "g_count", "settled", "flagged",
                 "refused")

    def __init__(self):
        self.pending = []  # grad_hook="module": (input statistic, mask) awaiting a gradient
        self.a_sum = self.g_sum = None
        self.a_count = self.g_count = 0
        self.settled = False
        self.flagged = False  # the self-check refused this step's statistics
        self.refused = None   # a stack: [bool per expert] whose statistics were refused


def _without(x, refused):
    """``x`` (led by the stack's E experts, or an empty identity-side statistic) with the
    ``refused`` experts' entries 0."""
    if x.numel() == 0:  # an identity side stores nothing
        return x
    keep = torch.tensor([not r for r in refused], device=x.device)
    return torch.where(keep.view(-1, *([1] * (x.dim() - 1))), x, 0)


def _add(total, x):
    return x if total is None else total + x


@contextlib.contextmanager
def _plain_arithmetic(device_type):
    """No graph and no autocast: a statistic is data, in the dtype its function chooses."""
    with torch.no_grad(), torch.autocast(device_type, enabled=False):
        yield


class LayerStatistics:
    """The sums of every hooked layer (module docstring).

    Args:
        layers: the :class:`~torch_impl.kronecker.discovery.Layer` list.
        input_stat: ``callable(layer, rows, mask[, experts=]) -> (tensor, count)``: additive
            statistic of one forward's input rows ``(*lead, d_in)``; ``mask`` is None or a bool
            tensor of shape ``lead``; ``experts`` (a stack of experts): each row's expert.
        grad_stat: the same for the output-gradient rows ``(*lead, d_out)``.
    """

    def __init__(self, layers, input_stat, grad_stat):
        self.input_stat = input_stat
        self.grad_stat = grad_stat
        self._by_name = {layer.name: layer for layer in layers}
        self._stats = {layer.name: _Stats() for layer in layers}
        #: {layer name: rows counted at its last capture (an int or a 0-d tensor)}
        self.last_rows = {}

    def input(self, layer, rows, mask, experts=None):
        """The input statistic of one call's rows (``experts``: a stack's rows' experts)."""
        with _plain_arithmetic(rows.device.type):
            if experts is None:
                return self.input_stat(layer, rows.detach(), mask)
            return self.input_stat(layer, rows.detach(), mask, experts=experts)

    def grad(self, layer, g_rows, mask, experts=None):
        """The output-gradient statistic ``(g_stat, g_count)`` of one call's rows."""
        with _plain_arithmetic(g_rows.device.type):
            if experts is None:
                return self.grad_stat(layer, g_rows.detach(), mask)
            return self.grad_stat(layer, g_rows.detach(), mask, experts=experts)

    def stale(self, layer):
        """Whether ``layer``'s sums settled into a gradient that has since been cleared (the
        next :meth:`add` drops them)."""
        st = self._stats[layer.name]
        return st.settled and layer.module.weight.grad is None

    def add(self, layer, a_stat, g_stat):
        """Add one call's ``(a, a_count)`` and ``(g, g_count)`` to ``layer``'s sums, first
        dropping sums whose gradient was cleared since they settled (module docstring)."""
        st = self._stats[layer.name]
        if st.settled and layer.module.weight.grad is None:
            # the gradient the earlier statistics went into was cleared: they are stale
            st.a_sum = st.g_sum = None
            st.a_count = st.g_count = 0
        st.settled = False
        (a, a_count), (g, g_count) = a_stat, g_stat
        st.a_sum, st.a_count = _add(st.a_sum, a), st.a_count + a_count
        st.g_sum, st.g_count = _add(st.g_sum, g), st.g_count + g_count
        self.last_rows[layer.name] = a_count

    def pending(self, name):
        """``grad_hook="module"``: the forwards of ``name`` waiting for their gradient (a
        stack: the last one pairs with the next backward)."""
        return self._stats[name].pending

    def settle(self, names, param):
        """Post-accumulate-grad hook of a weight: the statistics of the layers ``names``
        committed so far went into its ``.grad``."""
        for name in names:
            self._stats[name].settled = True

    def flag(self, name):
        """The self-check refused this step's statistics of ``name``."""
        self._stats[name].flagged = True

    def refuse_experts(self, name, refused):
        """The self-check refused this step's statistics of some experts of the stack
        ``name`` (``refused``: a bool per expert): they count no rows, as a one-Linear-per-
        expert twin whose statistics were refused has none."""
        self._stats[name].refused = refused

    def reset(self):
        """Drop accumulated and pending statistics."""
        for name in self._stats:
            self._stats[name] = _Stats()

    def drop_committed(self):
        """Drop the statistics of completed forward + backward pairs, keeping forwards that
        still wait for their backward."""
        for st in self._stats.values():
            st.a_sum = st.g_sum = None
            st.a_count = st.g_count = 0
            st.settled = False

    def get(self, name, released=()):
        """(a_sum, a_count, g_sum, g_count) of layer ``name``, or None if incomplete,
        stale (settled into a gradient that has since been cleared), refused by the
        self-check, or of a layer the self-check released (in ``released``)."""
        st = self._stats[name]
        if st.a_sum is None or st.g_sum is None or st.flagged or name in released:
            return None
        if st.settled and self._by_name[name].module.weight.grad is None:
            return None
        if st.refused is not None:
            return tuple(_without(x, st.refused) for x in
                         (st.a_sum, st.a_count, st.g_sum, st.g_count))
        return st.a_sum, st.a_count, st.g_sum, st.g_count

    def unpaired(self):
        """Names of layers holding forwards that never received a gradient."""
        return [name for name, st in self._stats.items() if st.pending]
