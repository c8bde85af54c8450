r"""Averaging MKOR's rank-1 vectors (and K-FAC's factors) over data-parallel ranks
(spec MKOR.md 2.7).

**What is sent.** On a factor-update step every rank packs, for each preconditioned layer
m in discovery order, the *sums* behind its vectors: :math:`\sum_i [a_i | 1]` over its
rows (d_in' values) then :math:`\sum_i g_i` (d_out values), into one flat buffer and
calls ``all_reduce(SUM)`` on it once. The buffer holds

.. math::
    \textstyle\sum_m (d'_{in,m} + d_{out,m}) \;+\; \#\{m : m \text{ has no bias}\}

values. The second term is the row count of each bias-free layer. A layer with a bias
needs no extra value: the last entry of its input sum is the sum of the bias column's
constant input 1 over the rows, which *is* the row count. After the SUM every rank holds
the union's sums and row count, so

.. math::
    \bar a = \frac{\sum_r \sum_{i \in r} [a_i | 1]}{\sum_r n_r}, \qquad
    \bar g = \frac1P \sum_r \sum_{i \in r} g_i ,

exactly one process's vectors on the union of the batches: the mean over the rows that
exist (a rank where the layer had no rows, an MoE expert routed no tokens there,
contributes zeros and a count of 0, never a 0/0), and the gradient sum of the
rank-averaged loss, which is what DDP's gradient averaging (a division by P) makes of
each rank's mean loss. A layer with no rows on any rank comes back with count 0 and is
left untouched ("no rows"). ``ReduceOp.AVG`` is not used: gloo lacks it.
``average="double"`` divides both vectors by P once more, reproducing the released code's
bug (the rank-1 term scaled by 1/P^2), for differential tests only. (:class:`Packet` also
offers the older mean-of-means packing, ``sums=False``, with each item's count of
contributing ranks.)

**Volume.** ``Packet.nbytes`` = values x itemsize per rank per factor update: O(d) per
layer. (A ring all-reduce puts 2(P-1)/P of that on each rank's link.) K-FAC's factor
all-reduce, packed the same way, holds sum_m (d_in'^2 + d_out^2) (+ counts): O(d^2).

**Reduced precision** (``comm_dtype`` float16 / bfloat16, unit roundoff u = 2^-11 / 2^-8).
Each rank's values are rounded once to the wire dtype and the backend sums the P terms in
that dtype, so with :math:`\gamma_P = Pu/(1-Pu)`

.. math::
    |\widehat{\text{mean}} - \text{mean}| \le \gamma_P \cdot \tfrac1P \textstyle\sum_r |v_r|
    \;(+\,2^{-24} \text{ for float16 values in its subnormal range}),

and a value beyond float16's range (65504) becomes inf, after which MKOR skips that
factor update (counted in ``counters()[name]["non_finite"]``); bfloat16 has float32's range. The
counts are exact integers only up to 2^11 (float16) / 2^8 (bfloat16) ranks; more ranks
raise ``ValueError``.
"""
import torch
import torch.distributed as dist

from .capture import Capture

__all__ = ["world_size", "Packet", "Reduction", "VectorExchange", "OverlapCapture"]

_EXACT_COUNTS = {torch.float16: 2 ** 11, torch.bfloat16: 2 ** 8,
                 torch.float32: 2 ** 24, torch.float64: 2 ** 53}


def world_size(group=None):
    """Number of ranks in ``group``, 1 when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    return 1


class Packet:
    r"""Layout of one averaging all-reduce: items (layers) of tensors, one flat buffer.

    Args:
        shapes: per item, the shapes of its tensors, in order.
        carried: per item, whether the *last entry of its first tensor* is 1 on every rank
            holding the item (then it carries the count); otherwise a count value is
            appended after all the items.
        dtype: the buffer's (wire) dtype.
        sums: False (default): items are means, a carried entry is overwritten with 1 and
            :meth:`unpack` divides each item by the number of ranks that sent it. True:
            items are sums whose carried entry already holds the item's count (rows), the
            count of an uncarried item is passed to :meth:`pack`, and :meth:`unpack_sums`
            returns the summed items with the summed count, undivided.
    """

    def __init__(self, shapes, carried, dtype, sums=False):
        self.shapes = [[torch.Size(s) for s in item] for item in shapes]
        self.carried = [bool(c) for c in carried]
        self.dtype = dtype
        self.sums = sums
        self._sizes = [[s.numel() for s in item] for item in self.shapes]
        self._starts, self._count_at, offset = [], [], 0
        for sizes in self._sizes:
            self._starts.append(offset)
            offset += sum(sizes)
        for start, sizes, carried_here in zip(self._starts, self._sizes, self.carried):
            if carried_here:
                if not sizes or sizes[0] == 0:
                    raise ValueError("a carried item needs a non-empty first tensor")
                self._count_at.append(start + sizes[0] - 1)
            else:
                self._count_at.append(offset)
                offset += 1
        self.numel = offset

    @property
    def nbytes(self):
        """Bytes each rank contributes to the all-reduce."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def pack(self, items, device, counts=None):
        """One flat buffer from ``items`` (per item: a list of tensors, or None if this rank
        has nothing for it); with ``sums``, ``counts`` gives each uncarried item's count (a
        number or a 0-d tensor). No host synchronisation: only shapes are read."""
        pieces, tail = [], []
        one = torch.ones(1, dtype=self.dtype, device=device)
        zero = torch.zeros(1, dtype=self.dtype, device=device)
        for m, (item, sizes, carried) in enumerate(zip(items, self._sizes, self.carried)):
            if item is None:
                pieces.append(torch.zeros(sum(sizes), dtype=self.dtype, device=device))
            else:
                flat = [t.reshape(-1).to(device=device, dtype=self.dtype) for t in item]
                if carried and not self.sums:  # the entry that is 1 carries the count
                    flat[0] = torch.cat([flat[0][:-1], one])
                pieces += flat
            if not carried:
                if item is None:
                    tail.append(zero)
                elif self.sums:
                    n = counts[m]
                    tail.append(n.reshape(1).to(device=device, dtype=self.dtype)
                                if isinstance(n, torch.Tensor) else zero + float(n))
                else:
                    tail.append(one)
        return torch.cat(pieces + tail)

    def unpack_sums(self, buffer, out_dtype):
        """Per item ``(tensors, count)``: the summed item and its summed count (0-d), in
        ``out_dtype``, undivided (``sums=True``)."""
        out = []
        for start, sizes, shapes, at in zip(self._starts, self._sizes, self.shapes,
                                            self._count_at):
            flat = buffer[start:start + sum(sizes)].to(out_dtype)
            out.append(([t.reshape(s) for t, s in zip(torch.split(flat, sizes), shapes)],
                        buffer[at].to(out_dtype)))
        return out

    def unpack(self, buffer, out_dtype, average="once", world=1):
        """Per item ``(tensors, count)``: the item divided by its count (the number of
        ranks that contributed it; 0-d tensor) -- and by ``world`` again if ``average`` is
        "double" -- in ``out_dtype``. An item nobody sent comes back as zeros, count 0."""
        out = []
        for start, sizes, shapes, at in zip(self._starts, self._sizes, self.shapes,
                                            self._count_at):
            count = buffer[at].to(out_dtype)
            mean = buffer[start:start + sum(sizes)].to(out_dtype) / count.clamp(min=1)
            if average == "double":
                mean = mean / world
            out.append(([t.reshape(s) for t, s in zip(torch.split(mean, sizes), shapes)],
                        count))
        return out

    def all_reduce(self, items, device, group=None, async_op=False, counts=None):
        """Pack ``items`` and SUM-all-reduce the buffer (no-op on one rank); returns a
        :class:`Reduction` to :meth:`~Reduction.wait` on."""
        return self._sum(items, device, group, async_op, counts, dst=None)

    def reduce(self, items, device, dst, group=None, counts=None):
        """Pack ``items`` and SUM-reduce the buffer to the global rank ``dst`` alone (the
        :class:`Reduction` holds the sums there, and an undefined buffer elsewhere)."""
        return self._sum(items, device, group, False, counts, dst=dst)

    def _sum(self, items, device, group, async_op, counts, dst):
        world = world_size(group)
        if world > _EXACT_COUNTS[self.dtype]:
            raise ValueError(f"comm_dtype {self.dtype} counts ranks exactly only up to "
                             f"{_EXACT_COUNTS[self.dtype]}, got {world} ranks")
        buffer = self.pack(items, device, counts)
        work = None
        if world > 1 and dst is None:
            work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group,
                                   async_op=async_op)
        elif world > 1:
            dist.reduce(buffer, dst=dst, op=dist.ReduceOp.SUM, group=group)
        return Reduction(self, buffer, work if async_op else None, world)


class Reduction:
    """A launched (possibly still running) packet all-reduce."""

    def __init__(self, packet, buffer, work, world):
        self.packet, self.buffer, self.work, self.world = packet, buffer, work, world

    def finish(self):
        """Wait for the collective (a stream wait on NCCL, not a host sync)."""
        if self.work is not None:
            self.work.wait()
            self.work = None

    def wait(self, out_dtype, average="once"):
        """:meth:`finish`, then :meth:`Packet.unpack` (or :meth:`Packet.unpack_sums`)."""
        self.finish()
        if self.packet.sums:
            return self.packet.unpack_sums(self.buffer, out_dtype)
        return self.packet.unpack(self.buffer, out_dtype, average, self.world)


class VectorExchange:
    """MKOR's communication: the packet of its layers (the sums behind a_bar and g_bar per
    layer, bias-free layers' row counts), the launch (at ``step()``, or from the backward
    pass with ``comm_overlap``) and the running byte count."""

    def __init__(self, layers, model, compute_dtype, comm_dtype=None, average="once",
                 group=None):
        self.layers, self.model, self.group = list(layers), model, group
        self.compute_dtype, self.average = compute_dtype, average
        # a stack of experts sends its (E, .) sums and its (E,) row counts as a third
        # tensor (one count per expert; the appended count is then unused)
        self.packet = Packet([[(l.d_in,), (l.d_out,)] if l.experts is None else
                              [(l.experts, l.d_in), (l.experts, l.d_out), (l.experts,)]
                              for l in self.layers],
                             [l.has_bias and l.experts is None for l in self.layers],
                             comm_dtype or compute_dtype, sums=True)
        self.communicated_bytes = 0
        self._inflight = None  # (Reduction, capture commits when it was launched)

    def _launch(self, pending, async_op):
        """``pending``: {name: (a_sum, rows, g_sum)}."""
        items = [None if l.name not in pending else
                 [pending[l.name][0], pending[l.name][2]] if l.experts is None else
                 [pending[l.name][0], pending[l.name][2], pending[l.name][1]]
                 for l in self.layers]
        counts = [pending[l.name][1] if l.name in pending and l.experts is None else 0
                  for l in self.layers]
        reduction = self.packet.all_reduce(items, self.layers[0].module.weight.device,
                                           self.group, async_op, counts)
        self.communicated_bytes += self.packet.nbytes
        return reduction

    def launch_early(self, pending, commits):
        """Start the all-reduce now (asynchronously) from the current statistics. Skipped
        inside DDP's ``no_sync()`` (not the last micro-batch). A launch still unused from
        an earlier backward of this step is stale: it is finished and discarded, so every
        rank issues the same collectives in the same order."""
        if not self.layers or world_size(self.group) == 1:
            return
        if getattr(self.model, "require_backward_grad_sync", True) is False:
            return
        self.drop()
        self._inflight = (self._launch(pending, async_op=True), commits)

    def exchange(self, pending, commits=None):
        """[(layer, a_bar, g_bar, present)] of the union of the ranks' rows (module
        docstring) from this rank's ``pending`` {name: (a_sum, rows, g_sum)}; uses the early
        launch if no statistic was committed after it."""
        if not self.layers:
            return []
        reduction = None
        if self._inflight is not None:
            launched, at = self._inflight
            self._inflight = None
            if at == commits:
                reduction = launched
            else:
                launched.finish()
        if reduction is None:
            reduction = self._launch(pending, async_op=False)
        results = reduction.wait(self.compute_dtype)
        world = world_size(self.group)
        divide = world * world if self.average == "double" else world
        out = []
        for layer, (sums, rows) in zip(self.layers, results):
            dev = layer.module.weight.device
            a_sum, g_sum = sums[:2]
            if layer.experts is not None:  # per expert: its own count
                rows = sums[2]
                a_bar = a_sum / rows.clamp(min=1).unsqueeze(-1)
            else:
                a_bar = a_sum / rows.clamp(min=1)
            if self.average == "double":
                a_bar = a_bar / world
            out.append((layer, a_bar.to(dev), (g_sum / divide).to(dev), rows.to(dev) > 0))
        return out

    def drop(self):
        """Finish and forget an unused early launch (``zero_grad`` without a step)."""
        if self._inflight is not None:
            self._inflight[0].finish()
            self._inflight = None


class OverlapCapture(Capture):
    """:class:`~.capture.Capture` that calls ``on_backward_done()`` whenever the last
    outstanding forward of the hooked layers has received its gradient statistic, i.e.
    when a backward pass has reached every captured layer. MKOR launches its vector
    all-reduce there (``comm_overlap=True``), so the reduction runs during the rest of the
    backward pass (the first layer's weight gradient, DDP's last bucket all-reduce) and
    whatever the caller does before ``step()``. ``commits`` counts committed statistics, so
    a launch that later statistics made stale can be recognised."""

    def __init__(self, *args, on_backward_done, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_backward_done = on_backward_done
        self.outstanding = 0
        self.commits = 0

    def _captured(self, layer):
        self.outstanding += 1

    def _committed(self, layer, counted=True):
        self.commits += 1
        if not counted:  # a recompute's statistic: reentrant checkpointing, no launch
            return
        self.outstanding -= 1
        if self.outstanding == 0:
            self.on_backward_done()

    def reset(self):
        super().reset()
        self.outstanding = 0
        self.commits = 0
