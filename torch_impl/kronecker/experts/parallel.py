r"""Expert parallelism (EP): which experts of a stack a rank's capture sees, which it holds,
and which ranks' rows are summed for them (issue 48).

Under EP a MoE layer's E experts are split into ``ep`` chunks of E / ep along an ``ep`` mesh
dimension, and the token dispatcher sends each routed row to the rank holding its expert's
chunk (an all-to-all). On rank r with EP coordinate c:

* the capture **sees** the rows of the chunk c, experts [c E/ep, (c+1) E/ep): the forward
  multiplies them by the chunk's matrices (the FSDP-unsharded parameter, a ``Shard(0)`` DTensor
  on the ``ep`` mesh) and the counts it gets are the chunk's;
* the rank **holds** the experts of its parameter shard: the chunk itself, or (with FSDP on
  the ``efsdp`` dimension beside ``ep``) a contiguous part of it, whole experts either way;
* the rows of the chunk c are spread over the ranks with EP coordinate c (each sees the tokens
  its EP group routed to chunk c): their **row group**, the ranks sharing every other
  coordinate of the parameter's mesh. With ``ep`` equal to the data-parallel world the row
  group is the rank alone.

So each expert's statistics are the sum over its row group of the rows it sees (no collective
where the row group is one rank), and each rank keeps the factors of the experts it holds,
preconditions their gradient where it lies (no gather) and sends nothing else for them.

Nothing is inferred from a shape: the chunk comes from the dispatcher's EP mesh (which routes
the rows), the held experts from the parameter's own placements
(``compute_local_shape_and_global_offset``), and the invariants a wrong reading would break
are checked: the parameter's mesh carries the dispatcher's EP mesh as one dimension, with
``Shard(0)`` on it; every placement shards dim 0 or replicates (whole experts); the held
experts lie inside the chunk; at each capture, the forward's counts are the chunk's and its
parameter sits at the chunk's offset.
"""
import dataclasses

import torch
import torch.distributed as dist

from ..exchange import LOCAL

__all__ = ["ExpertShard", "ep_problem", "expert_shard", "fsdp_expert_shard", "check_forward_chunk",
           "global_layer_state", "local_layer_state", "as_lists", "as_tuples"]

# (default group, tuple of ranks) -> process group (every rank builds the same ones, in order)
_GROUPS = {}


@dataclasses.dataclass(frozen=True)
class ExpertShard:
    """One stack under EP (module docstring): ``experts`` E, ``seen`` and ``held`` global
    [lo, hi) ranges, ``row_group`` the process group of the ranks that see the same chunk
    (:data:`~torch_impl.kronecker.exchange.LOCAL`: this rank alone), ``row_ranks`` its size."""

    experts: int
    seen: tuple
    held: tuple
    row_group: object
    row_ranks: int

    @property
    def n_seen(self):
        return self.seen[1] - self.seen[0]

    @property
    def n_held(self):
        return self.held[1] - self.held[0]

    def kept(self, x):
        """The held experts' entries of ``x``, led by the seen experts."""
        if self.held == self.seen:
            return x
        lo = self.held[0] - self.seen[0]
        return x[lo:lo + self.n_held]


def _dtensor_type():
    from torch.distributed.tensor import DTensor
    return DTensor


def _offset(tensor):
    """(local rows, global row offset) of a DTensor's local shard along dim 0."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,
                                                          tensor.placements)
    return shape[0], offset[0]


def _chunk(num_experts, ep_mesh):
    ep = ep_mesh.size()
    per = num_experts // ep
    c = ep_mesh.get_local_rank()
    return (c * per, (c + 1) * per)


def ep_problem(num_experts, params, ep_mesh):
    """None if the stacks ``params`` ({name: parameter}) of a module of ``num_experts``
    experts are laid out as EP on ``ep_mesh`` (module docstring), else what contradicts it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.placement_types import _StridedShard
    if not isinstance(ep_mesh, DeviceMesh):
        return f"its EP mesh is a {type(ep_mesh).__name__}, not a DeviceMesh"
    ep = ep_mesh.size()
    if ep_mesh.ndim != 1 or num_experts % ep:
        return (f"an EP mesh of {ep_mesh.ndim} dimensions and size {ep} for {num_experts} "
                "experts: expected one dimension dividing the experts")
    name = ep_mesh.mesh_dim_names[0] if ep_mesh.mesh_dim_names else None
    seen = _chunk(num_experts, ep_mesh)
    held = set()
    for pname, p in params.items():
        if not isinstance(p, _dtensor_type()):
            return f"{pname} is not a DTensor under an EP dispatcher"
        names = p.device_mesh.mesh_dim_names or ()
        if name is None or name not in names:
            return (f"{pname} lives on the mesh {names}, which does not carry the dispatcher's "
                    f"EP dimension {name!r}")
        for dim, placement in zip(names, p.placements):
            # FSDP's efsdp sharding of an EP stack is a strided dim-0 shard: whole experts
            whole = (isinstance(placement, Replicate)
                     or (isinstance(placement, (Shard, _StridedShard)) and placement.dim == 0))
            if dim == name and not (isinstance(placement, Shard) and placement.dim == 0
                                    and type(placement) is Shard):
                return f"{pname} is placed {placement} on the EP dimension, not Shard(0)"
            if not whole:
                return (f"{pname} is placed {placement} on {dim!r}: only whole experts "
                        "(dim 0 sharded, or replicated) are supported; expert tensor "
                        "parallelism (Shard(1) / Shard(2) of the experts' matrices) is not")
        if not torch.equal(p.device_mesh[name].mesh, ep_mesh.mesh):
            return f"{pname}'s {name!r} ranks are not the dispatcher's EP group"
        rows, lo = _offset(p)
        if tuple(p.to_local().shape[1:]) != tuple(p.shape[1:]):
            return f"{pname}'s local shard is not whole experts"
        held.add((lo, lo + rows))
    if len(held) != 1:
        return f"the stacks hold different experts here: {sorted(held)}"
    (lo, hi), = held
    if not (seen[0] <= lo <= hi <= seen[1]) or hi == lo:
        return (f"this rank holds the experts [{lo}, {hi}), outside the chunk [{seen[0]}, "
                f"{seen[1]}) its EP coordinate routes to it")
    return None


def _row_group(p, ep_name):
    """The process group of the ranks sharing every coordinate of ``p``'s mesh but the EP
    one, with this rank (``LOCAL`` when that is the rank alone). Every rank creates every such
    group, in the same order, so the collective ``new_group`` calls match."""
    mesh = p.device_mesh
    names = list(mesh.mesh_dim_names)
    at = names.index(ep_name)
    ranks = mesh.mesh.movedim(at, -1).reshape(-1, mesh.mesh.shape[at])
    if ranks.shape[0] == 1:
        return LOCAL, 1
    me = dist.get_rank()
    mine = None
    world = id(dist.distributed_c10d._get_default_group())  # a re-initialised job: new groups
    for column in ranks.t().tolist():
        key = (world, tuple(column))
        if key not in _GROUPS:
            _GROUPS[key] = dist.new_group(list(column))
        if me in column:
            mine = _GROUPS[key]
    return mine, ranks.shape[0]


def expert_shard(num_experts, params, ep_mesh):
    """The :class:`ExpertShard` of a stack (``params`` as :func:`ep_problem`, which must have
    found no problem); creates the row groups (collective: every rank calls it for the same
    stacks in the same order)."""
    p = next(iter(params.values()))
    rows, lo = _offset(p)
    group, size = _row_group(p, ep_mesh.mesh_dim_names[0])
    return ExpertShard(num_experts, _chunk(num_experts, ep_mesh), (lo, lo + rows), group, size)


def fsdp_expert_shard(num_experts, weight):
    """The :class:`ExpertShard` of a stack FSDP2 shards ``Shard(0)`` over the experts on a 1-D
    mesh, without EP (per-expert owner placement): every rank's capture sees all E experts
    (the local dispatch), holds its shard's (possibly none), and the row group is the mesh."""
    rows, lo = _offset(weight)
    mesh = weight.device_mesh
    return ExpertShard(num_experts, (0, num_experts), (lo, lo + rows), mesh.get_group(),
                       mesh.size())


def check_forward_chunk(shard, weight, counts):
    """At a capture: the forward's ``counts`` are the chunk's and its (unsharded) ``weight``
    sits at the chunk's offset; raises ``ValueError`` otherwise."""
    if counts.numel() != shard.n_seen:
        raise ValueError(f"token counts for {counts.numel()} experts, not the {shard.n_seen} "
                         f"of this rank's EP chunk {list(shard.seen)}")
    if isinstance(weight, _dtensor_type()):
        rows, lo = _offset(weight)
        if (lo, lo + rows) != shard.seen:
            raise ValueError(f"the forward multiplied the experts [{lo}, {lo + rows}), not "
                             f"this rank's EP chunk {list(shard.seen)}")
    elif weight.shape[0] != shard.n_seen:
        raise ValueError(f"the forward multiplied a plain stack of {weight.shape[0]} experts, "
                         f"not this rank's EP chunk {list(shard.seen)}")


def _led(shard, name, key, value, lead):
    if value.dim() == 0 or value.shape[0] != lead:
        raise ValueError(f"{name}.{key}: a stack's state is led by its experts ({lead}), got "
                         f"shape {tuple(value.shape)}")


def _map(value, fn, sequence=tuple):
    """``fn`` on each tensor of ``value`` (a tensor, or a tuple / list of them, e.g. K-FAC's
    (eigenvalues, eigenvectors)), the sequence rebuilt as ``sequence``; anything else as it is."""
    if torch.is_tensor(value):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return sequence(_map(v, fn, sequence) for v in value)
    return value


def as_lists(state):
    """A stack's layer state with its tuples of tensors as lists (what DCP traverses)."""
    return {key: _map(value, lambda t: t, list) for key, value in state.items()}


def as_tuples(state):
    """:func:`as_lists` undone."""
    return {key: _map(value, lambda t: t, tuple) for key, value in state.items()}


def global_layer_state(shard, weight, name, state):
    """A held stack's layer state as checkpoints see it: each tensor (led by the held
    experts) a DTensor of all E experts placed as the stack's ``weight`` (``Shard(0)`` on the
    EP dimension, FSDP's dim-0 shard beside it), so DCP saves every rank's experts and loads
    them into any layout: another EP degree, FSDP2 without EP, one process (plain tensors)."""
    from torch.distributed.tensor import DTensor

    def placed(key):
        def fn(value):
            _led(shard, name, key, value, shard.n_held)
            shape = (shard.experts, *value.shape[1:])
            return DTensor.from_local(value, weight.device_mesh, weight.placements,
                                      run_check=False, shape=torch.Size(shape),
                                      stride=torch.empty(shape, device="meta").stride())
        return fn
    # a tuple is one opaque object to DCP (saved from one rank); a list of tensors is
    # traversed, each tensor sharded: K-FAC's (eigenvalues, eigenvectors) travel as a list
    return {key: _map(value, placed(key), list) for key, value in state.items()}


def local_layer_state(shard, name, state):
    """The held experts' part of a saved layer state: a DTensor's local shard (DCP loaded it
    into :func:`global_layer_state`'s layout), or the held rows of all E experts' plain tensors
    (``torch.save`` of one process); a list of tensors back to the tuple it was."""
    def held(key):
        def fn(value):
            if isinstance(value, _dtensor_type()):
                return value.to_local()
            _led(shard, name, key, value, shard.experts)
            return value[shard.held[0]:shard.held[1]]
        return fn
    return {key: _map(value, held(key)) for key, value in state.items()}
