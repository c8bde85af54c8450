r"""Sharded tensors (FSDP2 / tensor-parallel ``DTensor``) in the optimizers' matrix math.

Elementwise rules and norms need nothing: DTensor dispatch already makes
``torch.linalg.vector_norm`` / ``torch._foreach_norm`` of a sharded tensor the norm of the
*whole* tensor, which is what MARS's per-tensor clip requires (spec MARS.md 5). A matrix
function is different: Newton-Schulz and the SVD polar factor of a row-sharded M are not
the row shards of anything computed locally, and DTensor's own propagation through the
iteration may return a placement the parameter does not have (then the in-place update
fails). The function is therefore computed on the whole matrix, in one of two ways
(``orthogonalize_on``, a keyword of ``functional.mars`` / ``functional.mars_m``):

``"every_rank"`` (:func:`on_full_matrix`):

.. math::
    \text{shard}_r\big(f(M)\big) = \text{shard}_r\big(f(\text{all\_gather}(M))\big)

-- one all-gather per matrix, the same full computation on every rank, each rank keeps its
own shard. Per step every rank runs every matrix function and holds every full matrix.

``"owner"`` (:func:`orthogonalize_on_owners`): each whole matrix of one call's list has one
owner rank (:func:`assign_owners`, greedy LPT on the Newton-Schulz flops of its shape,
computed identically on every rank from the global shapes). One ``all_to_all`` brings every
matrix's shards to its owner, the owner computes f, and one ``all_to_all`` brings each rank
its shard of every result. Per step a rank runs about 1/P of the flops and holds only the
full matrices it owns; the bytes a rank receives fall from (P-1)/P of all matrices to about
2(P-1)/P^2 of them (equal at P = 2, half at P = 4; :func:`exchange_bytes`).

A stack of matrices (..., A, B) sharded only on its leading dims (FSDP2's ``Shard(0)`` of
fused MoE experts: every rank holds whole experts; ``matrix_batch_dims``, issue 31) needs
neither: f acts on each matrix on its own, so f of the stack is f of each rank's shard
(:func:`on_local_matrices`), with no communication. :func:`on_matrices` picks that where it
applies and the all-gather elsewhere.

Both give the same numbers: f sees the same full matrix (the owner concatenates the same
shards the all-gather would). Owner mode applies to a 2-D DTensor on a 1-D mesh with one
``Shard`` placement (FSDP2's ``Shard(0)``, or a column shard); anything else (replicated,
several mesh dimensions, strided shards, batched matrices) keeps :func:`on_full_matrix`.
Shards may be uneven or empty (``torch.chunk`` semantics, checked against each rank's local
shape), and a rank may own nothing. Like the all-gather, the exchange is a collective:
every rank must call it with the same list of matrices (the same parameters with gradients).

:data:`OBSERVERS` is where a measuring tool listens: it is told, on one rank, each whole
matrix computed and each collective with its bytes, in either mode (the benchmarks' recorder,
``figures/bench/recording.py``); the library keeps no counts of its own.
"""
import sys

import torch

__all__ = ["ORTHOGONALIZE_ON", "is_dtensor", "on_full_matrix", "holds_whole_matrices",
           "on_local_matrices", "on_matrices", "owner_eligible",
           "orthogonalize_on_owners", "orthogonalize_by_shape", "assign_owners", "ns_flops", "shard_sizes",
           "exchange_bytes", "OBSERVERS"]

ORTHOGONALIZE_ON = ("owner", "every_rank")


def is_dtensor(x):
    """Whether ``x`` is a ``torch.distributed.tensor.DTensor``. Never imports the DTensor
    package: if nobody imported it, nothing can be a DTensor."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


BATCH_NUMEL = 1 << 26  # one batched call stacks at most this many elements (256 MiB in fp32)


def orthogonalize_by_shape(fn, matrices, max_numel=BATCH_NUMEL):
    """``[fn(M) for M in matrices]`` with the matrices of one shape (and dtype, device) in one
    batched call: plain tensors of shape (..., A, B) are grouped by (A, B), their matrices
    stacked into one (n, A, B) batch (a copy; batches of at most ``max_numel`` elements, so
    that the copy stays bounded), ``fn`` called once per batch and the results split back as
    views.  A shape met once is called on its own (no copy).  ``fn`` must treat each matrix
    of a batch on its own (``newton_schulz``, ``gram_newton_schulz`` and ``orthogonalize_svd``
    do), so the result is the per-matrix one; sharded tensors (DTensor) are left to ``fn`` one
    by one (their owner-rank path batches the whole matrices it gathers)."""
    out = [None] * len(matrices)
    groups = {}
    for i, M in enumerate(matrices):
        if is_dtensor(M) or M.dim() < 2 or M.numel() == 0:
            out[i] = fn(M)
        else:
            groups.setdefault((tuple(M.shape[-2:]), M.dtype, M.device), []).append(i)
    for idx in groups.values():
        batches, size = [[]], 0
        for i in idx:  # consecutive runs of at most max_numel elements (a larger tensor alone)
            if batches[-1] and size + matrices[i].numel() > max_numel:
                batches.append([])
                size = 0
            batches[-1].append(i)
            size += matrices[i].numel()
        for batch in batches:
            if len(batch) == 1:
                out[batch[0]] = fn(matrices[batch[0]])
                continue
            flat = [matrices[i].reshape(-1, *matrices[i].shape[-2:]) for i in batch]
            results = fn(torch.cat(flat)).split([f.size(0) for f in flat])
            for i, r in zip(batch, results):
                out[i] = r.reshape(*matrices[i].shape[:-2], *r.shape[-2:])
    return out


def on_full_matrix(fn, M, *args, **kwargs):
    """``fn(M, ...)`` for a DTensor ``M`` (batched ``(..., A, B)`` allowed), computed on the
    whole matrix and returned with ``M``'s mesh and placements (Shard / Replicate)."""
    from torch.distributed.tensor import distribute_tensor
    for observer in OBSERVERS:  # every-rank mode: M's all-gather, then f of the whole M
        observer.all_gathered(M)
    full = fn(M.full_tensor(), *args, **kwargs)
    # src_data_rank=None: every rank already holds the same full result; just slice it.
    return distribute_tensor(full, M.device_mesh, M.placements, src_data_rank=None)


def holds_whole_matrices(M):
    """Whether every shard of the DTensor stack ``M`` (..., A, B) holds whole matrices: each
    placement replicates, or shards one of the leading dims, never A or B.  A leading-dim
    shard is a plain ``Shard`` or a ``_StridedShard`` (which deals out the same dim in
    strides): torchtitan's experts under expert parallelism and FSDP are
    ``(_StridedShard(0, sf=ep), Shard(0))`` on its ``(efsdp, ep)`` mesh, whole experts on
    every rank (issue 48)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    return M.ndim > 2 and all(
        isinstance(pl, Replicate) or (type(pl) in (Shard, _StridedShard)
                                      and pl.dim % M.ndim < M.ndim - 2)
        for pl in M.placements)


def on_local_matrices(fn, M, *args, **kwargs):
    """``fn(M, ...)`` for a DTensor stack whose shards hold whole matrices
    (:func:`holds_whole_matrices`) and a ``fn`` that acts on each matrix on its own: ``fn`` of
    the local shard, returned with ``M``'s mesh, placements and shape. No communication."""
    from torch.distributed.tensor import DTensor
    out = fn(M.to_local(), *args, **kwargs)
    for observer in OBSERVERS:
        observer.computed_on(tuple(out.shape))
    return DTensor.from_local(out, M.device_mesh, M.placements, run_check=False,
                              shape=M.shape, stride=_contiguous_stride(M.shape))


def on_matrices(fn, M, *args, **kwargs):
    """``fn(M, ...)`` for a DTensor ``M`` (batched (..., A, B) allowed) and a per-matrix
    ``fn``: on the local shards where they hold whole matrices (:func:`on_local_matrices`),
    else on the all-gathered matrix (:func:`on_full_matrix`)."""
    if holds_whole_matrices(M):
        return on_local_matrices(fn, M, *args, **kwargs)
    return on_full_matrix(fn, M, *args, **kwargs)


def _contiguous_stride(shape):
    stride, step = [], 1
    for n in reversed(tuple(shape)):
        stride.append(step)
        step *= max(n, 1)
    return tuple(reversed(stride))


# ------------------------------------------------------------------ the owner map

def ns_flops(rows, cols, steps=5):
    """Floating-point operations (2 per multiply-add) of ``steps`` quintic Newton-Schulz
    iterations on a ``rows`` x ``cols`` matrix, which runs in its wide orientation
    (m = min, n = max): Q = X X^T (2 m^2 n), Q Q (2 m^3), (bQ + cQ^2) X (2 m^2 n).
    The normalisation and the additions (O(mn)) are left out. Exact Python integers."""
    m, n = sorted((int(rows), int(cols)))
    return steps * (4 * m * m * n + 2 * m ** 3)


def assign_owners(costs, world_size):
    """Greedy LPT (longest processing time first): the owner rank of each item of ``costs``.

    Items are taken by decreasing cost, ties by position (parameter order); each goes to the
    rank with the least load so far, ties to the lowest rank. A pure function of
    ``(costs, world_size)`` -- integers, no floating point, no randomness -- so every rank
    computes the same map, and the same map again after a restart (checkpoint-stable).
    The largest load is at most 4/3 - 1/(3P) of the optimum (Graham 1969), and at most the
    mean load plus the largest single cost."""
    load = [0] * world_size
    owners = [None] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += costs[i]
    return owners


def shard_sizes(n, world_size):
    """Sizes of the ``world_size`` shards of a dimension of length ``n`` under ``Shard``:
    ``torch.chunk`` semantics, ceil(n / P) each, the last ones shorter or empty."""
    chunk = -(-n // world_size)
    return [max(0, min(chunk, n - r * chunk)) for r in range(world_size)]


def owner_eligible(M):
    """Whether owner mode handles ``M``: a 2-D DTensor on a 1-D mesh with one plain
    ``Shard`` placement (not replicated, not ``_StridedShard``)."""
    if not is_dtensor(M) or M.ndim != 2 or M.device_mesh.ndim != 1 or len(M.placements) != 1:
        return False
    from torch.distributed.tensor import Shard
    return type(M.placements[0]) is Shard


class _Layout:
    """Where the pieces of one sharded 2-D matrix live: global shape, shard dim, sizes."""

    def __init__(self, M, world_size):
        self.shape = tuple(M.shape)
        self.dim = M.placements[0].dim % 2
        self.sizes = shard_sizes(self.shape[self.dim], world_size)
        self.offsets = [sum(self.sizes[:r]) for r in range(world_size)]

    def piece_shape(self, rank):
        shape = list(self.shape)
        shape[self.dim] = self.sizes[rank]
        return tuple(shape)

    def piece(self, full, rank):
        return full.narrow(self.dim, self.offsets[rank], self.sizes[rank])


def orthogonalize_on_owners(fn, matrices, out_dtype=None):
    """``fn`` of every whole matrix in ``matrices`` that :func:`owner_eligible` accepts (and is
    not empty), each computed once, on its owner rank, and returned sharded as the input.

    Returns a list parallel to ``matrices``: the result (a DTensor with the input's mesh,
    placement, shape) where owner mode applies, ``None`` elsewhere (the caller computes those
    itself, e.g. plain tensors one at a time). ``fn`` maps a full plain matrix to a matrix of
    the same shape and dtype ``out_dtype`` (``None``: the input's). One exchange (two
    ``all_to_all``) per device mesh among the matrices. A collective: every rank of the mesh
    must call it with the same list."""
    results = [None] * len(matrices)
    by_mesh = {}
    for i, M in enumerate(matrices):
        if owner_eligible(M) and M.numel():
            by_mesh.setdefault(M.device_mesh, []).append(i)
    for mesh, idx in by_mesh.items():
        outs = _owner_exchange(fn, [matrices[i] for i in idx], mesh, out_dtype)
        for i, out in zip(idx, outs):
            results[i] = out
    return results


def _owner_exchange(fn, Ms, mesh, out_dtype):
    from torch.distributed.tensor import DTensor
    world, rank = mesh.size(), mesh.get_local_rank()
    layouts = [_Layout(M, world) for M in Ms]
    owners = assign_owners([ns_flops(*lay.shape) for lay in layouts], world)
    in_dtypes = [M.dtype for M in Ms]
    out_dtypes = [out_dtype or M.dtype for M in Ms]
    shards = [M.to_local() for M in Ms]
    for lay, shard in zip(layouts, shards):
        if tuple(shard.shape) != lay.piece_shape(rank):
            raise RuntimeError(f"orthogonalize_on='owner': rank {rank} holds a "
                               f"{tuple(shard.shape)} shard of a {lay.shape} matrix, expected "
                               f"{lay.piece_shape(rank)} (torch.chunk split); use "
                               "orthogonalize_on='every_rank'")
    mine = [j for j, owner in enumerate(owners) if owner == rank]
    # 1. every shard to its matrix's owner
    received = _all_to_all(
        [[shards[j] for j in range(len(Ms)) if owners[j] == dst] for dst in range(world)],
        [[(layouts[j].piece_shape(src), in_dtypes[j]) for j in mine] for src in range(world)],
        mesh, shards[0].device)
    fulls = [torch.cat([received[src][k] for src in range(world)], dim=layouts[j].dim)
             for k, j in enumerate(mine)]
    outs = []  # 2. the owner's whole matrices, one batched call per shape
    for j, out in zip(mine, orthogonalize_by_shape(fn, fulls)):
        if tuple(out.shape) != layouts[j].shape or out.dtype != out_dtypes[j]:
            raise RuntimeError(f"orthogonalize_on='owner': fn returned {tuple(out.shape)} "
                               f"{out.dtype} for a {layouts[j].shape} matrix, expected "
                               f"{out_dtypes[j]}")
        outs.append(out)
        for observer in OBSERVERS:
            observer.computed_on(layouts[j].shape)
    del received
    # 3. every rank's piece of each result back from its owner
    back = _all_to_all(
        [[layouts[j].piece(out, dst) for j, out in zip(mine, outs)] for dst in range(world)],
        [[(layouts[j].piece_shape(rank), out_dtypes[j]) for j in range(len(Ms))
          if owners[j] == src] for src in range(world)],
        mesh, shards[0].device)
    local = {}
    for src in range(world):
        for j, piece in zip([j for j in range(len(Ms)) if owners[j] == src], back[src]):
            local[j] = piece
    return [DTensor.from_local(local[j], mesh, M.placements, run_check=False,
                               shape=M.shape, stride=(M.shape[1], 1))
            for j, M in enumerate(Ms)]


def _all_to_all(send, receive, mesh, device):
    """One ``all_to_all_single`` of raw bytes: ``send[dst]`` lists the tensors for rank dst,
    ``receive[src]`` the (shape, dtype) of each tensor expected from rank src; returns the
    received tensors, ``[src][k]``. Bytes let tensors of several dtypes share one collective
    (gloo and NCCL both move uint8); uneven and empty pieces are split sizes."""
    import torch.distributed as dist
    world, rank = len(send), mesh.get_local_rank()
    pieces = [[_as_bytes(t) for t in ts] for ts in send]
    in_sizes = [sum(p.numel() for p in ps) for ps in pieces]
    out_sizes = [sum(_nbytes(shape, dtype) for shape, dtype in specs) for specs in receive]
    flat = [p for ps in pieces for p in ps]
    inp = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8, device=device)
    if world == 1:
        out = inp
    else:
        out = torch.empty(sum(out_sizes), dtype=torch.uint8, device=device)
        dist.all_to_all_single(out, inp, out_sizes, in_sizes, group=mesh.get_group())
    if OBSERVERS:  # the sums only when someone listens
        sent, received = sum(in_sizes) - in_sizes[rank], sum(out_sizes) - out_sizes[rank]
        for observer in OBSERVERS:
            observer.all_to_all(world > 1, sent, received)
    result, offset = [], 0
    for specs in receive:
        row = []
        for shape, dtype in specs:
            n = _nbytes(shape, dtype)
            # clone: a fresh, aligned buffer for the dtype view
            row.append(out.narrow(0, offset, n).clone().view(dtype).view(shape))
            offset += n
        result.append(row)
    return result


def _as_bytes(t):
    return t.contiguous().view(-1).view(torch.uint8)


def _nbytes(shape, dtype):
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


# ------------------------------------------------------------------ measurement

def exchange_bytes(shapes, world_size, itemsize=4, out_itemsize=None, steps=5):
    """What one step moves and computes, from the matrices' global shapes alone (row shards,
    ``Shard(0)``), in both modes: a dict ``{"owner": ..., "every_rank": ...}`` of
    ``dict(received=[bytes per rank], flops=[NS flops per rank])``. Every rank: DTensor's
    all-gather pads each shard to ceil(A/P) rows, so each rank receives (P-1) padded
    shards of every matrix and runs every Newton-Schulz. Owner: the owner receives the
    other ranks' shards (``itemsize``), every rank receives its shard of each result it does
    not own (``out_itemsize``, default ``itemsize``); the owner runs it. Matches what the
    benchmarks' recorder counts through :data:`OBSERVERS` (``theory_tests/distributed/
    test_owner_orthogonalisation.py``)."""
    out_itemsize = out_itemsize or itemsize
    shapes = [tuple(s) for s in shapes if s[0] * s[1]]
    owners = assign_owners([ns_flops(*s, steps=steps) for s in shapes], world_size)
    every = dict(received=[0] * world_size,
                 flops=[sum(ns_flops(*s, steps=steps) for s in shapes)] * world_size)
    owner = dict(received=[0] * world_size, flops=[0] * world_size)
    for (rows, cols), o in zip(shapes, owners):
        sizes = shard_sizes(rows, world_size)
        chunk = -(-rows // world_size)
        owner["flops"][o] += ns_flops(rows, cols, steps=steps)
        for r in range(world_size):
            every["received"][r] += (world_size - 1) * chunk * cols * itemsize
            if r == o:
                owner["received"][r] += (rows - sizes[r]) * cols * itemsize
            else:
                owner["received"][r] += sizes[r] * cols * out_itemsize
    return {"owner": owner, "every_rank": every}


# The observers of the whole-matrix functions on this rank: objects a measuring tool appends
# (and removes) for the time it measures, e.g. figures/bench/recording.py. The library calls
# on each observer:
#   all_gathered(M)    before the all-gather of the DTensor M and f of the whole matrix
#                      (every-rank mode, on_full_matrix);
#   computed_on(shape) after f of a whole matrix on its owner rank, or of a local stack of
#                      whole matrices (on_local_matrices); ``shape`` a tuple;
#   all_to_all(joined, sent, received)
#                      after each owner-mode exchange: whether this rank joined a
#                      collective (world > 1), the bytes it sent to and received from the
#                      other ranks.
# Empty (the default), each call site is a loop over nothing and no count is computed.
OBSERVERS = []
