r"""Which model call a forward belongs to, and so which token mask its rows read: the call
contexts and checkpoint regions of a :class:`~.capture.Capture` (``torch_impl/kronecker/capture/README.md``).

**Calls.** A forward pre-hook on the model opens a :class:`~.token_masks.CallContext` for
each model call (a stack of them: a model may call itself, e.g. a tower of a two-tower
model); the token masks enter it where the model's modules take them (:mod:`.token_masks`)
or by hand (:meth:`CallTracker.token_mask`), and the call's row tracker
(:mod:`.row_provenance`) follows them to every layer's rows. The forward post-hook closes it.

**Checkpoint regions.** A forward that runs *during a backward pass* is a recompute
(``torch.utils.checkpoint``); its call is found through the autograd graph. When a hooked
layer runs without grad inside a model call that has grad (the first pass of a reentrant
region), the call records that it has regions, and its post-hook walks the graph of the
call's outputs and files every ``CheckpointFunctionBackward`` node under the call's context;
the recompute runs while the engine executes that very node
(``torch._C._current_autograd_node()``), so each region finds its own call, however many
calls share the backward. A region nested in another reentrant region gets its node only
during the outer recompute: the first gradient hook of that recompute files the nested
regions upstream of its layer under the same call (:meth:`CallTracker.file_nested`); a nested
region with no hooked layer after it in the outer region is not filed, and its layers use
all their rows and are reported (``unmasked``) when the call had masks, never guessed.

**Where each layer's rows took their mask from** (``mask_source``), why they could not be
tied to one (``unmasked``), and what a mask could not be tied to (``mask_notes``) are kept
here for :meth:`~torch_impl.kronecker.optimizer.PreconditionedOptimizer.capture_report`.
"""
import contextlib

import torch

from .guards import _UNKNOWN, _in_backward, _untracked
from .row_provenance import RowsMask, rows_mask
from .token_masks import CallContext, MaskEntries, tag_explicit

__all__ = ["CallTracker", "ALL_ROWS", "first_tensor", "checkpoint_nodes"]

#: the layout of rows that read no mask
ALL_ROWS = RowsMask(None, "none")


def first_tensor(args, kwargs):
    """The first tensor among a call's arguments (its row input), or None."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
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


def checkpoint_nodes(output):
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


class CallTracker:
    """The call contexts of one model (module docstring).

    Args:
        model: the top-level module (None: no calls are tracked, every row is used).
        mask_kwarg: the forward parameter holding a (B, T) token mask, or None.
        layers: the hooked :class:`~torch_impl.kronecker.discovery.Layer` list.
        forced: {layer name: reason} of layers the self-check moved to all their rows (the
            :class:`~.self_check.SelfCheck`'s ``all_rows``, read live).
    """

    def __init__(self, model, mask_kwarg, layers, forced):
        self.model = model
        self._entries = MaskEntries(model, mask_kwarg) if model is not None else None
        names = dict(model.named_modules()) if model is not None else {}
        self._ancestors = {  # {layer: ids of the modules it sits in} (decoder stacks)
            layer.name: {id(m) for n, m in names.items()
                         if n == "" or layer.name.startswith(n + ".")}
            for layer in layers}
        self._forced = forced
        #: {layer name: why its rows were not selected by a token mask}
        self.unmasked = {}
        #: {layer name: where its rows' mask came from at its last capture}
        self.mask_source = {}
        #: what a mask could not be tied to (an input whose shape is not the mask's)
        self.mask_notes = set()
        self._explicit = None   # (mask, batch_first) set by token_mask(); wins over keywords
        self._call = None       # CallContext of the model's forward now running
        self._call_stack = []   # calls the model's current forward interrupted (nesting)
        self._masked_seen = False  # some call since the last reset had a token mask
        self._regions = {}      # CheckpointFunctionBackward node -> CallContext

    def reset(self):
        """Forget the regions of the step's backwards (called with the statistics' reset)."""
        self._regions = {}
        self._masked_seen = self._explicit is not None

    # -- the model's hooks -----------------------------------------------------------
    def hooks(self):
        """[(module, kind, hook)] to install: the model's pre- and post-hook, the recurrent
        layers' hooks and the pre-hooks of the inner modules where masks enter. ``kind``:
        "pre" or "post" (a forward hook that runs even when the forward raises)."""
        if self.model is None:
            return []
        hooks = [(self.model, "pre", self._model_pre_hook),
                 (self.model, "post", self._model_post_hook)]
        hooks += [(module, "forward", self._rnn_hook) for module in self.model.modules()
                  if isinstance(module, torch.nn.RNNBase)]
        hooks += [(module, "pre", self._entry_pre_hook)
                  for module in (self._entries.modules() if self._entries is not None else ())
                  if module is not self.model]
        return hooks

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

    def context(self):
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
    def tracking(self, capturing):
        """Around the model's forward on a capture step: the call's row tracker is entered
        while the forward runs, and left when it returns."""
        ctx = self._call
        if ctx is None or not capturing:
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
        x = first_tensor(args, kwargs)
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
            for node in checkpoint_nodes(output):
                self._regions[node] = ctx

    # -- grad-free passes: reentrant checkpointing ---------------------------------
    def grad_free_pass(self):
        """A hooked layer ran in train mode without grad: "first pass" if this is the first
        pass of a reentrant region inside a model call with grad (the call then has regions
        to file), else None; during a backward it is the first pass of a region nested in a
        recompute, which that recompute's gradient hooks file (:meth:`file_nested`)."""
        if _in_backward():
            ctx = self.context()
            if ctx is not None and ctx is not _UNKNOWN:
                ctx.nested = True
        elif self._call is not None and self._call.with_grad:
            self._call.regions = True  # a grad-free pass inside a call with grad: reentrant
            return "first pass"
        return None

    def first_pass(self, layer, tags_of, lead):
        """Record the layout of a grad-free first pass, for its recompute."""
        ctx = self._call
        if ctx is not None and ctx.masks:
            ctx.replay.setdefault(layer.name, []).append(self.layout(layer, ctx, tags_of, lead))

    def file_nested(self, ctx, output):
        """Regions nested in a recompute, upstream of a layer whose gradient hook runs now
        (``output``: that layer's output in the recompute): filed under the recompute's
        call ``ctx``."""
        if ctx is not None and ctx is not _UNKNOWN and ctx.nested:
            ctx.nested = False
            for node in checkpoint_nodes(output):
                self._regions.setdefault(node, ctx)

    # -- a layer's rows and their mask ----------------------------------------------
    def layout(self, layer, ctx, tags_of, lead):
        """The :class:`~.row_provenance.RowsMask` of this call's rows of ``layer``, from the
        row tracker's tags (``tags_of(tracker)``), recording why rows could not be tied."""
        forced = self._forced.get(layer.name)
        if forced is not None:
            return RowsMask(None, "all rows (self-check)", forced)
        if ctx is None or ctx is _UNKNOWN or ctx.tracker is None:
            return ALL_ROWS
        with _untracked(ctx):
            found = rows_mask(tags_of(ctx.tracker), tuple(lead), ctx.bool_masks(), ctx.cache)
        return found

    def note(self, layer, found, ctx=None):
        """Record where ``layer``'s rows took their mask from (and why not)."""
        self.mask_source[layer.name] = found.source
        if found.reason is not None:
            self.unmasked[layer.name] = found.reason
        elif (found.mask is None and ctx is not None and ctx is not _UNKNOWN
              and ctx.decoder_unmasked & self._ancestors[layer.name]):
            self.unmasked[layer.name] = (
                "it sits in the decoder of an encoder-decoder call that gave no decoder mask "
                "(pass decoder_attention_mask or labels): all its rows are used")

    def replayed(self, layer, ctx, lead):
        """A reentrant recompute's layout: the one its grad-free first pass recorded."""
        if ctx is _UNKNOWN:
            if self._masked_seen:
                return RowsMask(None, "untied",
                                "recomputed during the backward pass by a reentrant checkpoint "
                                "region that no model call filed (a region nested in another "
                                "reentrant region)")
            return ALL_ROWS
        forced = self._forced.get(layer.name)
        if forced is not None:
            return RowsMask(None, "all rows (self-check)", forced)
        if ctx is None or not ctx.masks:
            return ALL_ROWS
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
