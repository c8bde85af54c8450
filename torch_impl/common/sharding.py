r"""Sharded tensors (FSDP2 / tensor-parallel ``DTensor``) in the optimizers' matrix math.

Elementwise rules and norms need nothing: DTensor dispatch already makes
``torch.linalg.vector_norm`` / ``torch._foreach_norm`` of a sharded tensor the norm of the
*whole* tensor, which is what MARS's per-tensor clip requires (spec MARS.md 5). A matrix
function is different: Newton-Schulz and the SVD polar factor of a row-sharded M are not
the row shards of anything computed locally, and DTensor's own propagation through the
iteration may return a placement the parameter does not have (then the in-place update
fails). :func:`on_full_matrix` therefore computes the function on the whole matrix:

.. math::
    \text{shard}_r\big(f(M)\big) = \text{shard}_r\big(f(\text{all\_gather}(M))\big)

-- one all-gather of M per call, the same full computation on every rank, and each rank
keeps its own shard (no further communication). Memory: one full matrix per rank.
"""
import sys

__all__ = ["is_dtensor", "on_full_matrix"]


def is_dtensor(x):
    """Whether ``x`` is a ``torch.distributed.tensor.DTensor``. Never imports the DTensor
    package: if nobody imported it, nothing can be a DTensor."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def on_full_matrix(fn, M, *args, **kwargs):
    """``fn(M, ...)`` for a DTensor ``M`` (batched ``(..., A, B)`` allowed), computed on the
    whole matrix and returned with ``M``'s mesh and placements (Shard / Replicate)."""
    from torch.distributed.tensor import distribute_tensor
    full = fn(M.full_tensor(), *args, **kwargs)
    # src_data_rank=None: every rank already holds the same full result; just slice it.
    return distribute_tensor(full, M.device_mesh, M.placements, src_data_rank=None)
