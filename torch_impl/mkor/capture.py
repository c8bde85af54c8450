r"""Module discovery and activation / output-gradient hooks (spec MKOR.md K1-K6).

Discovery: every ``nn.Linear`` (including subclasses such as the
``NonDynamicallyQuantizableLinear`` out-projection of ``nn.MultiheadAttention``, any
number of leading input dimensions) and every ``nn.Conv2d`` with ``groups == 1``.
Parameters of all other modules stay with the backbone optimizer untouched.

Hooks (kfac-pytorch pattern): a ``register_forward_pre_hook`` records the input
statistic and a ``register_full_backward_hook`` the output-gradient statistic. Both
capture only when the module is in training mode and the owner's schedule says so;
the forward hook additionally needs ``torch.is_grad_enabled()`` (K2). Input
statistics wait in a per-module stack until their backward arrives, so forwards
without a backward (e.g. a validation pass left in train mode) are dropped at the
next reset instead of polluting a_bar. PyTorch forbids modifying the output of a
module with a full backward hook in place (e.g. ``Linear`` then
``ReLU(inplace=True)``); ``grad_hook="tensor"`` hooks the output tensor instead.

``nn.MultiheadAttention`` never calls its ``out_proj`` module (it passes the weight
to ``F.multi_head_attention_forward``), so out-projections are captured through the
parent: a forward hook on the attention module reads the projection's input from
the autograd node that multiplies by ``out_proj.weight``, and the parent's backward
hook supplies the output gradient.
"""
import fnmatch
import warnings

import torch
import torch.nn as nn

__all__ = ["Layer", "Capture", "discover", "unwrap_model", "conv_input"]



def _silence_first_layer_warning():
    """Torch warns when a full backward hook fires on a module whose inputs need no
    grad (the first layer). That is exactly the case we rely on, so the warning is
    noise; the filter is (re)installed at every registration because contexts such as
    ``warnings.catch_warnings`` restore the filter list on exit."""
    warnings.filterwarnings(
        "ignore", message="Full backward hook is firing when gradients are computed with "
        "respect to module outputs", category=UserWarning)


class Layer:
    """A preconditioned module: its name, kind ("linear", "conv2d", "mha_out"), module."""

    def __init__(self, name, module, kind, parent=None):
        self.name = name
        self.module = module
        self.kind = kind
        self.parent = parent  # the nn.MultiheadAttention owning an "mha_out" layer
        self.has_bias = module.bias is not None

    @property
    def d_out(self):
        return self.module.weight.shape[0]

    @property
    def d_in(self):
        """d_in' = columns of [W.view(d_out, -1) | b]."""
        return self.module.weight[0].numel() + int(self.has_bias)

    def __repr__(self):
        return f"Layer({self.name!r}, {self.kind}, d_out={self.d_out}, d_in'={self.d_in})"


def unwrap_model(model):
    """Strip DistributedDataParallel / DataParallel wrappers (their ``module.`` prefix)."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model


def _kind(module):
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Conv2d) and module.groups == 1:
        return "conv2d"
    return None


def _matches(name, patterns):
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def discover(model, skip=()):
    """Find the preconditioned layers of ``model``.

    Args:
        model: any ``nn.Module`` (DDP / DataParallel wrappers are unwrapped).
        skip: glob patterns of module names to leave to the backbone (the released
            code's ``sgd_layers``).

    Returns:
        (layers, skipped): a list of :class:`Layer`, and the names of modules that own
        parameters but are not preconditioned (unsupported type or skipped by name).
    """
    model = unwrap_model(model)
    layers, skipped = [], []
    mha_parent = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            mha_parent[id(module.out_proj)] = module
    for name, module in model.named_modules():
        own_params = any(True for _ in module.parameters(recurse=False))
        kind = _kind(module)
        if kind is None or _matches(name, skip) or not module.weight.requires_grad:
            if own_params:
                skipped.append(name)
            continue
        parent = mha_parent.get(id(module))
        layers.append(Layer(name, module, "mha_out" if parent is not None else kind, parent))
    return layers, skipped


def conv_input(module, x):
    """(x, padding) as the convolution sees them: string paddings ('same', 'valid')
    and non-zero padding modes are applied explicitly, like ``Conv2d._conv_forward``."""
    if isinstance(module.padding, str) or module.padding_mode != "zeros":
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        return nn.functional.pad(x, module._reversed_padding_repeated_twice, mode=mode), 0
    return x, module.padding


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


class _Stats:
    """Accumulated statistics of one layer since the last reset."""

    __slots__ = ("pending", "a_sum", "a_count", "g_sum", "g_calls")

    def __init__(self):
        self.pending = []
        self.a_sum = None
        self.a_count = 0
        self.g_sum = None
        self.g_calls = 0


def _add(total, x):
    return x if total is None else total + x


class Capture:
    """Hooks that accumulate per-layer statistics between resets.

    Args:
        layers: the :class:`Layer` list from :func:`discover`.
        should_capture: ``callable() -> bool``, the owner's schedule (pure Python, no
            tensor reads), consulted in every hook.
        input_stat: ``callable(layer, x) -> (tensor, count)``, additive input statistic
            of one forward (x: the layer's input; for an MHA out-projection, the
            (N, d_in) rows the projection multiplies).
        grad_stat: ``callable(layer, g) -> tensor``, additive statistic of one output
            gradient (g: (..., d_out) rows for Linear / MHA, 4-D for Conv2d).
        grad_hook: ``"tensor"`` (default): a forward hook attaches a gradient hook to the
            output tensor, only when the schedule captures, so other steps pay nothing;
            it sees the gradient of the pre-modification value and works with in-place
            successors. ``"module"``: ``register_full_backward_hook``, which wraps every
            forward (about 2 % of an SGD step on the 4 x Linear(1024) benchmark, 1 thread)
            and which PyTorch forbids before an in-place op (``ReLU(inplace=True)``).

    After a backward, :meth:`stats` returns ``(a_sum, a_count, g_sum, g_calls)`` per
    layer name for layers that saw at least one complete forward + backward.
    """

    def __init__(self, layers, should_capture, input_stat, grad_stat, grad_hook="tensor"):
        if grad_hook not in ("module", "tensor"):
            raise ValueError(f"grad_hook must be 'module' or 'tensor', got {grad_hook!r}")
        self.grad_hook = grad_hook
        self.layers = list(layers)
        self.should_capture = should_capture
        self.input_stat = input_stat
        self.grad_stat = grad_stat
        self._stats = {layer.name: _Stats() for layer in self.layers}
        self._handles = []
        self._warned = set()  # layers already warned about (once each)

    # -- hooks ---------------------------------------------------------------------
    def _active(self, module):
        return module.training and self.should_capture()

    def _push_input(self, layer, x):
        with torch.no_grad():
            self._stats[layer.name].pending.append(self.input_stat(layer, x.detach()))

    def _pop_grad(self, layer, g):
        st = self._stats[layer.name]
        if not st.pending:  # the matching forward was not captured
            return
        a_stat, count = st.pending.pop()
        with torch.no_grad():
            g_stat = self.grad_stat(layer, g.detach())
        st.a_sum, st.a_count = _add(st.a_sum, a_stat), st.a_count + count
        st.g_sum, st.g_calls = _add(st.g_sum, g_stat), st.g_calls + 1

    def _grad_hook(self, layer):
        """Tensor hook for ``grad_hook="tensor"``: fires with d loss / d output."""
        def hook(grad):
            self._pop_grad(layer, grad)
        return hook

    def _make_hooks(self, layer):
        """(module, forward-pre hook, forward hook, full backward hook) of ``layer``."""
        tensor_mode = self.grad_hook == "tensor"

        def backward_hook(module, grad_input, grad_output):
            if module.training and grad_output[0] is not None:
                self._pop_grad(layer, grad_output[0])

        if layer.kind == "mha_out":
            weight = layer.module.weight

            def forward_hook(module, inputs, output):
                if not (self._active(module) and torch.is_grad_enabled()):
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
                self._push_input(layer, y.reshape(-1, y.shape[-1]))
                if tensor_mode:
                    out.register_hook(self._grad_hook(layer))

            return layer.parent, None, forward_hook, None if tensor_mode else backward_hook

        def pre_hook(module, inputs):
            if not (self._active(module) and torch.is_grad_enabled()):
                return
            self._push_input(layer, inputs[0])

        def output_hook(module, inputs, output):
            # Same test as pre_hook (nothing in between changes it), so a tensor hook is
            # attached exactly when an input statistic was pushed.
            if self._active(module) and torch.is_grad_enabled() and output.requires_grad:
                output.register_hook(self._grad_hook(layer))

        if tensor_mode:
            return layer.module, pre_hook, output_hook, None
        return layer.module, pre_hook, None, backward_hook

    def register(self):
        """Install the hooks (idempotent)."""
        if self._handles:
            return
        _silence_first_layer_warning()
        for layer in self.layers:
            target, pre_hook, forward_hook, backward_hook = self._make_hooks(layer)
            if pre_hook is not None:
                self._handles.append(target.register_forward_pre_hook(pre_hook))
            if forward_hook is not None:
                self._handles.append(target.register_forward_hook(forward_hook))
            if backward_hook is not None:
                self._handles.append(target.register_full_backward_hook(backward_hook))

    def remove(self):
        """Remove every hook and drop all statistics."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.reset()

    @property
    def registered(self):
        return bool(self._handles)

    # -- statistics ----------------------------------------------------------------
    def reset(self):
        """Drop accumulated and pending statistics (called after every step)."""
        for name in self._stats:
            self._stats[name] = _Stats()

    def stats(self, name):
        """(a_sum, a_count, g_sum, g_calls) of layer ``name``, or None if incomplete."""
        st = self._stats[name]
        if st.a_sum is None or st.g_sum is None:
            return None
        return st.a_sum, st.a_count, st.g_sum, st.g_calls


class HookedLayers:
    """Introspection shared by the hook-based preconditioners (``MKOR``, ``KFAC``), which keep
    ``_layers`` (from :func:`discover`), ``_skipped`` and a ``_steps`` counter."""

    @property
    def preconditioned_modules(self):
        """Names of the preconditioned modules (in ``named_modules`` order)."""
        return [layer.name for layer in self._layers]

    @property
    def skipped_modules(self):
        """Names of modules with parameters that go to the backbone unpreconditioned."""
        return list(self._skipped)

    @property
    def steps(self):
        return self._steps
