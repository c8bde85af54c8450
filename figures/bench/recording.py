"""Counting, on one rank, what the whole-matrix functions of ``torch_impl.common.sharding``
(Newton-Schulz, the SVD polar factor, on DTensors) computed and what they communicated, in
either ``orthogonalize_on`` mode.

:func:`record_orthogonalisation` puts an :class:`OrthogonalisationRecord` among
``sharding.OBSERVERS`` while its block runs; the library calls the record's
``all_gathered`` / ``computed_on`` / ``all_to_all`` and keeps nothing itself. Used by
``python -m figures.bench.owner_orthogonalisation`` and by the distributed tests, which
check the counts against ``sharding.exchange_bytes``'s prediction from the shapes.
"""
import contextlib
import dataclasses

from torch_impl.common import sharding


@dataclasses.dataclass
class OrthogonalisationRecord:
    """What this rank did inside :func:`record_orthogonalisation`: ``computed``, the shapes
    of the whole matrices it orthogonalised; ``bytes_sent`` / ``bytes_received``, bytes to
    and from other ranks (the all-gather's padded shards in every-rank mode, the
    ``all_to_all`` split sizes in owner mode); ``collectives``, how many it joined."""
    computed: list = dataclasses.field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    collectives: int = 0

    def flops(self, steps=5):
        """Newton-Schulz flops of ``computed`` (``sharding.ns_flops``; batch dims multiply)."""
        total = 0
        for shape in self.computed:
            batch = 1
            for s in shape[:-2]:
                batch *= s
            total += batch * sharding.ns_flops(shape[-2], shape[-1], steps=steps)
        return total

    # -- what sharding.OBSERVERS calls

    def all_gathered(self, M):
        """Every-rank mode's cost for ``M``: DTensor's ``full_tensor`` all-gathers each sharded
        mesh dimension with shards padded to ceil(n / P) (1-D meshes exactly; other layouts as
        the whole tensor less the local shard)."""
        from torch.distributed.tensor import Shard
        itemsize = M.element_size()
        if (M.device_mesh.ndim == 1 and len(M.placements) == 1
                and isinstance(M.placements[0], Shard)):
            world = M.device_mesh.size()
            dim = M.placements[0].dim % M.ndim
            chunk = -(-M.shape[dim] // world)
            padded = M.numel() // M.shape[dim] * chunk * itemsize if M.shape[dim] else 0
            moved, collectives = (world - 1) * padded, world > 1
        else:
            moved = (M.numel() - M.to_local().numel()) * itemsize
            collectives = moved > 0
        # an all-gather: each rank sends what each other rank receives
        self.computed.append(tuple(M.shape))
        self.bytes_received += moved
        self.bytes_sent += moved
        self.collectives += collectives

    def computed_on(self, shape):
        self.computed.append(shape)

    def all_to_all(self, joined, sent, received):
        self.collectives += joined
        self.bytes_sent += sent
        self.bytes_received += received


@contextlib.contextmanager
def record_orthogonalisation():
    """Count this rank's whole-matrix functions and their communication (both modes) while
    the block runs; yields an :class:`OrthogonalisationRecord`. Outside the block the library
    has no observer and counts nothing."""
    record = OrthogonalisationRecord()
    sharding.OBSERVERS.append(record)
    try:
        yield record
    finally:
        sharding.OBSERVERS.remove(record)
