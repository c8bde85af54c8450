r"""Activation / output-gradient hooks (spec MKOR.md K2-K6), right by construction.

Hooks (kfac-pytorch pattern) capture a layer's statistics only when the module is in
training mode, grad is enabled and the owner's schedule says so (K2). The rows come from
the layer's :class:`~torch_impl.kronecker.layers.LayerType`; the owner's ``input_stat`` /
``grad_stat`` turn them into additive statistics, summed over every forward + backward until
:meth:`Capture.reset`. ``torch_impl/kronecker/capture/README.md`` gives the design with the cases it was
proved on.

:class:`Capture` pairs each forward call with its gradient and holds its collaborators:

* :class:`~.calls.CallTracker` -- which model call a forward belongs to (token masks,
  checkpoint regions, where each layer's mask came from);
* :class:`~.statistics.LayerStatistics` -- the per-layer sums, and when they are stale;
* :class:`~.self_check.SelfCheck` -- the two facts every right capture satisfies;
* :class:`~.attention.AttentionOutRows` and :class:`~.experts.ExpertRows` -- the rows of
  layers that are not called as modules (an MHA out-projection, fused experts);
* a *listener* (optional) told when a forward's statistic is recorded and when it is complete
  (MKOR's ``comm_overlap``: :class:`~torch_impl.mkor.vector_exchange.BackwardProgress`).

**Pairing.** With ``grad_hook="tensor"`` (default) the forward hook computes the input
statistic and attaches a gradient hook to *that call's output* carrying it, so every
output gradient is paired with exactly the forward call that produced it, however many
times a module runs per forward: a train-mode forward that is never back-propagated
contributes nothing, and a layer used three times contributes three pairs.
``grad_hook="module"`` uses ``register_full_backward_hook``, which sees gradients per
module, not per call: inputs wait on a stack, and a forward left without its backward
makes the pairing ambiguous, so :meth:`Capture.unpaired` reports it and the owner raises.

**Checkpointing.** A forward that runs *during a backward pass* is a recompute
(``torch.utils.checkpoint``). Non-reentrant checkpointing runs the real forward with grad
(captured there, as usual) and recomputes only to rebuild saved tensors: the recompute's
outputs are never back-propagated, so the gradient hook it gets never fires and the
recompute adds nothing. Reentrant checkpointing runs the real forward without grad (no
capture) and back-propagates the recompute's outputs: the recompute is what is captured.
Its statistic is computed lazily in the gradient hook, so a non-reentrant recompute costs
nothing. Which call a recompute belongs to: :mod:`.calls`.

**Token masks** enter where the model's modules take them (:mod:`.token_masks`: every
module whose forward has the mask parameter, bound to its signature) and are followed
through the model's operations to each layer's rows (:mod:`.row_provenance`): a layer's
rows read the mask of the tokens they come from, in their own layout, never a mask that
merely has the right shape. A layer whose rows cannot be tied to a mask uses them all
and is listed with the reason in :attr:`Capture.unmasked`. Layers that ran without grad
(the first pass of a reentrant checkpoint) record their layout for the recompute.

**Self-check** (:mod:`.self_check`): on a checked capture, a row the mask calls padding
must carry an exactly zero output gradient, and the weight's gradient of each backward
must equal the sum over the captured rows of g a^T (checked through a random projection,
within a rounding bound derived from the rows). A violation is reported and the layer
falls back (:meth:`Capture.finish_capture_step`).

**Rows that are not there.** A call with 0 rows commits a 0 count; the owner treats a
layer without rows as absent ("no rows"), not as a non-finite update.

**torch.compile.** ``capturing`` (a bool the owner refreshes after each step from its
schedule) is the gate. On a capture step the model's forward runs eagerly
(:mod:`.eager` routes it through ``torch.compiler.disable``), so the model's frames
never resume after a graph break; on every other step a compiled model traces straight
through the hooks (one graph, guarded on the bool). Every forward hook is itself the gate in
front of the ``compiler.disable``d hook proper, for a hooked layer that a compiled caller
reaches without going through the model's forward.

**Copies of the model.** Every hook installed on the model, its modules or its parameters is
a :mod:`.hooks` callable whose copies are inert: a copy of the model never feeds the
original's statistics. (The preconditioner itself refuses to be copied: see
:mod:`torch_impl.kronecker.optimizer`.)
"""
import warnings

import torch

from ...common.validation import check_choice
from .attention import AttentionOutRows
from .calls import CallTracker, first_tensor
from .eager import EagerCaptureSteps
from .experts import ExpertRows
from .guards import _UNKNOWN, CaptureError, _guarded, _in_backward, _named_error, _untracked
from .hooks import BoundHook, Gated
from .ledger import Ledger
from .self_check import SelfCheck
from .statistics import LayerStatistics

__all__ = ["Capture", "CaptureError"]


def _silence_first_layer_warning():
    """Torch warns when a full backward hook fires on a module whose inputs need no
    grad (the first layer). That is exactly the case we rely on, so the warning is
    noise; the filter is (re)installed at every registration because contexts such as
    ``warnings.catch_warnings`` restore the filter list on exit."""
    warnings.filterwarnings(
        "ignore", message="Full backward hook is firing when gradients are computed with "
        "respect to module outputs", category=UserWarning)


class Capture:
    """Hooks that accumulate per-layer statistics between resets.

    Args:
        layers: the :class:`~torch_impl.kronecker.discovery.Layer` list.
        should_capture: ``callable() -> bool``, the owner's schedule (pure Python, no
            tensor reads), consulted in every hook.
        input_stat: ``callable(layer, rows, mask) -> (tensor, count)``: additive statistic
            of one forward's input rows ``(*lead, d_in)``; ``mask`` is None or a bool tensor
            of shape ``lead``.
        grad_stat: ``callable(layer, rows, mask) -> (tensor, count)``: the same for the
            output-gradient rows ``(*lead, d_out)``.
        grad_hook: ``"tensor"`` (default) or ``"module"`` (module docstring).
        model: the top-level module; with ``mask_kwarg`` the forwards that take a parameter
            of that name (a 2-D tensor, nonzero = real token) give the token masks
            (:mod:`.token_masks`).
        self_check: True: check every capture step whose statistics are consumed;
            None or False: never (:mod:`.self_check`).
        listener: None, or an object with ``captured(layer)``, ``committed(layer, counted)``
            and ``reset()`` (module docstring).

    After a backward, :meth:`stats` returns ``(a_sum, a_count, g_sum, g_count)`` per layer
    name for layers that saw at least one complete forward + backward.
    """

    def __init__(self, layers, should_capture, input_stat, grad_stat, grad_hook="tensor",
                 model=None, mask_kwarg=None, self_check=None, listener=None):
        check_choice("grad_hook", grad_hook, ("module", "tensor"))
        self.grad_hook = grad_hook
        self.layers = list(layers)
        self.should_capture = should_capture
        self.model = model
        self.listener = listener
        self.check = SelfCheck(self.layers, self_check)
        self.ledger = Ledger(self.layers)  # which layers' factors have taken a statistic
        self.calls = CallTracker(model, mask_kwarg, self.layers, self.check.all_rows)
        self.statistics = LayerStatistics(self.layers, input_stat, grad_stat)
        self.attention = AttentionOutRows(self)
        self.experts = ExpertRows(self)
        self._handles = []
        self._weight_handles = []  # the part of _handles on weight parameters
        self._router = None     # the EagerCaptureSteps on model.forward while registered
        #: layers whose forward ran in eval() mode on a capture step (not captured)
        self.eval_seen = set()
        #: K-FAC's curvature-column sums (``baselines.kfac_curvature.ColumnSums``) or None;
        #: ``in_columns`` while its columns are back-propagated (their rows go there)
        self.columns = None
        self.in_columns = False
        self.capturing = False  # should_capture() as of the last refresh (the hooks' gate)
        self._new_all_rows = []  # layers the last finish_capture_step moved to all rows
        self._refused = []  # layers whose statistics the last finish_capture_step refused

    # -- what the report reads ----------------------------------------------------------
    @property
    def unmasked(self):
        """{layer name: why its rows were not selected by a token mask}."""
        return self.calls.unmasked

    @property
    def mask_source(self):
        """{layer name: where its rows' mask came from at its last capture}."""
        return self.calls.mask_source

    @property
    def mask_notes(self):
        """What a mask could not be tied to (an input whose shape is not the mask's)."""
        return self.calls.mask_notes

    @property
    def last_rows(self):
        """{layer name: rows counted at its last capture (an int or a 0-d tensor)}."""
        return self.statistics.last_rows

    # -- call contexts ------------------------------------------------------------------
    def token_mask(self, mask, batch_first=None):
        """Context manager: within the block, ``mask`` describes the model call's token
        inputs (:func:`~.token_masks.tag_explicit`) and is followed to every layer's rows."""
        return self.calls.token_mask(mask, batch_first)

    def tracking(self):
        """Around the model's forward on a capture step (:mod:`.eager` calls it, in the
        eager region a compiled caller does not trace): the call's row tracker is entered
        while the forward runs, and left when it returns."""
        return self.calls.tracking(self.capturing)

    def active(self, module):
        """"capture", "eval", "first pass" (a grad-free forward inside a call with grad:
        reentrant checkpointing) or None."""
        if not self.should_capture():
            return None
        if not module.training:
            return "eval" if torch.is_grad_enabled() else None
        if torch.is_grad_enabled():
            return "capture"
        return self.calls.grad_free_pass()

    # -- one call of a layer ------------------------------------------------------------
    def captured(self, layer):
        """A forward's input statistic was recorded (told to the listener)."""
        if self.listener is not None:
            self.listener.captured(layer)

    def committed(self, layer, counted=True):
        """A forward's statistics are complete (told to the listener); ``counted``:
        :meth:`captured` was called for it (not for a recompute's lazy statistic)."""
        if self.listener is not None:
            self.listener.committed(layer, counted)

    def commit(self, layer, a_stat, mask, g_rows, sketch=None, experts=None):
        """One call's output-gradient rows: their statistic, the self-check's side of them,
        and the pair added to the layer's sums."""
        g_stat = self.statistics.grad(layer, g_rows, mask, experts)
        if sketch is not None:
            with torch.no_grad(), torch.autocast(g_rows.device.type, enabled=False):
                self.check.commit(layer, sketch, mask, g_rows.detach())
        if self.in_columns:  # K-FAC's curvature columns: G's rows, the pair waits
            self.columns.add(layer, g_stat)
            return
        if self.columns is None:
            self.statistics.add(layer, a_stat, g_stat)
            return
        stale = self.statistics.stale(layer)  # what add() drops, the columns drop too
        self.statistics.add(layer, a_stat, g_stat)
        self.columns.paired(layer, stale)

    def record(self, layer, rows_of, tags_of, output, grad_rows):
        """One call of ``layer``: its input statistic now (an ordinary forward) or in the
        gradient hook (a recompute during backward), paired with this call's gradient."""
        tensor_mode = self.grad_hook == "tensor"
        calls, check = self.calls, self.check
        ctx = calls.context()
        checking = check.checking
        if _in_backward():
            if not tensor_mode:
                if ctx is None or ctx is _UNKNOWN:
                    return  # module mode: only a filed reentrant region's recompute
                rows = rows_of()
                found = calls.replayed(layer, ctx, rows.shape[:-1])
                calls.note(layer, found, ctx)
                sketch = check.sketch(layer, rows) if checking else None
                self.statistics.pending(layer.name).append(
                    (self.statistics.input(layer, rows, found.mask), found.mask, grad_rows,
                     sketch))
                return

            def lazy(grad):
                try:
                    # regions nested in this recompute, upstream of this layer: file them
                    calls.file_nested(ctx, output)
                    rows = rows_of()
                    found = calls.replayed(layer, ctx, rows.shape[:-1])
                    calls.note(layer, found, ctx)
                    sketch = check.sketch(layer, rows) if checking else None
                    self.commit(layer, self.statistics.input(layer, rows, found.mask),
                                found.mask, grad_rows(grad), sketch)
                except Exception as exc:  # noqa: BLE001 - named, never swallowed
                    raise _named_error(layer, exc) from exc
                self.committed(layer, counted=False)
            output.register_hook(lazy)
            return
        rows = rows_of()
        found = calls.layout(layer, ctx, tags_of, rows.shape[:-1])
        calls.note(layer, found, ctx)
        with _untracked(ctx):
            a_stat = self.statistics.input(layer, rows, found.mask)
            sketch = check.sketch(layer, rows) if checking else None
        self.captured(layer)
        mask = found.mask
        if tensor_mode:
            def hook(grad):
                try:
                    self.commit(layer, a_stat, mask, grad_rows(grad), sketch)
                except Exception as exc:  # noqa: BLE001
                    raise _named_error(layer, exc) from exc
                self.committed(layer)
            output.register_hook(hook)
        else:
            self.statistics.pending(layer.name).append((a_stat, mask, grad_rows, sketch))

    # -- hooks ----------------------------------------------------------------------------
    def _make_hooks(self, layer):
        """[(target module, kind, hook)] for ``layer``."""
        module = layer.module
        if layer.experts is not None:
            if self.grad_hook == "module":
                raise CaptureError(f"MKOR/K-FAC: {layer.name} is a fused experts projection: "
                                   "its rows are recomputed from the gradient of the call's "
                                   "output, which grad_hook='tensor' (the default) pairs")
            partners = [l for l in self.layers if l.experts is not None
                        and l.module.experts is module.experts]
            # the projections of one module share one hook, installed with the first
            return self.experts.hooks(partners) if partners[0] is layer else []
        if layer.kind == "mha_out":
            return self.attention.hooks(layer)

        def forward_hook(module, args, kwargs, output):
            state = self.active(module)
            if state is None or not isinstance(output, torch.Tensor):
                return
            x = first_tensor(args, kwargs)
            if x is None:
                return
            if state == "eval":
                if output.requires_grad:
                    self.eval_seen.add(layer.name)
                return

            def tags_of(tracker, x=x):
                return layer.type.row_tags(module, tracker.tag_of(x), lead)
            if state == "first pass":
                lead = layer.type.rows_lead(module, x, output)
                self.calls.first_pass(layer, tags_of, lead)
                return
            if not output.requires_grad:
                return
            lead = None

            def rows_of():
                nonlocal lead
                rows = layer.type.input_rows(module, x)
                lead = tuple(rows.shape[:-1])
                return rows
            self.record(layer, rows_of, tags_of, output,
                        lambda g: layer.type.grad_rows(module, g))

        hooks = [(module, "forward", _guarded(layer, forward_hook))]
        if self.grad_hook == "module":
            hooks.append((module, "backward", BoundHook(self.module_backward, layer)))
        return hooks

    def module_backward(self, layer, module, grad_input, grad_output):
        """Full backward hook of ``layer`` (``grad_hook="module"``)."""
        pending = self.statistics.pending(layer.name)
        if module.training and grad_output[0] is not None and pending:
            a_stat, mask, grad_rows, sketch = pending.pop()
            self.commit(layer, a_stat, mask, grad_rows(grad_output[0]), sketch)
            self.committed(layer)

    def refresh(self):
        """Re-read the owner's schedule into :attr:`capturing`, the gate every forward hook
        checks first (the owner calls this whenever its step count or state changes)."""
        self.capturing = bool(self.should_capture())
        self.check.refresh(self.capturing)

    def _gated(self, hook):
        """``hook`` behind the traceable gate (module docstring, torch.compile); the
        ``_make_hooks`` closures are held only here, never installed or copied bare."""
        return Gated(self, hook)

    def register(self):
        """Install the hooks (idempotent)."""
        if self._handles:
            return
        _silence_first_layer_warning()
        self.refresh()
        gate = self._gated
        for layer in self.layers:
            for target, kind, hook in self._make_hooks(layer):
                if kind == "forward":
                    handle = target.register_forward_hook(gate(hook), with_kwargs=True)
                else:
                    handle = target.register_full_backward_hook(hook)
                self._handles.append(handle)
        self._weight_handles = self._hook_weights()
        self._handles.extend(self._weight_handles)
        if self.model is not None:
            self._router = EagerCaptureSteps.install(self.model, self)
        for target, kind, hook in self.calls.hooks():
            if kind == "pre":
                handle = target.register_forward_pre_hook(gate(hook), with_kwargs=True)
            else:  # the model's post-hook runs even when its forward raises
                handle = target.register_forward_hook(gate(hook), with_kwargs=True,
                                                      always_call=kind == "post")
            self._handles.append(handle)

    def _hook_weights(self):
        """Hooks on the layers' *current* weight parameters: the settle hook, and the
        self-check's gradient hook where the weight's gradient passes through autograd."""
        handles, by_weight = [], {}
        for layer in self.layers:
            by_weight.setdefault(id(layer.module.weight), (layer.module.weight, []))[1].append(
                layer.name)
        for weight, names in by_weight.values():
            handles.append(weight.register_post_accumulate_grad_hook(
                BoundHook(self.statistics.settle, names)))  # in the autograd engine, untraced
            if self.check.enabled and self.check.weight_checkable(weight):
                handles.append(weight.register_hook(BoundHook(self._weight_grad, names)))
        return handles

    def _weight_grad(self, names, grad):
        """Gradient hook of a weight (before accumulation): the self-check's comparison
        of this backward's gradient with the rows committed since the last one."""
        # grad_hook="module" commits when the module's input gradient is ready, which the
        # weight's own gradient may precede: the weight check runs in the tensor mode only
        if self.capturing and self.check.checking and self.grad_hook == "tensor":
            with torch.no_grad():
                self.check.weight_fired(names, grad)

    def rehook_weights(self):
        """Move the weight hooks to the layers' current weights, after the model's
        parameters were replaced (FSDP2's ``fully_shard`` after construction,
        :class:`~torch_impl.kronecker.placement.ParameterBinding`); statistics and the
        module hooks are kept."""
        if not self._handles:
            return
        stale = {id(h) for h in self._weight_handles}
        for handle in self._weight_handles:
            handle.remove()
        self._handles = [h for h in self._handles if id(h) not in stale]
        self._weight_handles = self._hook_weights()
        self._handles.extend(self._weight_handles)

    def remove(self):
        """Remove every hook and drop all statistics."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._weight_handles = []
        if self._router is not None:
            self._router.uninstall(self.model)
            self._router = None
        self.reset()

    @property
    def registered(self):
        return bool(self._handles)

    # -- statistics ------------------------------------------------------------------
    def reset(self):
        """Drop accumulated and pending statistics (called after every step)."""
        self.statistics.reset()
        if self.columns is not None:
            self.columns.reset()
        self.calls.reset()
        self.check.reset()
        if self.listener is not None:
            self.listener.reset()

    def drop_committed(self):
        """Drop the statistics of completed forward + backward pairs (their gradients are
        being zeroed), keeping forwards that still wait for their backward: a
        ``zero_grad()`` between a forward and its backward loses nothing."""
        self.statistics.drop_committed()
        if self.columns is not None:
            self.columns.drop_completed()
        self.check.reset()

    def stats(self, name):
        """(a_sum, a_count, g_sum, g_count) of layer ``name``, or None if incomplete,
        stale (settled into a gradient that has since been cleared), refused by the
        self-check, or of a layer the self-check released."""
        return self.statistics.get(name, self.check.released)

    def finish_capture_step(self, process_group=None):
        """On a step that consumes statistics: read the self-check's verdicts (one host
        synchronisation; one all-reduce across ranks) and apply them: a layer whose padding
        rows carried gradient has this step's statistics refused and uses all its rows from
        now on (listed in :attr:`unmasked`); a layer whose check was vacuous (a zero
        gradient) has them refused; a layer whose weight gradient is not its rows' is
        released (:attr:`SelfCheck.released`): its gradient goes to the backbone unchanged.
        The :class:`~.ledger.Ledger` records which layers' statistics enter their factors.
        Returns the names newly released."""
        flagged, released, vacuous = self.check.finish(process_group)
        self._new_all_rows = list(flagged)
        for name in flagged:
            self.statistics.flag(name)
            self.calls.unmasked[name] = self.check.all_rows[name]
        for name in list(released) + list(vacuous):
            self.statistics.flag(name)
        for name, refused in self.check.vacuous_experts.items():
            self.statistics.refuse_experts(name, refused)
        self._refused = list(flagged) + list(released) + list(vacuous)
        self.ledger.record(lambda name: self.stats(name) is not None, set(vacuous),
                           set(flagged), self.check.released)
        return released

    def refused_last(self):
        """Layers whose statistics the last :meth:`finish_capture_step` refused."""
        return self._refused

    def all_rows_new(self):
        """Layers the last :meth:`finish_capture_step` moved to all rows."""
        return self._new_all_rows

    def unpaired(self):
        """Names of layers holding forwards that never received a gradient
        (``grad_hook="module"`` only; the tensor mode pairs exactly)."""
        return self.statistics.unpaired()
