r"""Activation / output-gradient hooks (spec MKOR.md K2-K6).

Hooks (kfac-pytorch pattern) capture a layer's statistics only when the module is in
training mode, grad is enabled and the owner's schedule says so (K2). The rows come from
the layer's :class:`~.layers.LayerType`; the owner's ``input_stat`` / ``grad_stat`` turn
them into additive statistics, summed over every forward + backward until :meth:`reset`.

**Pairing.** With ``grad_hook="tensor"`` (default) one forward hook computes the input
statistic and attaches a gradient hook to *that forward's output* carrying it, so every
output gradient is paired with exactly the forward that produced it: a train-mode forward
that is never back-propagated (a metric, a discarded branch) contributes nothing, and a
layer used twice in one graph contributes both uses. ``grad_hook="module"`` uses
``register_full_backward_hook``, which sees gradients per module, not per forward: inputs
wait on a stack, and a forward left without its backward makes the pairing ambiguous, so
:meth:`Capture.unpaired` reports it and the owner raises.

**Stale statistics.** A layer whose ``weight.grad`` is None when it is captured starts a
new accumulation cycle: statistics committed earlier (a batch whose step was skipped, e.g.
by ``GradScaler`` on overflow, followed by ``zero_grad()``) are dropped, so they can never
leak into a later step. (Gradients zeroed in place, ``set_to_none=False``, cannot be told
apart from accumulation: call the preconditioner's own ``zero_grad`` then.)

**Token masks.** With a (B, T) boolean mask set (from the model's ``attention_mask``
keyword, or :meth:`Capture.token_mask`), the rows of every layer whose leading shape is
(B, T) are selected by it, so padded positions never enter the statistics.

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

__all__ = ["Capture", "HookedLayers"]


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


def _first_tensor(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


class _Stats:
    """Accumulated statistics of one layer since the last reset."""

    __slots__ = ("pending", "a_sum", "a_count", "g_sum", "g_count")

    def __init__(self):
        self.pending = []  # grad_hook="module": (input statistic, mask) awaiting a gradient
        self.a_sum = self.g_sum = None
        self.a_count = self.g_count = 0


def _add(total, x):
    return x if total is None else total + x


class Capture:
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
        model: the top-level module; with ``mask_kwarg`` its forward keyword of that name
            (a 2-D tensor, nonzero = real token) becomes the token mask of that forward.

    After a backward, :meth:`stats` returns ``(a_sum, a_count, g_sum, g_count)`` per layer
    name for layers that saw at least one complete forward + backward.
    """

    def __init__(self, layers, should_capture, input_stat, grad_stat, grad_hook="tensor",
                 model=None, mask_kwarg=None):
        if grad_hook not in ("module", "tensor"):
            raise ValueError(f"grad_hook must be 'module' or 'tensor', got {grad_hook!r}")
        self.grad_hook = grad_hook
        self.layers = list(layers)
        self.should_capture = should_capture
        self.input_stat = input_stat
        self.grad_stat = grad_stat
        self.model, self.mask_kwarg = model, mask_kwarg
        self._stats = {layer.name: _Stats() for layer in self.layers}
        self._handles = []
        self._warned = set()  # layers already warned about (once each)
        self._explicit_mask = None  # set by token_mask(); wins over the keyword
        self._forward_mask = None   # from the model's mask keyword, during its forward

    # -- token masks -----------------------------------------------------------------
    @contextlib.contextmanager
    def token_mask(self, mask):
        """Within the block, rows whose leading shape equals ``mask.shape`` are selected
        by ``mask`` (nonzero = keep)."""
        previous, self._explicit_mask = self._explicit_mask, _as_bool(mask)
        try:
            yield
        finally:
            self._explicit_mask = previous

    def _mask(self):
        return self._explicit_mask if self._explicit_mask is not None else self._forward_mask

    def _model_pre_hook(self, module, args, kwargs):
        value = kwargs.get(self.mask_kwarg)
        self._forward_mask = (_as_bool(value) if isinstance(value, torch.Tensor)
                              and value.dim() == 2 else None)

    def _model_post_hook(self, module, args, kwargs, output):
        self._forward_mask = None

    # -- hooks -----------------------------------------------------------------------
    def _active(self, module):
        return module.training and torch.is_grad_enabled() and self.should_capture()

    def _start(self, layer):
        """A capture begins: drop statistics of an earlier, zeroed gradient cycle."""
        st = self._stats[layer.name]
        if st.g_sum is not None and layer.module.weight.grad is None:
            st.a_sum = st.g_sum = None
            st.a_count = st.g_count = 0

    def _input(self, layer, rows, mask):
        mask = mask if mask is not None and rows.shape[:-1] == mask.shape else None
        with torch.no_grad(), torch.autocast(rows.device.type, enabled=False):
            return self.input_stat(layer, rows.detach(), mask), mask

    def _commit(self, layer, a_stat, mask, g_rows):
        with torch.no_grad(), torch.autocast(g_rows.device.type, enabled=False):
            g_stat, g_count = self.grad_stat(layer, g_rows.detach(), mask)
        st = self._stats[layer.name]
        (a, a_count) = a_stat
        st.a_sum, st.a_count = _add(st.a_sum, a), st.a_count + a_count
        st.g_sum, st.g_count = _add(st.g_sum, g_stat), st.g_count + g_count
        self._committed(layer)

    def _captured(self, layer):
        """Called when a forward's input statistic is recorded (for subclasses)."""

    def _committed(self, layer):
        """Called when a forward's statistics are complete (for subclasses)."""

    def _tensor_hook(self, layer, a_stat, mask, to_rows):
        def hook(grad):
            self._commit(layer, a_stat, mask, to_rows(grad))
        return hook

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

    def _make_hooks(self, layer):
        """[(target module, kind, hook)] for ``layer``."""
        tensor_mode = self.grad_hook == "tensor"
        module = layer.module

        if layer.kind == "mha_out":
            weight = module.weight

            def mha_hook(parent, args, kwargs, output):
                if not self._active(parent):
                    return
                out = output[0] if isinstance(output, tuple) else output
                y = _find_matmul_input(out, weight) if out.grad_fn is not None else None
                if y is None:  # no autograd record of the projection: nothing to capture
                    if layer.name not in self._warned:
                        self._warned.add(layer.name)
                        warnings.warn(f"MKOR: could not find the input of {layer.name} in "
                                      "the autograd graph of its attention module; this "
                                      "layer keeps its current factors (it is listed in "
                                      "preconditioned_modules)", RuntimeWarning)
                    return
                self._start(layer)
                rows, grad_rows = self._mha_rows(layer, y, out)
                a_stat, mask = self._input(layer, rows, self._mask())
                self._captured(layer)
                if tensor_mode:
                    out.register_hook(self._tensor_hook(layer, a_stat, mask, grad_rows))
                else:
                    self._stats[layer.name].pending.append((a_stat, mask, grad_rows))

            hooks = [(layer.parent, "forward", mha_hook)]
            if not tensor_mode:
                hooks.append((layer.parent, "backward", self._module_backward(layer)))
            return hooks

        def forward_hook(module, args, kwargs, output):
            if not (self._active(module) and isinstance(output, torch.Tensor)
                    and output.requires_grad):
                return
            x = _first_tensor(args, kwargs)
            if x is None:
                return
            self._start(layer)
            a_stat, mask = self._input(layer, layer.type.input_rows(module, x), self._mask())
            self._captured(layer)
            grad_rows = lambda g: layer.type.grad_rows(module, g)  # noqa: E731
            if tensor_mode:
                output.register_hook(self._tensor_hook(layer, a_stat, mask, grad_rows))
            else:
                self._stats[layer.name].pending.append((a_stat, mask, grad_rows))

        hooks = [(module, "forward", forward_hook)]
        if not tensor_mode:
            hooks.append((module, "backward", self._module_backward(layer)))
        return hooks

    def _module_backward(self, layer):
        def backward_hook(module, grad_input, grad_output):
            st = self._stats[layer.name]
            if module.training and grad_output[0] is not None and st.pending:
                a_stat, mask, grad_rows = st.pending.pop()
                self._commit(layer, a_stat, mask, grad_rows(grad_output[0]))
        return backward_hook

    def register(self):
        """Install the hooks (idempotent)."""
        if self._handles:
            return
        _silence_first_layer_warning()
        for layer in self.layers:
            for target, kind, hook in self._make_hooks(layer):
                if kind == "forward":
                    handle = target.register_forward_hook(hook, with_kwargs=True)
                else:
                    handle = target.register_full_backward_hook(hook)
                self._handles.append(handle)
        if self.model is not None and self.mask_kwarg is not None:
            self._handles.append(self.model.register_forward_pre_hook(
                self._model_pre_hook, with_kwargs=True))
            self._handles.append(self.model.register_forward_hook(
                self._model_post_hook, with_kwargs=True))

    def remove(self):
        """Remove every hook and drop all statistics."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.reset()

    @property
    def registered(self):
        return bool(self._handles)

    # -- statistics ------------------------------------------------------------------
    def reset(self):
        """Drop accumulated and pending statistics (called after every step)."""
        for name in self._stats:
            self._stats[name] = _Stats()

    def drop_committed(self):
        """Drop the statistics of completed forward + backward pairs (their gradients are
        being zeroed), keeping forwards that still wait for their backward: a
        ``zero_grad()`` between a forward and its backward loses nothing."""
        for st in self._stats.values():
            st.a_sum = st.g_sum = None
            st.a_count = st.g_count = 0

    def stats(self, name):
        """(a_sum, a_count, g_sum, g_count) of layer ``name``, or None if incomplete."""
        st = self._stats[name]
        if st.a_sum is None or st.g_sum is None:
            return None
        return st.a_sum, st.a_count, st.g_sum, st.g_count

    def unpaired(self):
        """Names of layers holding forwards that never received a gradient
        (``grad_hook="module"`` only; the tensor mode pairs exactly)."""
        return [name for name, st in self._stats.items() if st.pending]


def _as_bool(mask):
    return mask if mask.dtype == torch.bool else mask != 0


def weak_schedule(method):
    """A ``should_capture`` callable that holds its owner weakly: hooks left behind by a
    preconditioner that was garbage-collected capture nothing."""
    ref = weakref.WeakMethod(method)

    def schedule():
        bound = ref()
        return bound is not None and bound()
    return schedule


class HookedLayers:
    """Introspection shared by the hook-based preconditioners (``MKOR``, ``KFAC``), which keep
    ``_layers``, ``_skipped`` ({name: reason}) and a ``_steps`` counter."""

    @property
    def preconditioned_modules(self):
        """Names of the preconditioned modules (in ``named_modules`` order)."""
        return [layer.name for layer in self._layers]

    @property
    def skipped_modules(self):
        """Names of modules with parameters that go to the backbone unpreconditioned."""
        return list(self._skipped)

    @property
    def skip_reasons(self):
        """{module name: why it is not preconditioned}."""
        return dict(self._skipped)

    @property
    def steps(self):
        return self._steps
