r"""Activation / output-gradient hooks (spec MKOR.md K2-K6), right by construction.

Hooks (kfac-pytorch pattern) capture a layer's statistics only when the module is in
training mode, grad is enabled and the owner's schedule says so (K2). The rows come from
the layer's :class:`~.layers.LayerType`; the owner's ``input_stat`` / ``grad_stat`` turn
them into additive statistics, summed over every forward + backward until :meth:`reset`.
``paper_notes/capture.md`` gives the design with the cases it was proved on.

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
nothing. The call a recompute belongs to (for its token masks) is found through the
autograd graph: when a hooked layer runs without grad inside a model call that has grad
(the first pass of a reentrant region), the model's forward post-hook walks the graph of
the call's outputs and files every ``CheckpointFunctionBackward`` node under the call's
:class:`~.token_masks.CallContext`; the recompute runs while the engine executes that very
node (``torch._C._current_autograd_node()``), so each region finds its own call, however
many calls share the backward. A region nested in another reentrant region gets its node
only during the outer recompute: the first gradient hook of that recompute files the nested
regions upstream of its layer under the same call; a nested region with no hooked layer
after it in the outer region is not filed, and its layers use all their rows and are
reported (:attr:`Capture.unmasked`) when the call had masks, never guessed.

**Stale statistics.** Statistics committed during a backward are *settled* when that
backward accumulates the layer's ``weight.grad`` (a post-accumulate-grad hook). If a later
commit, or the step, finds ``weight.grad`` None after statistics were settled, their
gradient was cleared (``zero_grad()`` of the model or the backbone, a skipped step): they
are dropped, so they can never leak into a later step. Nothing depends on whether
``.grad`` exists at forward time, so a recompute that precedes the first accumulation, or
several uses of one weight, lose nothing. (Gradients zeroed in place,
``set_to_none=False``, cannot be told apart from accumulation: call the preconditioner's
own ``zero_grad`` then.)

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
(:mod:`.eager_capture` routes it through ``torch.compiler.disable``), so the model's frames
never resume after a graph break; on every other step a compiled model traces straight
through the hooks (one graph, guarded on the bool). Every forward hook is itself the gate in
front of the ``compiler.disable``d hook proper, for a hooked layer that a compiled caller
reaches without going through the model's forward.

**Copies of the model.** Every hook installed on the model, its modules or its parameters is
a :mod:`.hook_objects` callable whose copies are inert: a copy of the model never feeds the
original's statistics. (The preconditioner itself refuses to be copied: see :mod:`.wrapper`.)

**Precision.** Statistics are computed with autocast disabled, in the rows' dtype promoted
to float32, so a bf16 forward never produces bf16 factors.

``nn.MultiheadAttention`` never calls its ``out_proj`` module (it passes the weight to
``F.multi_head_attention_forward``), so out-projections are captured through the parent:
a forward hook on the attention module reads the projection's input from the autograd node
that multiplies by ``out_proj.weight``, and the attention output's gradient supplies g.
"""
import contextlib
import warnings
import weakref

import torch

from .eager_capture import EagerCaptureSteps
from .expert_capture import ExpertsCapture
from .hook_guards import (_UNKNOWN, CaptureError, _guarded, _in_backward, _named_error,
                          _untracked)
from .hook_objects import BoundHook, Gated
from .fsdp import ParameterBinding
from .row_provenance import RowsMask, rows_mask
from .self_check import SelfCheck
from .token_masks import CallContext, MaskEntries, tag_explicit
from ..common.validation import check_choice

__all__ = ["Capture", "CaptureError"]


def _silence_first_layer_warning():
    """Torch warns when a full backward hook fires on a module whose inputs need no
    grad (the first layer). That is exactly the case we rely on, so the warning is
    noise; the filter is (re)installed at every registration because contexts such as
    ``warnings.catch_warnings`` restore the filter list on exit."""
    warnings.filterwarnings(
        "ignore", message="Full backward hook is firing when gradients are computed with "
        "respect to module outputs", category=UserWarning)


def _reaches(fn, weight, depth=3):
    """Whether autograd node ``fn`` leads to ``weight``'s accumulator within ``depth``
    single-input hops (a transpose, plus an autocast copy under mixed precision)."""
    for _ in range(depth):
        if fn is None:
            return False
        if getattr(fn, "variable", None) is weight:
            return True
        nxt = [f for f, _ in getattr(fn, "next_functions", ()) if f is not None]
        if len(nxt) != 1:
            return False
        fn = nxt[0]
    return getattr(fn, "variable", None) is weight


def _find_matmul_input(output, weight, max_nodes=64):
    """The input y of the matmul y @ weight.T that produced ``output`` (autograd walk).

    Looks for an ``addmm`` / ``mm`` node one of whose operands comes from ``weight``'s
    accumulator, and returns its saved left operand.
    """
    frontier, seen = [output.grad_fn], set()
    while frontier and len(seen) < max_nodes:
        node = frontier.pop(0)
        if node is None or node in seen:
            continue
        seen.add(node)
        children = [fn for fn, _ in node.next_functions if fn is not None]
        if any(_reaches(fn, weight) for fn in children):
            saved = getattr(node, "_saved_mat1", None)
            if saved is None:
                saved = getattr(node, "_saved_self", None)
            if saved is not None and saved.dim() == 2 and saved.shape[-1] == weight.shape[1]:
                return saved
        frontier.extend(children)
    return None


def _tensors(value):
    """Every tensor in a model output (a tensor, a tuple / list, or a dict-like output)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _checkpoint_nodes(output):
    """The reentrant checkpoint regions (``CheckpointFunctionBackward`` nodes) in the
    autograd graph of a call's output."""
    frontier = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
    seen, found = set(), []
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CheckpointFunctionBackward":
            found.append(node)
        frontier.extend(fn for fn, _ in node.next_functions if fn is not None)
    return found


def _first_tensor(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


class _Stats:
    """Accumulated statistics of one layer since the last reset. ``settled``: everything
    committed so far has been accumulated into ``weight.grad``."""

    __slots__ = ("pending", "a_sum", "a_count", "g_sum", "g_count", "settled", "flagged")

    def __init__(self):
        self.pending = []  # grad_hook="module": (input statistic, mask) awaiting a gradient
        self.a_sum = self.g_sum = None
        self.a_count = self.g_count = 0
        self.settled = False
        self.flagged = False  # the self-check refused this step's statistics


def _add(total, x):
    return x if total is None else total + x


_ALL_ROWS = RowsMask(None, "none")


class Capture(ExpertsCapture):
    """Hooks that accumulate per-layer statistics between resets.

    Args:
        layers: the :class:`~.discovery.Layer` list.
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
        self_check: None (off) or k: check each layer's first capture, then every k-th
            capture step (:mod:`.self_check`).

    After a backward, :meth:`stats` returns ``(a_sum, a_count, g_sum, g_count)`` per layer
    name for layers that saw at least one complete forward + backward.
    """

    def __init__(self, layers, should_capture, input_stat, grad_stat, grad_hook="tensor",
                 model=None, mask_kwarg=None, self_check=None):
        check_choice("grad_hook", grad_hook, ("module", "tensor"))
        self.grad_hook = grad_hook
        self.layers = list(layers)
        self.should_capture = should_capture
        self.input_stat = input_stat
        self.grad_stat = grad_stat
        self.model, self.mask_kwarg = model, mask_kwarg
        self._entries = MaskEntries(model, mask_kwarg) if model is not None else None
        names = dict(model.named_modules()) if model is not None else {}
        self._ancestors = {  # {layer: ids of the modules it sits in} (decoder stacks)
            layer.name: {id(m) for n, m in names.items()
                         if n == "" or layer.name.startswith(n + ".")}
            for layer in self.layers}
        self._stats = {layer.name: _Stats() for layer in self.layers}
        self._by_name = {layer.name: layer for layer in self.layers}
        self._handles = []
        self._weight_handles = []  # the part of _handles on weight parameters
        #: the parameters the layers were built on, to follow their replacement
        self.binding = ParameterBinding(self.layers)
        self._router = None     # the EagerCaptureSteps on model.forward while registered
        self._warned = set()  # layers already warned about (once each)
        #: {layer name: why its rows were not selected by a token mask}
        self.unmasked = {}
        #: {layer name: where its rows' mask came from at its last capture}
        self.mask_source = {}
        #: {layer name: rows counted at its last capture (an int or a 0-d tensor)}
        self.last_rows = {}
        #: layers whose forward ran in eval() mode on a capture step (not captured)
        self.eval_seen = set()
        #: what a mask could not be tied to (an input whose shape is not the mask's)
        self.mask_notes = set()
        self.check = SelfCheck(self.layers, self_check)
        self._explicit = None   # (mask, batch_first) set by token_mask(); wins over keywords
        self._call = None       # CallContext of the model's forward now running
        self._call_stack = []   # calls the model's current forward interrupted (nesting)
        self._masked_seen = False  # some call since the last reset had a token mask
        self._regions = {}      # CheckpointFunctionBackward node -> CallContext
        self.capturing = False  # should_capture() as of the last refresh (the hooks' gate)

    # -- call contexts ---------------------------------------------------------------
    @contextlib.contextmanager
    def token_mask(self, mask, batch_first=None):
        """Within the block, ``mask`` describes the model call's token inputs
        (:func:`~.token_masks.tag_explicit`) and is followed to every layer's rows."""
        previous, self._explicit = self._explicit, (mask, batch_first)
        self._masked_seen = True
        try:
            yield
        finally:
            self._explicit = previous

    def _context(self):
        """The CallContext of the forward running now: None outside any model call,
        ``_UNKNOWN`` for a recompute whose region was not filed."""
        if _in_backward():
            return self._regions.get(torch._C._current_autograd_node(), _UNKNOWN)
        return self._call

    def _model_pre_hook(self, module, args, kwargs):
        if _in_backward():
            return None
        ctx = CallContext()
        ctx.with_grad = torch.is_grad_enabled()
        if self._explicit is not None:
            tag_explicit(ctx, self._explicit[0], module, args, kwargs, self._explicit[1])
        replaced = None
        if self._entries is not None:
            replaced = self._entries.enter(ctx, module, args, kwargs)
        self._call_stack.append(self._call)
        self._call = ctx
        return replaced

    @contextlib.contextmanager
    def tracking(self):
        """Around the model's forward on a capture step (:mod:`.eager_capture` calls it, in
        the eager region a compiled caller does not trace): the call's row tracker is entered
        while the forward runs, and left when it returns."""
        ctx = self._call
        if ctx is None or not self.capturing:
            yield
            return
        ctx.in_forward = True
        if ctx.tracker is not None:
            ctx.tracker.enter()
        try:
            yield
        finally:
            ctx.in_forward = False
            ctx.close()

    def _entry_pre_hook(self, module, args, kwargs):
        """An inner module where masks enter (a tower, a stack, a wrapped model)."""
        if _in_backward() or self._call is None:
            return None
        with _untracked(self._call):
            return self._entries.enter(self._call, module, args, kwargs)

    def _rnn_hook(self, module, args, kwargs, output):
        """torch's recurrent layers document their layout: output[0] has the input's
        (batch, time) dimensions (``batch_first`` says which is which; both keep their
        places), however the layer's kernels decompose (GRU's per-step loop would lose it)."""
        ctx = self._call
        if ctx is None or ctx.tracker is None or _in_backward():
            return
        x = _first_tensor(args, kwargs)
        out = output[0] if isinstance(output, tuple) else output
        if isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor) and x.dim() == out.dim():
            tag = ctx.tracker.tag_of(x)
            if tag is not None:
                ctx.tracker.set_tag(out, tuple(tag[:-1]) + (None,))

    def _model_post_hook(self, module, args, kwargs, output):
        if _in_backward() or not self._call_stack:
            return
        ctx, self._call = self._call, self._call_stack.pop()
        if ctx is None:
            return
        ctx.close()
        self._masked_seen = self._masked_seen or bool(ctx.masks)
        self.mask_notes.update(ctx.notes)
        if ctx.regions:
            for node in _checkpoint_nodes(output):
                self._regions[node] = ctx

    def _layout(self, layer, ctx, tags_of, lead):
        """The :class:`~.row_provenance.RowsMask` of this call's rows of ``layer``, from the
        row tracker's tags (``tags_of(tracker)``), recording why rows could not be tied."""
        forced = self.check.all_rows.get(layer.name)
        if forced is not None:
            return RowsMask(None, "all rows (self-check)", forced)
        if ctx is None or ctx is _UNKNOWN or ctx.tracker is None:
            return _ALL_ROWS
        with _untracked(ctx):
            found = rows_mask(tags_of(ctx.tracker), tuple(lead), ctx.bool_masks(), ctx.cache)
        return found

    def _note(self, layer, found, ctx=None):
        self.mask_source[layer.name] = found.source
        if found.reason is not None:
            self.unmasked[layer.name] = found.reason
        elif (found.mask is None and ctx is not None and ctx is not _UNKNOWN
              and ctx.decoder_unmasked & self._ancestors[layer.name]):
            self.unmasked[layer.name] = (
                "it sits in the decoder of an encoder-decoder call that gave no decoder mask "
                "(pass decoder_attention_mask or labels): all its rows are used")

    def _replayed(self, layer, ctx, lead):
        """A reentrant recompute's layout: the one its grad-free first pass recorded."""
        if ctx is _UNKNOWN:
            if self._masked_seen:
                return RowsMask(None, "untied",
                                "recomputed during the backward pass by a reentrant checkpoint "
                                "region that no model call filed (a region nested in another "
                                "reentrant region)")
            return _ALL_ROWS
        forced = self.check.all_rows.get(layer.name)
        if forced is not None:
            return RowsMask(None, "all rows (self-check)", forced)
        if ctx is None or not ctx.masks:
            return _ALL_ROWS
        layouts = ctx.replay.get(layer.name, [])
        keys = {(l.source, l.reason, l.key) for l in layouts}
        if len(keys) != 1:
            return RowsMask(None, "untied",
                            "recomputed by a reentrant checkpoint after running with "
                            f"{len(keys)} different row layouts in its first pass")
        found = layouts[0]
        if found.mask is not None and tuple(found.mask.shape) != tuple(lead):
            return RowsMask(None, "untied", "its recomputed rows have another shape than "
                            "the first pass recorded")
        return found

    # -- hooks -----------------------------------------------------------------------
    def _active(self, module):
        """"capture", "first pass" (a grad-free forward inside a call with grad: reentrant
        checkpointing) or None."""
        if not self.should_capture():
            return None
        if not module.training:
            return "eval" if torch.is_grad_enabled() else None
        if torch.is_grad_enabled():
            return "capture"
        if _in_backward():  # the first pass of a region nested in a recompute
            ctx = self._context()
            if ctx is not None and ctx is not _UNKNOWN:
                ctx.nested = True
        elif self._call is not None and self._call.with_grad:
            self._call.regions = True  # a grad-free pass inside a call with grad: reentrant
            return "first pass"
        return None

    def _first_pass(self, layer, tags_of, lead):
        ctx = self._call
        if ctx is not None and ctx.masks:
            ctx.replay.setdefault(layer.name, []).append(self._layout(layer, ctx, tags_of, lead))

    def _input(self, layer, rows, mask, experts=None):
        with torch.no_grad(), torch.autocast(rows.device.type, enabled=False):
            if experts is None:
                return self.input_stat(layer, rows.detach(), mask)
            return self.input_stat(layer, rows.detach(), mask, experts=experts)

    def _commit(self, layer, a_stat, mask, g_rows, sketch=None, experts=None):
        with torch.no_grad(), torch.autocast(g_rows.device.type, enabled=False):
            if experts is None:
                g_stat, g_count = self.grad_stat(layer, g_rows.detach(), mask)
            else:
                g_stat, g_count = self.grad_stat(layer, g_rows.detach(), mask, experts=experts)
            if sketch is not None:
                self.check.commit(layer, sketch, mask, g_rows.detach())
        st = self._stats[layer.name]
        if st.settled and layer.module.weight.grad is None:
            # the gradient the earlier statistics went into was cleared: they are stale
            st.a_sum = st.g_sum = None
            st.a_count = st.g_count = 0
        st.settled = False
        (a, a_count) = a_stat
        st.a_sum, st.a_count = _add(st.a_sum, a), st.a_count + a_count
        st.g_sum, st.g_count = _add(st.g_sum, g_stat), st.g_count + g_count
        self.last_rows[layer.name] = a_count

    def _settle(self, names, param):
        """Post-accumulate-grad hook of a weight: the statistics of the layers ``names``
        committed so far went into its ``.grad``."""
        for name in names:
            self._stats[name].settled = True

    def _weight_grad(self, names, grad):
        """Gradient hook of a weight (before accumulation): the self-check's comparison
        of this backward's gradient with the rows committed since the last one."""
        # grad_hook="module" commits when the module's input gradient is ready, which the
        # weight's own gradient may precede: the weight check runs in the tensor mode only
        if self.capturing and self.check.checking and self.grad_hook == "tensor":
            with torch.no_grad():
                self.check.weight_fired(names, grad)

    def _captured(self, layer):
        """Called when a forward's input statistic is recorded (for subclasses)."""

    def _committed(self, layer, counted=True):
        """Called when a forward's statistics are complete (for subclasses); ``counted``:
        :meth:`_captured` was called for it (not for a recompute's lazy statistic)."""

    def _record(self, layer, rows_of, tags_of, output, grad_rows):
        """One call of ``layer``: its input statistic now (an ordinary forward) or in the
        gradient hook (a recompute during backward), paired with this call's gradient."""
        tensor_mode = self.grad_hook == "tensor"
        ctx = self._context()
        checking = self.check.checking
        if _in_backward():
            if not tensor_mode:
                if ctx is None or ctx is _UNKNOWN:
                    return  # module mode: only a filed reentrant region's recompute
                rows = rows_of()
                found = self._replayed(layer, ctx, rows.shape[:-1])
                self._note(layer, found, ctx)
                sketch = self.check.sketch(layer, rows) if checking else None
                self._stats[layer.name].pending.append(
                    (self._input(layer, rows, found.mask), found.mask, grad_rows, sketch))
                return

            def lazy(grad):
                try:
                    if ctx is not None and ctx is not _UNKNOWN and ctx.nested:
                        # regions nested in this recompute, upstream of this layer: file them
                        ctx.nested = False
                        for node in _checkpoint_nodes(output):
                            self._regions.setdefault(node, ctx)
                    rows = rows_of()
                    found = self._replayed(layer, ctx, rows.shape[:-1])
                    self._note(layer, found, ctx)
                    sketch = self.check.sketch(layer, rows) if checking else None
                    self._commit(layer, self._input(layer, rows, found.mask), found.mask,
                                 grad_rows(grad), sketch)
                except Exception as exc:  # noqa: BLE001 - named, never swallowed
                    raise _named_error(layer, exc) from exc
                self._committed(layer, counted=False)
            output.register_hook(lazy)
            return
        rows = rows_of()
        found = self._layout(layer, ctx, tags_of, rows.shape[:-1])
        self._note(layer, found, ctx)
        with _untracked(ctx):
            a_stat = self._input(layer, rows, found.mask)
            sketch = self.check.sketch(layer, rows) if checking else None
        self._captured(layer)
        mask = found.mask
        if tensor_mode:
            def hook(grad):
                try:
                    self._commit(layer, a_stat, mask, grad_rows(grad), sketch)
                except Exception as exc:  # noqa: BLE001
                    raise _named_error(layer, exc) from exc
                self._committed(layer)
            output.register_hook(hook)
        else:
            self._stats[layer.name].pending.append((a_stat, mask, grad_rows, sketch))

    def _mha_rows(self, layer, y, out):
        """(input rows, function grad -> rows) of an MHA out-projection, both with leading
        shape (B, T) for a batched input: F.multi_head_attention_forward multiplies the
        (T*B, E) rows in (T, B) order."""
        parent = layer.parent
        if out.dim() != 3:
            return y, lambda g: g
        B, T = (out.shape[0], out.shape[1]) if parent.batch_first else (out.shape[1],
                                                                        out.shape[0])
        rows = y.reshape(T, B, -1).transpose(0, 1)
        if parent.batch_first:
            return rows, lambda g: g
        return rows, lambda g: g.transpose(0, 1)

    @staticmethod
    def _mha_tags(parent, out):
        """The tags of an MHA out-projection's (B, T) rows: its output's (the queries'),
        in (B, T) order."""
        def tags_of(tracker):
            tag = tracker.tag_of(out)
            if tag is None or len(tag) != 3:
                return None if tag is None else tag[:-1]
            return (tag[0], tag[1]) if parent.batch_first else (tag[1], tag[0])
        return tags_of

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
            return self._experts_hooks(partners) if partners[0] is layer else []

        if layer.kind == "mha_out":
            weight = module.weight

            def mha_hook(parent, args, kwargs, output):
                state = self._active(parent)
                if state is None or state == "eval":
                    if state == "eval":
                        self.eval_seen.add(layer.name)
                    return
                out = output[0] if isinstance(output, tuple) else output
                tags_of = self._mha_tags(parent, out)
                if state == "first pass":
                    lead = ((out.shape[0], out.shape[1]) if parent.batch_first
                            else (out.shape[1], out.shape[0])) if out.dim() == 3 else out.shape[:1]
                    self._first_pass(layer, tags_of, lead)
                    return
                y = _find_matmul_input(out, weight) if out.grad_fn is not None else None
                if y is None:  # no autograd record of the projection: nothing to capture
                    if layer.name not in self._warned:
                        self._warned.add(layer.name)
                        warnings.warn(f"MKOR: could not find the input of {layer.name} in "
                                      "the autograd graph of its attention module; this "
                                      "layer keeps its current factors (it is listed in "
                                      "preconditioned_modules)", RuntimeWarning)
                    return
                rows, grad_rows = self._mha_rows(layer, y, out)
                self._record(layer, lambda: rows, tags_of, out, grad_rows)

            hooks = [(layer.parent, "forward", _guarded(layer, mha_hook))]
            if self.grad_hook == "module":
                hooks.append((layer.parent, "backward", BoundHook(self._module_backward, layer)))
            return hooks

        def forward_hook(module, args, kwargs, output):
            state = self._active(module)
            if state is None or not isinstance(output, torch.Tensor):
                return
            x = _first_tensor(args, kwargs)
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
                self._first_pass(layer, tags_of, lead)
                return
            if not output.requires_grad:
                return
            lead = None

            def rows_of():
                nonlocal lead
                rows = layer.type.input_rows(module, x)
                lead = tuple(rows.shape[:-1])
                return rows
            self._record(layer, rows_of, tags_of, output,
                         lambda g: layer.type.grad_rows(module, g))

        hooks = [(module, "forward", _guarded(layer, forward_hook))]
        if self.grad_hook == "module":
            hooks.append((module, "backward", BoundHook(self._module_backward, layer)))
        return hooks

    def _module_backward(self, layer, module, grad_input, grad_output):
        """Full backward hook of ``layer`` (``grad_hook="module"``)."""
        st = self._stats[layer.name]
        if module.training and grad_output[0] is not None and st.pending:
            a_stat, mask, grad_rows, sketch = st.pending.pop()
            self._commit(layer, a_stat, mask, grad_rows(grad_output[0]), sketch)
            self._committed(layer)

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
            self._handles.append(self.model.register_forward_pre_hook(
                gate(self._model_pre_hook), with_kwargs=True))
            self._handles.append(self.model.register_forward_hook(
                gate(self._model_post_hook), with_kwargs=True, always_call=True))
            for module in self.model.modules():
                if isinstance(module, torch.nn.RNNBase):
                    self._handles.append(module.register_forward_hook(
                        gate(self._rnn_hook), with_kwargs=True))
            for module in (self._entries.modules() if self._entries is not None else ()):
                if module is not self.model:
                    self._handles.append(module.register_forward_pre_hook(
                        gate(self._entry_pre_hook), with_kwargs=True))

    def _hook_weights(self):
        """Hooks on the layers' *current* weight parameters: the settle hook, and the
        self-check's gradient hook where the weight's gradient passes through autograd."""
        handles, by_weight = [], {}
        for layer in self.layers:
            by_weight.setdefault(id(layer.module.weight), (layer.module.weight, []))[1].append(
                layer.name)
        for weight, names in by_weight.values():
            handles.append(weight.register_post_accumulate_grad_hook(
                BoundHook(self._settle, names)))  # runs in the autograd engine, never traced
            if self.check.every is not None and self.check.weight_checkable(weight):
                handles.append(weight.register_hook(BoundHook(self._weight_grad, names)))
        return handles

    def rehook_weights(self):
        """Move the weight hooks to the layers' current weights, after the model's
        parameters were replaced (FSDP2's ``fully_shard`` after construction,
        :class:`~.fsdp.ParameterBinding`); statistics and the module hooks are kept."""
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
        for name in self._stats:
            self._stats[name] = _Stats()
        self._regions = {}
        self._masked_seen = self._explicit is not None
        self.check.reset()

    def drop_committed(self):
        """Drop the statistics of completed forward + backward pairs (their gradients are
        being zeroed), keeping forwards that still wait for their backward: a
        ``zero_grad()`` between a forward and its backward loses nothing."""
        for st in self._stats.values():
            st.a_sum = st.g_sum = None
            st.a_count = st.g_count = 0
            st.settled = False
        self.check.reset()

    def stats(self, name):
        """(a_sum, a_count, g_sum, g_count) of layer ``name``, or None if incomplete,
        stale (settled into a gradient that has since been cleared), refused by the
        self-check, or of a layer the self-check released."""
        st = self._stats[name]
        if st.a_sum is None or st.g_sum is None or st.flagged or name in self.check.released:
            return None
        if st.settled and self._by_name[name].module.weight.grad is None:
            return None
        return st.a_sum, st.a_count, st.g_sum, st.g_count

    def finish_capture_step(self, process_group=None):
        """On a step that consumes statistics: read the self-check's verdicts (one host
        synchronisation, only on a checked step; one all-reduce across ranks) and apply
        them: a layer whose padding rows carried gradient has this step's statistics
        refused and uses all its rows from now on (listed in :attr:`unmasked`); a layer
        whose weight gradient is not its rows' is released (:attr:`SelfCheck.released`):
        its gradient goes to the backbone unchanged. Returns the names newly released."""
        flagged, released = self.check.finish(process_group)
        self._new_all_rows = list(flagged)
        for name in flagged:
            self._stats[name].flagged = True
            self.unmasked[name] = self.check.all_rows[name]
        for name in released:
            self._stats[name].flagged = True
        return released

    def all_rows_new(self):
        """Layers the last :meth:`finish_capture_step` moved to all rows."""
        return getattr(self, "_new_all_rows", [])

    def unpaired(self):
        """Names of layers holding forwards that never received a gradient
        (``grad_hook="module"`` only; the tensor mode pairs exactly)."""
        return [name for name, st in self._stats.items() if st.pending]


def weak_schedule(method):
    """A ``should_capture`` callable that holds its owner weakly: hooks left behind by a
    preconditioner that was garbage-collected capture nothing."""
    ref = weakref.WeakMethod(method)

    def schedule():
        bound = ref()
        return bound is not None and bound()
    return schedule
