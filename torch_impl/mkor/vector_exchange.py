r"""MKOR's rank-1 vector exchange over data-parallel ranks (spec MKOR.md 2.7), on the
engine's :class:`~torch_impl.kronecker.exchange.Packet`.

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
left untouched ("no rows"). ``average="double"`` divides both vectors by P once more,
reproducing the released code's bug (the rank-1 term scaled by 1/P^2), for differential
tests only. ``comm_dtype`` float16 / bfloat16 halves the buffer at the error bound of
:mod:`torch_impl.kronecker.exchange`.

**Volume.** ``Packet.nbytes`` = values x itemsize per rank per factor update: O(d) per
layer. K-FAC's factor all-reduce, packed the same way, holds sum_m (d_in'^2 + d_out^2)
(+ counts): O(d^2).

**Overlap** (``comm_overlap=True``): :class:`BackwardProgress` listens to the capture and
tells when a backward pass has reached every captured layer; the all-reduce is launched
there, asynchronously, instead of in ``step()``.
"""
from ..kronecker.exchange import Packet, world_size
from .rank_k import group_vectors

__all__ = ["VectorExchange", "BackwardProgress"]


class VectorExchange:
    """MKOR's communication: the packet of its layers (the sums behind a_bar and g_bar per
    layer, bias-free layers' row counts), the launch (at ``step()``, or from the backward
    pass with ``comm_overlap``) and the running byte count. ``options``: a
    :class:`~.config.ExchangeOptions`; ``rank``: MKOR's rank k (k group sums per factor)."""

    def __init__(self, layers, model, options, group=None, rank=1, data_world=None):
        self.layers, self.model, self.group = list(layers), model, group
        # the number of ranks whose mean losses DDP averages (the divisor of g_bar): the
        # group's own, or (a stack's row group under expert parallelism) the data-parallel one
        self.data_world = data_world
        # an ExchangeOptions: the compute dtype, the wire dtype, the averaging
        self.compute_dtype, self.average = options.compute_dtype, options.average
        comm_dtype = options.comm_dtype
        self.rank = rank
        # a stack of experts sends its (E, .) sums and its (E,) row counts as a third
        # tensor (one count per expert; the appended count is then unused)
        shapes = [[(l.d_in,), (l.d_out,)] if l.experts is None else
                  [(l.experts, l.d_in), (l.experts, l.d_out), (l.experts,)]
                  for l in self.layers]
        carried = [l.has_bias and l.experts is None for l in self.layers]
        if self.rank > 1:  # k group sums per factor, the group counts as a last input column
            stack = lambda l: () if l.experts is None else (l.experts,)  # noqa: E731
            shapes = [[(*stack(l), self.rank, l.d_in - l.has_bias + 1),
                       (*stack(l), self.rank, l.d_out)] for l in self.layers]
            carried = [False] * len(self.layers)
        self.packet = Packet(shapes, carried, comm_dtype or self.compute_dtype, sums=True)
        self.communicated_bytes = 0
        self._inflight = None  # (Reduction, capture commits when it was launched)

    def _launch(self, pending, async_op):
        """``pending``: {name: (a_sum, rows, g_sum)}."""
        items = [None if l.name not in pending else
                 [pending[l.name][0], pending[l.name][2]] if l.experts is None or self.rank > 1
                 else
                 [pending[l.name][0], pending[l.name][2], pending[l.name][1]]
                 for l in self.layers]
        counts = [pending[l.name][1] if l.name in pending and l.experts is None
                  and self.rank == 1 else 0 for l in self.layers]
        reduction = self.packet.all_reduce(items, self.layers[0].module.weight.device,
                                           self.group, async_op, counts)
        if world_size(self.group) > 1:
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
        world = self.data_world or world_size(self.group)
        divide = world * world if self.average == "double" else world
        out = []
        for layer, (sums, rows) in zip(self.layers, results):
            dev = layer.module.weight.device
            a_sum, g_sum = sums[:2]
            if self.rank > 1:  # KC7's group means of the union (pooled by group index)
                out.append(self._group_vectors(layer, a_sum, g_sum, world, divide, dev))
                continue
            if layer.experts is not None:  # per expert: its own count
                rows = sums[2]
                a_bar = a_sum / rows.clamp(min=1).unsqueeze(-1)
            else:
                a_bar = a_sum / rows.clamp(min=1)
            if self.average == "double":
                a_bar = a_bar / world
            g_bar, present = g_sum / divide, rows > 0
            if layer.expert_shard is not None:  # EP: the factors of the held experts stay here
                a_bar, g_bar, present = (layer.expert_shard.kept(x) for x in (a_bar, g_bar,
                                                                                present))
            out.append((layer, a_bar.to(dev), g_bar.to(dev), present.to(dev)))
        return out

    def _group_vectors(self, layer, a_stat, g_sum, world, divide, dev):
        """(layer, A, G, present, groups) of a rank-k layer: the union's group sums over the
        union's group counts, G with the union's total (``divide`` = P, as DDP averages the
        gradients; "double" divides A by P too, as for rank 1)."""
        A, G, present, groups = group_vectors(a_stat, g_sum, layer.has_bias, divide)
        if self.average == "double":
            A = A / world
        return layer, A.to(dev), G.to(dev), present.to(dev), groups.to(dev)

    def drop(self):
        """Finish and forget an unused early launch (``zero_grad`` without a step)."""
        if self._inflight is not None:
            self._inflight[0].finish()
            self._inflight = None


class BackwardProgress:
    """A listener of the capture (:class:`~torch_impl.kronecker.capture.Capture`) that calls
    ``on_backward_done()`` whenever the last outstanding forward of the hooked layers has
    received its gradient statistic, i.e. when a backward pass has reached every captured
    layer. MKOR launches its vector all-reduce there (``comm_overlap=True``), so the reduction
    runs during the rest of the backward pass (the first layer's weight gradient, DDP's last
    bucket all-reduce) and whatever the caller does before ``step()``. ``commits`` counts
    committed statistics, so a launch that later statistics made stale can be recognised."""

    def __init__(self, on_backward_done):
        self.on_backward_done = on_backward_done
        self.outstanding = 0
        self.commits = 0

    def captured(self, layer):
        """A forward's input statistic was recorded."""
        self.outstanding += 1

    def committed(self, layer, counted=True):
        """A forward's statistics are complete; ``counted``: :meth:`captured` was called for
        it (not for a recompute's lazy statistic)."""
        self.commits += 1
        if not counted:  # a recompute's statistic: reentrant checkpointing, no launch
            return
        self.outstanding -= 1
        if self.outstanding == 0:
            self.on_backward_done()

    def reset(self):
        """The capture dropped its statistics."""
        self.outstanding = 0
        self.commits = 0
