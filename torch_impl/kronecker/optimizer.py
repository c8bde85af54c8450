r"""The ``torch.optim.Optimizer`` face of a hook-based preconditioner (MKOR, K-FAC): one class,
:class:`PreconditionedOptimizer`, that both methods subclass.

A preconditioner wraps a backbone optimizer and must work wherever a
``torch.optim.Optimizer`` is expected: ``torch.amp.GradScaler``, the
``torch.optim.lr_scheduler`` classes, ``transformers.Trainer(optimizers=...)``, a
Lightning ``configure_optimizers``, checkpoints. :class:`PreconditionedOptimizer`
therefore *is* an Optimizer whose ``param_groups``, ``state`` and ``defaults`` are the
backbone's own objects (properties, so a scheduler's lr change or a backbone
``load_state_dict`` is seen at once), and whose ``state_dict()`` is the backbone's with the
preconditioner's state laid out on the parameters (:mod:`.state_layout`), so it travels
wherever per-parameter state does (``torch.save``, DCP, torchtitan's flat FQN layout);
``init_state`` creates the backbone's state without a counted step. What it tells about its
layers (which are preconditioned, why the others are not, which rows each read, the
self-check's verdicts) is :meth:`PreconditionedOptimizer.capture_report` (:mod:`.report`).

**GradScaler.** The class sets ``_step_supports_amp_scaling``, so ``scaler.step(opt)`` hands
it the loss scale and an overflow flag instead of unscaling the gradients itself. The step
then (1) reads the flag, a host synchronisation, exactly the one ``GradScaler`` makes for a
plain optimizer, and on overflow returns with *nothing* changed (parameters, backbone state,
factors, counters) and that batch's statistics dropped; (2) otherwise unscales the
gradients with the kernel ``GradScaler.unscale_`` uses (bit-identical), and (3) divides the
captured output-gradient statistics by that scale. If the gradients were already unscaled
(``scaler.unscale_(opt)`` before clipping), the scale is not handed over: pass
``grad_scaler=scaler`` at construction (read without a sync), or a warning says so.

**Hooks.** One preconditioner owns a module's hooks at a time: a new MKOR or KFAC on the
same model detaches the older one (with a warning), :meth:`remove` (or leaving a
``with`` block) detaches them by hand, and hooks of a preconditioner that is garbage
collected go with it, so pasting a setup twice never leaves two hook sets.

**Step hooks.** Two optimizers step in one ``step()``: the preconditioner, then (inside it)
its backbone. A global hook (``torch.optim.optimizer.register_optimizer_step_pre_hook`` /
``_post_hook``, "common to all optimizers") therefore fires for each, pre hooks in the order
preconditioner, backbone and post hooks backbone, preconditioner -- as for torch's own
wrapper, ``ZeroRedundancyOptimizer``, which steps its local optimizer inside its step. A
hook tells them apart by its ``optimizer`` argument; a hook registered on the
preconditioner (``register_step_pre_hook``) fires once per step. A step that a GradScaler
overflow skips runs the preconditioner's hooks only (the backbone does not step).

**Copies.** A preconditioner is bound to its model's modules by hooks, so it cannot be
copied or pickled: ``copy.deepcopy``, ``copy.copy``, ``pickle`` and ``torch.save`` of it (or of
anything holding it) raise ``TypeError`` at once. Its checkpoint is :meth:`state_dict`: save
it with the model's, build a new preconditioner on the copied or loaded model, and
``load_state_dict``. The model alone copies and pickles freely; its copy carries inert hooks
(:mod:`.capture`).

**Parameters replaced after construction** (FSDP2's ``fully_shard`` under accelerate) are
followed at the next step (:class:`~.placement.ParameterBinding`).
"""
import warnings
import weakref

import torch

from ..common.optim_state import init_backbone_state
from .placement import ParameterBinding
from .report import CaptureReport, row_count
from .state_layout import StateView, collect, packed_index, place, saved_param_ids
from .experts.parallel import as_lists, as_tuples, global_layer_state, local_layer_state

__all__ = ["PreconditionedOptimizer"]

# module -> weak reference to the preconditioner whose hooks it carries
_OWNERS = weakref.WeakKeyDictionary()


class PreconditionedOptimizer(torch.optim.Optimizer):
    """Base class of MKOR and K-FAC: subclasses set ``_state_key`` and implement
    :meth:`precondition`, ``_preconditioner_state(clone)``,
    :meth:`load_preconditioner_state_dict` and ``_drop_statistics(completed_only=False)``; they
    call :meth:`_bind` first in ``__init__``, set ``_layers``, ``_skipped`` ({name: reason}),
    ``_frozen``, ``_steps`` and ``_capture``, and call :meth:`_attach` once their hooks exist."""

    _step_supports_amp_scaling = True
    _state_key = "preconditioner"

    # -- no copies: hooks on the model (module docstring) ----------------------------------
    def _refuse_copy(self, *args):
        name = type(self).__name__
        raise TypeError(
            f"{name} holds hooks on its model and cannot be copied or pickled. To copy or save "
            f"it, save {name.lower()}.state_dict() (and the model's state_dict()), build a new "
            f"{name} on the copied or loaded model, and call its load_state_dict(...)")

    # torch.optim.Optimizer's (and object's) signatures, each refusing (conformance tests)
    def __reduce_ex__(self, protocol, /):
        self._refuse_copy()

    def __reduce__(self, /):
        self._refuse_copy()

    def __getstate__(self):
        self._refuse_copy()

    __copy__ = __deepcopy__ = _refuse_copy

    # -- the Optimizer attributes are the backbone's ------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        """The backbone's per-parameter state with this preconditioner's entries on the
        parameters that carry them (:mod:`.state_layout`)."""
        return StateView(self.optimizer, lambda: self._entries(clone=False), self._write_entry)

    @state.setter
    def state(self, value):
        self.optimizer.state = value

    @property
    def defaults(self):
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self.optimizer.defaults = value

    def _bind(self, model, optimizer, grad_scaler=None):
        name = type(self).__name__
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{name}: model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{name}: optimizer must be a torch.optim.Optimizer, "
                            f"got {type(optimizer).__name__}")
        if isinstance(optimizer, PreconditionedOptimizer):
            raise TypeError(f"{name}: the backbone is itself a preconditioner; wrap its "
                            "backbone instead")
        if grad_scaler is not None and not hasattr(grad_scaler, "get_scale"):
            raise ValueError(f"grad_scaler must be a torch.amp.GradScaler, got {grad_scaler!r}")
        self.model, self.optimizer, self.grad_scaler = model, optimizer, grad_scaler
        # torch's own initialiser of the hook tables and the step profiling wrapper.
        torch.optim.Optimizer.__setstate__(self, {})
        self._warned_capturable_if_run_uncaptured = True
        self._detached = False
        self._warned = set()
        self._warned_eval = set()
        self._step_scale = None

    def _attach(self, modules):
        """Take ownership of ``modules``' hooks (detaching an older owner) and arrange for
        the hooks to go when this object is garbage collected."""
        displaced = []
        for module in modules:
            ref = _OWNERS.get(module)
            other = ref() if ref is not None else None
            if other is not None and other is not self and not other._detached:
                other.remove()
                displaced.append(type(other).__name__)
            _OWNERS[module] = weakref.ref(self)
        #: the parameters the layers were built on, to follow their replacement
        self._binding = ParameterBinding(self._layers)
        if displaced:
            warnings.warn(f"{type(self).__name__}: the model already carried the hooks of an "
                          f"earlier {displaced[0]}; they were removed (one preconditioner per "
                          "module; the earlier object now steps its backbone only)",
                          UserWarning, stacklevel=3)
        weakref.finalize(self, self._capture.remove)

    def _warn_once(self, key, message, category=UserWarning):
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, category, stacklevel=3)

    # -- what is preconditioned, and why (:mod:`.report`) -------------------------------
    @property
    def preconditioned_modules(self):
        """Names of the preconditioned modules (in ``named_modules`` order): the layers
        discovery took, less those released by the self-check and, after the first capture
        step, those whose factors have taken no statistic yet (:mod:`.capture.ledger`)."""
        return [layer.name for layer in self._layers if self._why_not(layer.name) is None]

    def _why_not(self, name):
        """Why a discovered layer is not preconditioned now, or None."""
        capture = self._capture
        return capture.check.released.get(name) or capture.ledger.reason(name)

    @property
    def skipped_modules(self):
        """Names of modules with parameters that go to the backbone unpreconditioned."""
        return list(self.skip_reasons)

    @property
    def skip_reasons(self):
        """{module name: why it is not preconditioned} (discovery's reasons, the self-check's
        releases, and the layers waiting for their first accepted statistic)."""
        reasons = dict(self._skipped)
        for layer in self._layers:
            why = self._why_not(layer.name)
            if why is not None:
                reasons.setdefault(layer.name, why)
        return reasons

    @property
    def unmasked_reasons(self):
        """{module name: why its rows were not selected by a token mask}: layers that ran in
        a call with token masks but whose rows could not be matched to their mask (e.g. a
        pooler's (B, d) rows, an MoE expert's routed rows); they use all their rows."""
        return dict(self._capture.unmasked)

    @property
    def steps(self):
        return self._steps

    def capture_report(self):
        """What was captured, in one call: a :class:`CaptureReport` ({module name: row}).

        Each row: ``preconditioned`` (bool) and ``reason`` (why not, or why it stopped);
        ``mask``: where its rows' mask came from at its last capture ("tokens": a token
        mask in the rows' own layout; "per sample": one row per sample, all real; "none":
        its rows come from no masked input, or the call had no mask; "untied": a mask
        exists but the rows could not be tied to it; "all rows (self-check)"), with
        ``unmasked`` the reason when the rows use no mask although masks were there;
        ``rows``: rows counted at its last capture (reading a masked count is a host
        synchronisation, made here and not in the step); ``self_check``: the verdicts of
        its last checked capture ({"padding": "pass" | "fail", "weight": "pass" | "fail",
        "ratio": discrepancy / rounding bound, ...}, empty until checked)."""
        capture = self._capture
        rows = {}
        for layer in self._layers:
            name = layer.name
            count = capture.last_rows.get(name)
            why = self._why_not(name)
            rows[name] = {
                "preconditioned": why is None,
                "reason": why,
                "mask": capture.mask_source.get(name, "not captured yet"),
                "unmasked": capture.unmasked.get(name),
                "rows": None if count is None else row_count(count),
                "eval_mode_seen": name in capture.eval_seen,
                "self_check": dict(capture.check.verdicts.get(name, {})),
            }
        for name, reason in self._skipped.items():
            if name not in rows:
                rows[name] = {"preconditioned": False, "reason": reason, "mask": None,
                              "unmasked": None, "rows": None, "eval_mode_seen": False,
                              "self_check": {}}
        return CaptureReport(rows, sorted(capture.mask_notes))

    # -- optimizer API ----------------------------------------------------------------------
    def add_param_group(self, param_group):
        """Adds to the backbone (its new parameters are not preconditioned)."""
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none=True):
        """The backbone's ``zero_grad``, and drop what belongs to the zeroed gradients: the
        statistics (and MKOR-H losses) of completed backwards. A forward still waiting for
        its backward keeps its statistics, so ``zero_grad()`` may come between the two."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._drop_statistics(completed_only=True)

    def remove(self):
        """Detach every hook; from then on :meth:`step` steps the backbone only."""
        self._capture.remove()
        self._detached = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
        return False

    def masked(self, mask, batch_first=None):
        """Context manager: within it, the (B, T) ``mask`` (nonzero = real token) describes
        the model call's tensor arguments whose batch and position dimensions are (0, 1)
        (``batch_first=False``: (1, 0); default: the model's own ``batch_first`` attribute,
        else True), and is followed from them to every layer's rows
        (:mod:`.token_masks`), for models without an ``attention_mask`` keyword."""
        return self._capture.token_mask(mask, batch_first)

    def _finish_capture(self):
        """On a step that consumes statistics: the self-check's verdicts
        (:mod:`.self_check`) and what the model changed since construction (a layer
        unfrozen, a layer run in ``eval()`` inside a model in training), each told once.
        Returns the layers whose statistics of this step were refused."""
        name = type(self).__name__
        for layer in self._capture.finish_capture_step(self.process_group):
            reason = self._capture.check.released[layer]
            self._skipped[layer] = reason
            warnings.warn(f"{name}: {layer}: {reason}", RuntimeWarning, stacklevel=4)
        for layer in list(self._capture.all_rows_new()):
            warnings.warn(f"{name}: {layer}: {self._capture.check.all_rows[layer]}",
                          RuntimeWarning, stacklevel=4)
        for module_name, module in self._frozen.items():
            weight = module.weight
            if weight.requires_grad and weight.grad is not None and \
                    module_name not in self._warned:
                self._warned.add(module_name)
                self._skipped[module_name] = (
                    f"frozen when {name} was built and trainable since step {self._steps}: "
                    f"not preconditioned (its gradient goes to the backbone unchanged; build a "
                    f"new {name} to precondition it)")
                warnings.warn(f"{name}: {module_name} was frozen when {name} was built and is "
                              "trainable now: it is not preconditioned (its gradient goes to the "
                              f"backbone unchanged); build a new {name} to precondition it",
                              UserWarning, stacklevel=4)
        seen = sorted(self._capture.eval_seen - self._warned_eval)
        if seen:
            self._warned_eval.update(seen)
            warnings.warn(f"{name}: {', '.join(seen)} ran in eval() mode on a step that captures "
                          "statistics: statistics are captured in train mode only, so these "
                          "layers keep the factors they have while their gradients are still "
                          "preconditioned and rescaled (a layer whose factors never took a "
                          "statistic is not: its gradient goes to the backbone unchanged)",
                          UserWarning, stacklevel=4)
        return self._capture.refused_last()

    @property
    def hooks_registered(self):
        return self._capture.registered

    def _grads(self):
        return [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]

    def _amp_step(self):
        """The GradScaler contract: False if this step overflowed (skip it all)."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None:
            self._step_scale = self._configured_scale()
            return True
        scale = getattr(self, "grad_scale", None)
        if found_inf.item():  # the sync GradScaler itself makes for a plain optimizer
            self._drop_statistics()
            return False
        if scale is not None:  # gradients still scaled: unscale them as GradScaler would
            inv_scale = scale.double().reciprocal().float()
            by_device = {}
            for grad in self._grads():
                by_device.setdefault((grad.device, grad.dtype), []).append(grad)
            for (device, _), grads in by_device.items():
                dummy = torch.zeros(1, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(
                    grads, dummy, inv_scale.to(device))
            self._step_scale = scale
        else:  # unscaled by the caller: the scale is only known from the scaler itself
            if self.grad_scaler is None:
                self._warn_once("scale", f"{type(self).__name__}: GradScaler.unscale_ ran "
                                "before step(), so the loss scale the statistics were "
                                "captured at is unknown; pass grad_scaler=scaler at "
                                "construction (statistics now use grad_scale="
                                f"{self._grad_scale!r})", RuntimeWarning)
            self._step_scale = self._configured_scale()
        return True

    def _configured_scale(self):
        scaler = self.grad_scaler
        if scaler is not None:
            scale = getattr(scaler, "_scale", None)
            return scale if scaler.is_enabled() and scale is not None else 1.0
        return self._grad_scale

    def set_grad_scale(self, scale):
        """Set the loss scale the statistics are divided by (a float or a 0-d tensor);
        not needed with ``GradScaler.step`` or ``grad_scaler=``."""
        if not isinstance(scale, torch.Tensor) and not scale > 0:
            raise ValueError(f"grad_scale must be > 0, got {scale!r}")
        self._grad_scale = scale

    def step(self, closure=None):
        """Precondition, then the backbone's ``step()``. ``closure`` (re-evaluates the
        loss, as in ``torch.optim``) runs first, under grad; MKOR-H reads its loss (or one
        given to ``observe_loss``, or the model output's). Returns the closure's loss.
        torch.optim's signature exactly: DCP and training loops call it by keyword."""
        closure_loss = loss = None
        if closure is not None:
            with torch.enable_grad():
                closure_loss = loss = closure()
        self._check_backbone_groups()
        if not self._amp_step():
            return closure_loss
        if self._detached:
            self._warn_once("detached", f"{type(self).__name__}: hooks were removed (remove(), "
                            "a with block, or a newer preconditioner on the model): stepping "
                            "the backbone without preconditioning")
            self.optimizer.step()
            return closure_loss
        self._observe(loss)
        self.precondition()
        self.optimizer.step()
        return closure_loss

    def _layers_with_statistics(self):
        """Names of the layers whose factors have taken a statistic (read after a load: one
        host synchronisation); each method reads its own counters."""
        raise NotImplementedError

    def _check_backbone_groups(self):
        """A refusal before anything changes: this library's backbones (MARS, MARS-M, LAMB)
        check every group in ``_check_groups``; run it before the factors, the step count and
        the gradients change, so a refused step leaves them all as they were. (torch's own
        optimizers check nothing at step time; another class's method of that name is not
        assumed to be this one.)"""
        cls = type(self.optimizer)
        check = getattr(cls, "_check_groups", None)
        if check is not None and cls.__module__.startswith("torch_impl."):
            check(self.optimizer)

    def _observe(self, loss):
        """This step's loss (or None), before :meth:`precondition`; MKOR-H overrides."""

    def _check_captured(self, layers, captured_any):
        """On a factor-update step: warn once when nothing was captured although the
        layers have gradients (all in eval mode, or a forward outside the schedule)."""
        if captured_any or not layers:
            return
        if not any(layer.module.weight.grad is not None for layer in layers):
            return
        if all(not layer.module.training for layer in layers):
            why = "every preconditioned module is in eval() mode (call model.train())"
        else:
            why = "no forward under grad in train mode reached a backward since the last step"
        self._warn_once("nothing captured", f"{type(self).__name__}: no statistics were "
                        f"captured for a factor update: {why}; the factors stay as they are")

    # -- checkpoints: the state laid out on the parameters (:mod:`.state_layout`) -------
    def init_state(self):
        """Create the backbone's state as its first step would, without stepping: torchtitan's
        and DCP's ``init_optim_state`` step an optimizer whose ``state`` is empty (zero
        gradients, lr 0), which would count a step here and in the backbone; after this they
        see state and do nothing. The preconditioner's own state exists from construction."""
        init_backbone_state(self.optimizer)

    def _layer_weights(self):
        """{layer name: the parameter its state rides on} (its weight)."""
        return {layer.name: layer.module.weight for layer in self._layers}

    def _first_param(self):
        return next((p for g in self.param_groups for p in g["params"]), None)

    def _entries(self, clone):
        """{param: {name: entry}}: this preconditioner's state laid out on the parameters
        (a stack under expert parallelism: as DTensors of all its experts, each rank's
        shard its held experts'; ``experts/parallel.py``)."""
        own = self._preconditioner_state(clone)
        weights = self._layer_weights()
        layers = dict(own["layers"])
        for layer in self._layers:
            if not layers.get(layer.name) or layer.experts is None:
                continue
            if layer.expert_shard is not None:
                layers[layer.name] = global_layer_state(layer.expert_shard, weights[layer.name],
                                                        layer.name, layers[layer.name])
            else:  # a stack's state in the layout every placement of it shares (a tuple is
                # one opaque object to DCP, a list of tensors is traversed), so a checkpoint
                # moves between expert-parallel, per-expert-owner and replicated stacks
                layers[layer.name] = as_lists(layers[layer.name])
        return place(dict(own, layers=layers), weights, self._first_param(), self._state_key)

    def _localised(self, own):
        """A saved preconditioner state with each expert-parallel stack's layer state cut to
        the experts held here (:func:`~.experts.parallel.local_layer_state`), and every stack's
        lists of tensors back to the tuples they were (:func:`~.experts.parallel.as_lists`)."""
        if own is None or "layers" not in own:
            return own
        layers = dict(own["layers"])
        for layer in self._layers:
            if not layers.get(layer.name) or layer.experts is None:
                continue
            if layer.expert_shard is not None:
                layers[layer.name] = local_layer_state(layer.expert_shard, layer.name,
                                                       layers[layer.name])
            else:
                layers[layer.name] = as_tuples(layers[layer.name])
        return dict(own, layers=layers)

    def _write_entry(self, param, name, value):
        """``state[param][name] = value`` for one of this preconditioner's entries: load it."""
        own = self._preconditioner_state(clone=False)
        if name == self._state_key:
            layer = next(n for n, w in self._layer_weights().items() if w is param)
            value = self._localised({"layers": {layer: value}})["layers"][layer]
            own = dict(own, layers=dict(own["layers"], **{layer: value}))
        else:
            own = dict(own, **value)
        self.load_preconditioner_state_dict(own)

    def preconditioner_state_dict(self):
        """This preconditioner's own state (copies): ``{"layers": {name: state}, ...}``."""
        return self._preconditioner_state(clone=True)

    def state_dict(self):
        """The backbone's ``state_dict()`` with this preconditioner's state on the parameters
        (:mod:`.state_layout`): each layer's under ``_state_key`` (``"mkor"`` / ``"kfac"``) on
        its weight, the run's under ``_state_key + "_run"`` on the first parameter. One
        checkpoint resumes both, and it travels wherever per-parameter state does:
        ``torch.save``, DCP's ``get_state_dict`` / ``set_state_dict``, torchtitan's flat
        FQN-keyed layout."""
        for hook in self._optimizer_state_dict_pre_hooks.values():  # as torch.optim does
            hook(self)
        state = self.optimizer.state_dict()
        index = packed_index(self.param_groups)
        packed = dict(state["state"])  # the backbone's live per-parameter dicts: not mutated
        for param, entry in self._entries(clone=True).items():
            i = index[id(param)]
            packed[i] = dict(packed.get(i, {}), **entry)
        state["state"] = packed
        for hook in self._optimizer_state_dict_post_hooks.values():
            state = hook(self, state) or state
        return state

    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict` output. A plain backbone ``state_dict`` loads too (the
        preconditioner then keeps its state, with a warning), and so do the earlier layouts:
        a top-level ``_state_key`` entry (with a copy in the first param group) and the
        preconditioner-only ``{"steps", "layers", ..., "optimizer"?}``."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():  # as torch.optim does
            state_dict = hook(self, state_dict) or state_dict
        state = dict(state_dict)
        own = state.pop(self._state_key, None)
        groups = state.get("param_groups")
        if groups and self._state_key in groups[0]:  # the earlier copy carried through DCP
            first = dict(groups[0])
            carried = first.pop(self._state_key)
            state["param_groups"] = [first] + list(groups[1:])
            own = carried if own is None else own
        if own is None and "layers" in state and "param_groups" not in state:
            own, state = state, state.get("optimizer")
        if state is not None and "state" in state:
            saved_ids = saved_param_ids(state, self.param_groups)
            by_id = {saved_ids[id(w)]: name for name, w in self._layer_weights().items()}
            state["state"], placed = collect(state["state"], by_id, self._state_key)
            own = placed if placed is not None else own
        if own is None:
            warnings.warn(f"{type(self).__name__}.load_state_dict: no '{self._state_key}' entry: "
                          "only the backbone's state was loaded", UserWarning, stacklevel=2)
        backup = self.preconditioner_state_dict()
        try:  # the preconditioner first: a mismatch leaves the backbone untouched
            if own is not None:
                self.load_preconditioner_state_dict(self._localised(own))
            if state is not None and "param_groups" in state:
                self.optimizer.load_state_dict(state)
        except Exception:
            self.load_preconditioner_state_dict(backup)
            raise
        self._capture.ledger.restore(self._layers_with_statistics(), self._steps)
        self._capture.refresh()  # the restored step count decides the next capture
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)
