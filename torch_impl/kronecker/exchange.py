r"""The statistics exchange of the Kronecker-factored preconditioners: one flat buffer per
collective (spec MKOR.md 2.7).

A :class:`Packet` lays out *items* (one per layer, each a list of tensors) in one flat buffer,
which one collective sums over the ranks: ``all_reduce(SUM)`` (every rank gets the sums) or
``reduce(SUM)`` to one owning rank. Items are *sums* whose count (of rows) travels with them:
where the first tensor's last entry is the sum of a bias column's constant input 1 over the
rows, that entry *is* the count and nothing is added ("carried"); otherwise one count value is
appended after all the items. After the SUM each rank divides by the union's count, so the
result is one process's statistics on the union of the batches: a rank where a layer had no
rows (an MoE expert routed no tokens there) contributes zeros and a count of 0, never a 0/0,
and a layer with no rows on any rank comes back with count 0. ``ReduceOp.AVG`` is not used:
gloo lacks it. (:class:`Packet` also offers the older mean-of-means packing, ``sums=False``,
with each item's count of contributing ranks.)

What travels is each method's: MKOR's O(d) vectors (:mod:`torch_impl.mkor.vector_exchange`),
K-FAC's O(d^2) factor sums (:mod:`torch_impl.baselines.kfac`). ``Packet.nbytes`` is what one
rank contributes per collective (a ring all-reduce puts 2(P-1)/P of it on each rank's link).

**Reduced precision** (a float16 / bfloat16 wire dtype, unit roundoff u = 2^-11 / 2^-8).
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

__all__ = ["world_size", "LOCAL", "Packet", "Reduction"]

_EXACT_COUNTS = {torch.float16: 2 ** 11, torch.bfloat16: 2 ** 8,
                 torch.float32: 2 ** 24, torch.float64: 2 ** 53}


class _Local:
    """The group of this rank alone: sums over it are the rank's own, and nothing travels."""

    def __repr__(self):
        return "LOCAL"


#: a "group" of this rank alone (a stack's row group under expert parallelism with one rank
#: per chunk): :func:`world_size` 1, so a :class:`Packet` over it issues no collective
LOCAL = _Local()


def world_size(group=None):
    """Number of ranks in ``group``, 1 when torch.distributed is not initialised or for
    :data:`LOCAL`."""
    if group is LOCAL:
        return 1
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
