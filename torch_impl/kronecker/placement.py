r"""MKOR and K-FAC on FSDP2 (``fully_shard``) models: which sharding is supported, and the
sharded gradient preconditioned exactly, with replicated or owner-per-layer factors.

Under FSDP2 a layer's forward and backward run on the *unsharded* weight, so the hooks see
full-width input rows and output gradients of the rank's own batch: the statistics, and
MKOR's O(d) all-reduce of (a_bar, g_bar), are exactly the DDP ones. What changes is the
gradient: after the backward, ``weight.grad`` is a ``DTensor`` holding rows S_r of the
(d_out, d_in') matrix on rank r (``Shard(0)``), and MKOR's

.. math:: \Delta = L^{-1}\,[\nabla W \,|\, \nabla b]\,R^{-1}, \qquad
          \Delta \leftarrow \frac{\|\hat G\|}{\|\Delta\|}\,\Delta

needs every row of it: row block S_r of Delta is L^{-1}[S_r, :] Ĝ R^{-1}, a function of the
*whole* Ĝ, and the rescale's norms are global. Factor placement here is **replicated**:
every rank holds L^{-1} and R^{-1} (the factor updates, driven by the all-reduced vectors,
are the same on every rank, as under DDP), gathers the whole gradient with one all-gather
per layer per step (``full_tensor``), computes Delta and its norms locally (the same numbers
on every rank: no further collective, and the stabiliser and the rescale see global norms by
construction), and keeps its own rows. Bytes per step: each rank receives the rows it does
not hold, (P-1)/P of the gradient, for every preconditioned layer; factor memory is the DDP
one on every rank. An all-gather rather than a reduce of partial products because Delta's
rows need whole rows of Ĝ R^{-1} and all of L^{-1}: gathering Ĝ moves d_out d_in' values,
gathering Y = Ĝ_local R^{-1} would move the same, and the gathered Ĝ also gives the norms.

**Owner-per-layer** factors (``factor_placement="owner"``): each sharded layer's factors live
on one rank of the gradient's mesh, chosen by :func:`assign_owners` (greedy longest-first on
the factor entries d_out^2 + d_in'^2, ties to the lower rank: deterministic, the same on every
rank). The owner alone updates them (MKOR's vectors are still all-reduced, O(d); K-FAC
reduces its O(d^2) sums to the owner alone), and each step :class:`OwnerGradients` gathers
the layer's gradient rows to the owner (``gather``), which preconditions the whole gradient
and sends each rank its rows back (``scatter``): two gradient-sized moves that touch only
the owner's link, and factor memory divided by the world size. A rank keeps no state at all
for a layer it does not own (:func:`owns`), so a distributed checkpoint holds one copy of
each layer's state, the owner's. Layers whose gradients are plain tensors keep replicated
factors.

Supported: parameters that are plain tensors, or DTensors placed by FSDP2 (a module of the
model, or an ancestor of the layer, is an ``FSDPModule``) as ``Shard(0)`` on a 1-D mesh or
``(Replicate(), Shard(0))`` on HSDP's 2-D mesh. Anything else (tensor parallel's
``Shard(1)`` or a sharded activation, a DTensor no ``fully_shard`` placed) would give the
hooks partial rows or the gradient a layout this module does not gather: it is refused at
construction, naming the parameter, never trained with a wrong preconditioner.

**Parameters replaced after construction** (:class:`ParameterBinding`). Accelerate's FSDP2
``prepare(model, optimizer)`` shards a model whose optimizer already exists:
``fully_shard`` replaces every parameter by a new ``DTensor`` parameter (the modules stay the
same objects) and ``fsdp2_switch_optimizer_parameters`` puts the new ones into the
optimizer's param groups -- the backbone's, which are the preconditioner's. The layers
refer to *modules* and read ``module.weight`` and its gradient at every step, so the
statistics and the preconditioned gradient need nothing new; what construction decided
from the parameters is redone at the first step that sees them replaced: the sharding
check, the owner map (``factor_placement="owner"``: a rank drops the factors of the layers
it no longer keeps, all equal on every rank until then), the state's device, and the
weight hooks of the capture. The result is the run of a preconditioner built after
``fully_shard``. If the backbone does *not* hold the new parameters (the model was
re-parameterised after the optimizer was built and nobody switched them), the backbone
would step tensors that no longer receive gradients: the step raises ``RuntimeError``.
"""
import math
import weakref

import torch
import torch.distributed as dist

from ..common.sharding import assign_owners as lpt_owners, is_dtensor
from .discovery import unwrap_model
from .experts.parallel import fsdp_expert_shard
from .layers import LayerType

__all__ = ["SUPPORTED_PLACEMENTS", "check_supported_sharding", "FullGradients", "OwnerGradients",
           "LocalGradients", "gradients_of",
           "assign_owners", "owner_map", "owns", "kept_here", "ParameterBinding"]

SUPPORTED_PLACEMENTS = ("plain tensors, or FSDP2 fully_shard DTensors placed Shard(0) on a 1-D "
                        "mesh or (Replicate(), Shard(0)) on an HSDP mesh")


def _fsdp_roots(model):
    """Names of the modules ``fully_shard`` was applied to ('' for the model itself)."""
    import sys
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kind = getattr(fsdp, "FSDPModule", None)
    if kind is None:
        return []
    return [name for name, module in model.named_modules() if isinstance(module, kind)]


def _placement_ok(tensor):
    from torch.distributed.tensor import Replicate, Shard
    placements = tuple(tensor.placements)
    return placements == (Shard(0),) or placements == (Replicate(), Shard(0))


def check_supported_sharding(model, layers, owner):
    """Raise ``ValueError`` naming the first preconditioned parameter whose sharding this
    module cannot precondition exactly (see the module docstring)."""
    roots = None
    for layer in layers:
        if layer.expert_shard is not None:  # EP: whole experts per rank, checked by the adapter
            continue
        module = layer.module
        params = [("weight", module.weight)] + (
            [("bias", module.bias)] if getattr(module, "bias", None) is not None else [])
        for kind, p in params:
            if not is_dtensor(p):
                continue
            if roots is None:
                roots = _fsdp_roots(model)
            under_fsdp = any(r == "" or layer.name == r or layer.name.startswith(r + ".")
                             for r in roots)
            if not under_fsdp or not _placement_ok(p):
                raise ValueError(
                    f"{owner}: {layer.name}.{kind} is a DTensor with placements "
                    f"{tuple(p.placements)} on a {p.device_mesh.ndim}-D mesh"
                    f"{'' if under_fsdp else ' that no fully_shard placed'}; supported: "
                    f"{SUPPORTED_PLACEMENTS} (tensor parallel and other shardings give the "
                    f"hooks partial rows). Leave the layer out with skip_modules, or "
                    f"shard it with fully_shard only.")
            if kind == "weight" and type(layer.type).as_matrix is LayerType.as_matrix:
                raise ValueError(
                    f"{owner}: {layer.name}.weight is sharded by FSDP2 and its layer type "
                    f"{layer.type.name!r} has no as_matrix(): define it (a (d_out, d_in) view "
                    f"of a weight-shaped tensor) to precondition it under FSDP2")


class _Gradients:
    """The context-manager protocol of both: on a clean exit, ``write_back``."""

    def matrix(self, layer):
        """The layer's (d_out, d_in) weight-gradient matrix to read and write: a view of the
        gathered whole gradient, or of ``.grad`` itself (through the layer type's own view)."""
        if self.sharded:
            return layer.type.as_matrix(layer.module, self.weight)
        return layer.type.grad_matrix(layer.module)

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace):
        if kind is None:
            self.write_back()
        return False


class FullGradients(_Gradients):
    """The layer's whole weight and bias gradients while preconditioning, written back to
    the rank's shards afterwards (plain gradients pass through untouched).

    ``weight``, ``bias``: the gradients to read and write in place (the gathered whole
    tensors for DTensor gradients, else ``.grad`` itself); ``sharded``: whether any was
    gathered. Used as ``with FullGradients(module) as full: ...``; on an exception nothing
    is written back."""

    def __init__(self, module):
        self._module = module
        bias = getattr(module, "bias", None)
        self._pairs = [(module.weight.grad, None),
                       (None if bias is None else bias.grad, None)]
        self.sharded = any(is_dtensor(g) for g, _ in self._pairs)
        self.weight, self.bias = (g.full_tensor() if is_dtensor(g) else g
                                  for g, _ in self._pairs)

    def write_back(self):
        """This rank's rows of the (preconditioned) whole gradients into its shards."""
        for shard, full in zip((p for p, _ in self._pairs), (self.weight, self.bias)):
            if is_dtensor(shard):
                _write_rows(shard, full)


def _write_rows(shard, full):
    """This rank's part of ``full`` into the DTensor ``shard``'s local tensor."""
    from torch.distributed.tensor import distribute_tensor
    # src_data_rank=None: every rank already holds the same full tensor; just slice it.
    mine = distribute_tensor(full, shard.device_mesh, shard.placements, src_data_rank=None)
    shard.to_local().copy_(mine.to_local())


def assign_owners(costs, world):
    """{name: rank} for ``costs`` ({name: cost}, in layer order): the costliest first, each to
    the least-loaded rank (ties: the lower rank; equal costs keep the layer order), the greedy
    LPT map MARS's owner orthogonalisation uses (:func:`~torch_impl.common.sharding.assign_owners`)."""
    return dict(zip(costs, lpt_owners(list(costs.values()), world)))


def owner_map(layers, placement, owner, split_stacks=True):
    """{layer name: (owning rank, process group)} for the layers whose factors live on one
    rank (``placement == "owner"``: the FSDP2-sharded ones, on their 1-D mesh); {} otherwise.
    With ``split_stacks`` a stack of experts sharded ``Shard(0)`` over its experts is owned
    per expert instead: each rank keeps the factors of the experts its shard holds
    (``layer.expert_shard``, :func:`~.experts.parallel.fsdp_expert_shard`), so no gradient
    moves for it; set here, before the preconditioner lays out its state and exchanges."""
    if placement != "owner":
        return {}
    # a stack under expert parallelism keeps its held experts' factors where they lie already
    sharded = [l for l in layers if is_dtensor(l.module.weight) and l.expert_shard is None]
    if not sharded:
        return {}
    mesh = sharded[0].module.weight.device_mesh  # each fully_shard call may build its own
    if mesh.ndim != 1 or any(l.module.weight.device_mesh != mesh for l in sharded):
        raise ValueError(f"{owner}: factor_placement='owner' needs every sharded layer on one "
                         f"1-D mesh (FSDP2 without HSDP); use factor_placement='replicated'")
    if split_stacks:
        from torch.distributed.tensor import Shard
        for layer in sharded:
            w = layer.module.weight
            if layer.experts is not None and layer.experts == w.shape[0] and \
                    tuple(w.placements) == (Shard(0),):
                layer.expert_shard = fsdp_expert_shard(layer.experts, w)
                layer.kept = layer.expert_shard.n_held
        sharded = [l for l in sharded if l.expert_shard is None]
        if not sharded:
            return {}
    costs = {l.name: (0 if l.identity_L else l.d_out ** 2) + (0 if l.identity_R else l.d_in ** 2)
             for l in sharded}
    group = mesh.get_group()
    return {name: (rank, group) for name, rank in assign_owners(costs, mesh.size()).items()}


def owns(owners, name):
    """Whether this rank keeps ``name``'s factors: always, unless :func:`owner_map` gave
    them to another rank."""
    if name not in owners:
        return True
    rank, group = owners[name]
    return dist.get_rank(group) == rank


def kept_here(name, own, saved):
    """Whether a saved layer state is loaded into this rank's ``own``: not where another
    rank owns the layer (``own`` is empty); a layer this rank keeps but the saved state
    lacks (one rank's ``state_dict()`` of owner-placed factors) raises."""
    if not own:
        return False
    if not saved:
        raise ValueError(f"{name}: the state_dict holds no state for this layer (saved by a "
                         "rank that did not own it? save owner-placed factors with "
                         "torch.distributed.checkpoint)")
    return True


class OwnerGradients(_Gradients):
    """Like :class:`FullGradients` for a layer whose factors one rank owns: the owner gets
    the whole gradients (``weight``, ``bias``; None elsewhere) by one ``gather`` each, and
    ``write_back`` sends every rank its rows of them (one ``scatter`` each)."""

    sharded = True

    def __init__(self, module, owner, group):
        self._owner, self._group = owner, group
        bias = getattr(module, "bias", None)
        self._shards = [module.weight.grad, None if bias is None else bias.grad]
        self.is_owner = dist.get_rank(group) == owner
        self.weight, self.bias = (None if g is None else self._gather(g) for g in self._shards)

    def _layout(self, shard):
        world = dist.get_world_size(self._group)
        rows = shard.shape[0]
        chunk = math.ceil(rows / world)  # Shard(0)'s split: torch.chunk's, the last ones short
        counts = [max(0, min(chunk, rows - r * chunk)) for r in range(world)]
        return chunk, counts

    def _gather(self, shard):
        chunk, counts = self._layout(shard)
        local = shard.to_local()
        padded = local.new_zeros((chunk,) + tuple(shard.shape[1:]))
        padded[:local.shape[0]] = local
        into = [torch.empty_like(padded) for _ in counts] if self.is_owner else None
        dist.gather(padded, into, dst=dist.get_global_rank(self._group, self._owner),
                    group=self._group)
        return torch.cat([g[:n] for g, n in zip(into, counts)]) if self.is_owner else None

    def write_back(self):
        """Every rank's rows of the owner's (preconditioned) whole gradients."""
        for shard, full in zip(self._shards, (self.weight, self.bias)):
            if shard is None:
                continue
            chunk, counts = self._layout(shard)
            local = shard.to_local()
            mine = local.new_empty((chunk,) + tuple(shard.shape[1:]))
            out = None
            if self.is_owner:
                out = [full.new_zeros(mine.shape) for _ in counts]
                for r, n in enumerate(counts):
                    out[r][:n] = full[r * chunk:r * chunk + n]
            dist.scatter(mine, out, src=dist.get_global_rank(self._group, self._owner),
                         group=self._group)
            local.copy_(mine[:local.shape[0]])


class LocalGradients(_Gradients):
    """The gradients of a stack under expert parallelism: this rank's shard of whole experts,
    the ones whose factors it keeps, read and written in place (no collective)."""

    sharded = True

    def __init__(self, module):
        bias = getattr(module, "bias", None)
        self.weight, self.bias = (None if g is None else g.to_local() if is_dtensor(g) else g
                                  for g in (module.weight.grad,
                                            None if bias is None else bias.grad))

    def write_back(self):
        pass  # the local tensors are the gradients' own storage


def gradients_of(layer, owner=None):
    """The gradients to precondition ``layer`` with: its shard of held experts (expert
    parallelism), gathered to its ``owner`` (rank, group), or gathered whole (plain ones as
    they are)."""
    if layer.expert_shard is not None:
        return LocalGradients(layer.module)
    return FullGradients(layer.module) if owner is None else OwnerGradients(layer.module, *owner)


def _layer_params(layer):
    bias = getattr(layer.module, "bias", None)
    return (layer.module.weight,) if bias is None else (layer.module.weight, bias)


def _moved_to(value, device):
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, tuple):
        return tuple(_moved_to(v, device) for v in value)
    return value


class ParameterBinding:
    """The parameter objects a preconditioner's layers were built on (held weakly: a
    replaced parameter is not kept alive), to follow their replacement (module
    docstring). ``moved()`` is O(layers) identity tests, run at every step."""

    def __init__(self, layers):
        self._layers = list(layers)
        self._refs = self._read()

    def _read(self):
        return [tuple(weakref.ref(p) for p in _layer_params(l)) for l in self._layers]

    def moved(self):
        """Whether some layer's weight or bias is no longer the parameter it was."""
        return any(len(refs) != len(now) or any(r() is not p for r, p in zip(refs, now))
                   for refs, now in zip(self._refs, map(_layer_params, self._layers)))

    def follow(self, pre, placement, owner):
        """Redo what construction decided from the parameters, for the preconditioner
        ``pre`` (its ``optimizer``, ``model``, ``_layers``, ``_owners``, ``_state``,
        ``_capture``): returns the new owner map. Raises ``RuntimeError`` if the backbone
        does not hold the layers' current parameters, ``ValueError`` if their sharding is
        unsupported (:func:`check_supported_sharding`)."""
        held = {id(p) for group in pre.optimizer.param_groups for p in group["params"]}
        stale = [f"{l.name}.{kind}" for l in self._layers
                 for kind, p in zip(("weight", "bias"), _layer_params(l))
                 if p.requires_grad and id(p) not in held]
        if stale:
            raise RuntimeError(
                f"{owner}: the parameters of {', '.join(stale[:3])}"
                f"{' and others' if len(stale) > 3 else ''} were replaced since {owner} was "
                f"built (fully_shard or another re-parameterisation) and the backbone "
                f"optimizer does not hold the new ones, so it would step tensors that no "
                f"longer get gradients. Build the optimizer and {owner} after sharding the "
                f"model, or pass the model and the optimizer together to "
                f"accelerate's Accelerator.prepare(model, optimizer), which switches them")
        check_supported_sharding(unwrap_model(pre.model), self._layers, owner)
        # a stack sharded only now keeps its whole-stack owner: its state and exchanges were
        # laid out for every expert at construction
        owners = owner_map(self._layers, placement, owner, split_stacks=False)
        for layer in self._layers:
            name, state = layer.name, pre._state[layer.name]
            if not owns(owners, name):
                pre._state[name] = {}  # another rank keeps this layer's factors now
            elif not owns(pre._owners, name):
                raise RuntimeError(f"{owner}: {name}'s factors were kept by another rank "
                                   "and the new sharding puts them here; build the "
                                   f"{owner} after sharding the model")
            else:
                device = layer.module.weight.device
                pre._state[name] = {k: _moved_to(v, device) for k, v in state.items()}
        pre._capture.rehook_weights()
        self._refs = self._read()
        return owners
