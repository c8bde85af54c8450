r"""Averaging MKOR's rank-1 vectors across data-parallel ranks (spec MKOR.md 2.7).

Only the vectors travel: every rank repeats the same Sherman-Morrison updates on
replicated factors, so the traffic per factor update is
sum_m (d_in' + d_out) values, O(d). All vectors go in one contiguous buffer and one
``all_reduce(SUM)`` (``ReduceOp.AVG`` is NCCL-only), then are divided *once* by the
number of ranks that captured each layer. ``average="double"`` reproduces the
released code's extra division by the world size (a bug: it scales the rank-1 term
by 1/P^2), for differential tests only.
"""
import torch
import torch.distributed as dist

__all__ = ["world_size", "average_vectors"]


def world_size(group=None):
    """Number of ranks in ``group``, 1 when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    return 1


def average_vectors(vectors, present, *, average="once", comm_dtype=None, group=None):
    r"""Average per-layer vectors over ranks with one all-reduce.

    Args:
        vectors: 1-D tensors (zeros for a layer this rank did not capture).
        present: one 0-d tensor per vector, 1 if this rank captured it, else 0.
        average: "once" (mean over the ranks that captured) or "double" (that mean
            divided by the world size again, the released code's behaviour).
        comm_dtype: dtype of the buffer on the wire (default: the vectors' dtype).

    Returns:
        (averaged vectors in their original dtypes, per-vector capture counts).
    """
    if not vectors:
        return [], []
    device = vectors[0].device
    dtype = comm_dtype or vectors[0].dtype
    sizes = [v.numel() for v in vectors]
    buffer = torch.cat([v.to(device=device, dtype=dtype) for v in vectors]
                       + [torch.stack([p.to(device=device, dtype=dtype) for p in present])])
    if world_size(group) > 1:
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
    pieces = torch.split(buffer, sizes + [len(vectors)])
    counts = pieces[-1]
    out = []
    for v, piece, count in zip(vectors, pieces[:-1], counts):
        mean = piece.to(v.dtype) / count.to(v.dtype).clamp(min=1)
        if average == "double":
            mean = mean / world_size(group)
        out.append(mean.to(v.device))
    return out, list(counts)
