r"""torchtitan's optimizer container, able to name MARS, MARS-M, LAMB, MKOR and K-FAC.

torchtitan (0.3) builds its optimizers in ``OptimizersContainer``: a config lists
``ParamGroupConfig(pattern, optimizer_name, optimizer_kwargs)``, names resolve through a
fixed table (Adam, AdamW, DistMuon), each factory gets parameter groups carrying
``param_names`` and ``fused`` / ``foreach`` from ``implementation``, and checkpoints go
through its flat, FQN-keyed layout. :class:`Optimizers` is that container with more names::

    from torchtitan.components.optimizer import ParamGroupConfig
    from torch_impl.integrations.torchtitan import Optimizers

    optimizer = Optimizers.Config(
        implementation="foreach",
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="MKOR",
                                       optimizer_kwargs={"lr": 3e-4, "weight_decay": 0.1})],
        optimizer_factory_kwargs_by_name={"MKOR": {"backbone": "AdamW", "inv_freq": 10}})

* ``MARS``, ``MARSM``, ``LAMB``: the group kwargs are theirs (``torch_impl.MARS`` etc.).
* ``MKOR``, ``KFAC``: the group kwargs are the backbone's; ``optimizer_factory_kwargs_by_name``
  names the ``backbone`` (any first-order name here: Adam, AdamW, MARS, MARSM, LAMB) and
  carries the preconditioner's own options. The preconditioner gets its model part (it
  preconditions the layers whose weights its groups hold). One preconditioner per model
  part: two would each own the part's hooks.
* ``implementation``: torchtitan's names keep torchtitan's meaning. Ours have no fused
  kernel: ``"fused"`` (torchtitan's default) and ``"fused_opt_states_bf16"`` are refused with
  what to set instead (``"foreach"``, ``"for-loop"``, or ``"fused": False`` in a group's
  kwargs, which torchtitan lets override it); ``"foreach"`` / ``"for-loop"`` set ``foreach``.

**No counted init step.** torchtitan's ``init_optim_state`` runs one zero-gradient, lr = 0
``step()`` on an optimizer whose ``state`` is empty (before a save or a load); on MARS, LAMB,
MKOR or Adam that step counts (bias corrections, MKOR's schedules) and changes the run. The
container creates each optimizer's state at construction instead, as its first step would
with every counter at 0 (``init_state()``; :mod:`torch_impl.common.optim_state` for torch's
Adam / AdamW), so ``init_optim_state`` finds state and does nothing. (DistMuon keeps
torchtitan's behaviour.)

**Statistics under torchtitan's FSDP.** torchtitan's FSDP sums the gradients over the ranks
(``gradient_divide_factor`` 1) and divides its loss by the global token count, so each
rank's output gradients are 1/world of what MKOR's and K-FAC's statistics assume (a rank-local
mean loss, averaged): the container passes ``grad_scale = factor / world`` read from the
model's FSDP groups (:func:`statistics_scale`) unless ``grad_scale`` or ``grad_scaler`` is given.

**Checkpoints.** MKOR's and K-FAC's own state lies on the parameters
(:mod:`torch_impl.kronecker.state_layout`), so torchtitan's ``get_flat_optim_state_dict`` /
``load_flat_optim_state_dict`` carry it as ``state.{weight fqn}.mkor.{name}`` and
``state.{first fqn}.mkor_run.{name}``.
"""
import dataclasses

from torchtitan.components.optimizer import OptimizersContainer

from torch_impl.baselines import KFAC, LAMB
from torch_impl.common.optim_state import init_backbone_state
from torch_impl.mars import MARS, MARSM
from torch_impl.mkor import MKOR

__all__ = ["Optimizers", "FIRST_ORDER", "PRECONDITIONERS", "statistics_scale"]

FIRST_ORDER = {"MARS": MARS, "MARSM": MARSM, "LAMB": LAMB}
PRECONDITIONERS = {"MKOR": MKOR, "KFAC": KFAC}
_FUSED = ("fused", "fused_opt_states_bf16")


def _torchtitan_names():
    """The names torchtitan's own table resolves (probed, not listed: its table is private)."""
    names = []
    for name in ("Adam", "AdamW", "DistMuon"):
        try:
            OptimizersContainer._resolve_optimizer_factory(name)
        except NotImplementedError:
            continue
        names.append(name)
    return tuple(names)


def statistics_scale(model):
    """The scale of one rank's output gradients relative to a rank-local mean loss, which is
    what MKOR's and K-FAC's statistics assume (each rank's gradient of its own mean loss,
    averaged over the ranks). FSDP2 divides the summed gradients by each group's
    ``gradient_divide_factor`` (None: the world size); torchtitan sets it to 1 and divides
    its loss by the global token count instead, so each rank's gradients are 1/world of the
    local-mean ones and the statistics must be divided by ``factor / world``. Read from the
    model's FSDP groups, which must agree; 1.0 for a model without FSDP."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return 1.0
    factors, worlds = set(), set()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            for group in state._fsdp_param_groups:
                world = group.mesh_info.shard_mesh_size
                factor = group.gradient_divide_factor
                factors.add(float(world if factor is None else factor))
                # a group placed on mesh dimensions beyond FSDP's (expert parallelism's
                # ``efsdp`` x ``ep`` stacks) shards over fewer ranks than the loss averages,
                # while its rows are tokens' gradients of the same loss: its divide factor
                # must agree, its shard size does not define the data-parallel world
                if not _beyond_fsdp(group):
                    worlds.add(world)
    if not factors:
        return 1.0
    if len(factors) > 1 or len(worlds) > 1:
        raise ValueError(f"FSDP groups of the model divide their gradients by {sorted(factors)} "
                         f"over {sorted(worlds)} ranks: MKOR's / K-FAC's statistics need one "
                         "scale; pass grad_scale in optimizer_factory_kwargs_by_name")
    return factors.pop() / worlds.pop()


def _beyond_fsdp(group):
    """Whether an FSDP param group's parameters live on a mesh of more dimensions than its
    FSDP mesh (torchtitan's EP stacks: (efsdp, ep) against FSDP's efsdp)."""
    mesh = group.mesh_info.mesh
    return any(p.sharded_param.device_mesh.ndim > mesh.ndim for p in group.fsdp_params)


class Optimizers(OptimizersContainer):
    """``OptimizersContainer`` that also names MARS, MARSM, LAMB, MKOR and KFAC (module
    docstring); everything else (checkpoints, ``step``, ``zero_grad``, hooks) is torchtitan's."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    def __init__(self, config, *, model_parts):
        impl = config.implementation
        if impl not in ("for-loop", "foreach") + _FUSED:
            raise ValueError(f"implementation: expected one of 'for-loop', 'foreach', 'fused', "
                             f"'fused_opt_states_bf16', got {impl!r}")
        self.optimizers, self.model_parts = [], model_parts
        self._derived_scales = []
        impl_kwargs = {"fused": impl in _FUSED, "foreach": impl == "foreach"}
        all_params = []
        for part_idx, model in enumerate(model_parts):
            by_name, patterns = self._build_param_groups(model, config.param_groups, impl_kwargs)
            preconditioners = [n for n in by_name if n in PRECONDITIONERS]
            if len(preconditioners) > 1:
                raise ValueError(f"model part {part_idx}: {preconditioners} both precondition "
                                 "it; one preconditioner per model part (each owns the "
                                 "part's hooks)")
            for name, groups in by_name.items():
                kwargs = dict(config.optimizer_factory_kwargs_by_name.get(name, {}))
                optimizer = self._build(name, groups, kwargs, model, impl)
                self.optimizers.append(optimizer)
                self._log_optimizer(optimizer, part_idx, patterns[name])
                for group in groups:
                    all_params.extend(group["params"])
        self._validate_params(all_params)
        if impl == "fused_opt_states_bf16":
            self._register_bf16_optimizer_state_hook()
        for optimizer in self.optimizers:  # before any init_optim_state (module docstring)
            ours = isinstance(optimizer, tuple(FIRST_ORDER.values()) +
                              tuple(PRECONDITIONERS.values()))
            try:
                init_backbone_state(optimizer)
            except TypeError:
                if ours:  # MKOR over a backbone whose initial state is not known here
                    raise
                # DistMuon & co: torchtitan's own init step, as before
        self._post_init(all_params)

    def _build(self, name, groups, kwargs, model, impl):
        if name in PRECONDITIONERS:
            backbone = kwargs.pop("backbone", None)
            if backbone is None or backbone in PRECONDITIONERS:
                raise ValueError(
                    f"optimizer_factory_kwargs_by_name[{name!r}]['backbone']: the first-order "
                    f"optimizer {name} preconditions, one of "
                    f"{sorted(FIRST_ORDER) + list(_torchtitan_names())}, got {backbone!r}")
            inner = self._build(backbone, groups, {}, model, impl)
            derived = "grad_scale" not in kwargs and "grad_scaler" not in kwargs
            if derived:
                kwargs["grad_scale"] = statistics_scale(model)
            pre = PRECONDITIONERS[name](model, inner, **kwargs)
            if derived:  # a property of this job's world, not of the checkpoint
                self._derived_scales.append((pre, kwargs["grad_scale"]))
            return pre
        if name in FIRST_ORDER:
            for group in groups:
                if group.get("fused"):
                    raise ValueError(
                        f"implementation={impl!r}: {name} has no fused kernel; set the "
                        "optimizer config's implementation to 'foreach' or 'for-loop', or "
                        "'fused': False in this group's optimizer_kwargs")
                if impl == "fused_opt_states_bf16":
                    raise ValueError(f"implementation='fused_opt_states_bf16' is torchtitan's "
                                     f"Adam/AdamW mode; {name} keeps its state in state_dtype")
            return FIRST_ORDER[name](groups, **kwargs)
        try:
            factory = OptimizersContainer._resolve_optimizer_factory(name)
        except NotImplementedError:
            raise ValueError(f"optimizer_name {name!r}: not one of "
                             f"{sorted(FIRST_ORDER) + sorted(PRECONDITIONERS) + list(_torchtitan_names())}"
                             ) from None
        return factory(groups, **kwargs)

    def load_state_dict(self, state_dict):
        """torchtitan's load; then each preconditioner's derived statistics scale is this
        job's again (a checkpoint saved on another number of ranks carries its own)."""
        super().load_state_dict(state_dict)
        for pre, scale in self._derived_scales:
            pre.set_grad_scale(scale)
