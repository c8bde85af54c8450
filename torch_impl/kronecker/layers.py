r"""Layer types: how MKOR and K-FAC read a layer's statistics and write its gradient back.

A Kronecker-factored preconditioner needs four things from a layer y = W a (+ b):

* the **input rows** a_i (d_in values each) that multiply W, with the leading dimensions
  that index them (tokens, or a sample's convolution positions) kept;
* the **output-gradient rows** g_i = dloss/dy_i (d_out values each), with the same leading
  dimensions;
* how many rows make one sample (1 for a token of a Linear layer, the L output positions of
  a convolution): K-FAC's G and MKOR's g_bar count samples, not rows (K3, K4);
* the **weight layout**: a (d_out, d_in) matrix view of ``weight.grad`` to read, and a way
  to write the preconditioned (d_out, d_in) matrix back.

:class:`LayerType` bundles them; :func:`register_layer_type` adds one, so a new module class
is covered by design rather than by class name. Built in: ``nn.Linear`` and the subclasses
that keep its product, ``nn.Conv2d`` with ``groups == 1``, and transformers' ``Conv1D``
(GPT-2: W stored in x out, y = x W + b), recognised without importing transformers (a module
can only be a ``Conv1D`` if ``transformers.pytorch_utils`` is already imported).

**nn.Linear subclasses** (issue 45). The hooks read a Linear's input and the gradient of its
output as the rows of y = x W^T + b, which only ``nn.Linear.forward`` guarantees. A subclass
whose class overrides ``forward`` may compute any other product (DeepSeek-V4's block-diagonal
``DeepseekV4GroupedLinear``, a router returning a tuple, a head scaling its logits), so it is
refused with that reason unless its forward is *declared* to be x W^T + b: listed in
``_KNOWN_LINEAR_PRODUCTS`` (each entry tested against ``F.linear``) or given to
``LinearType(cls)``, registered by the user. Where the forward comes from is read from the
class's MRO (a subclass of a declared class that does not override ``forward`` is declared too).
"""
import math
import sys

import torch.nn as nn
import torch.nn.functional as F

__all__ = ["LayerType", "LinearType", "Conv2dType", "HFConv1DType", "register_layer_type",
           "unregister_layer_type", "layer_types", "layer_type_for", "conv_input"]


class LayerType:
    """How to precondition one kind of module. Subclass and :func:`register_layer_type`.

    Every method takes the module; ``rows`` tensors have shape ``(*lead, d)`` where ``lead``
    indexes the rows (kept so that a token mask of the same shape can select them).
    """

    #: a short name shown in ``repr`` and in messages
    name = "layer"

    def matches(self, module):
        """Whether this type handles ``module`` (the first registered match wins)."""
        raise NotImplementedError

    def unsupported(self, module):
        """None if ``module`` can be preconditioned, else the reason it is skipped."""
        return None

    def stack(self, module):
        """None for one layer; E for a stack of E independent layers of one shape (fused MoE
        experts, :mod:`.experts`): statistics, factors and counters then carry a leading
        expert dimension, and every matrix of the stack is its own layer."""
        return None

    def shape(self, module):
        """(d_out, d_in) of the weight matrix, without the bias column."""
        raise NotImplementedError

    def input_rows(self, module, x):
        """The rows a_i, ``(*lead, d_in)``, from the module's first input ``x``."""
        raise NotImplementedError

    def grad_rows(self, module, g):
        """The rows g_i, ``(*lead, d_out)``, from the gradient of the module's output."""
        raise NotImplementedError

    def rows_per_sample(self, lead):
        """How many rows make one sample, given the rows' leading shape ``lead``."""
        return 1

    def row_tags(self, module, tag, lead):
        """Which token positions the rows' leading dimensions index, from ``tag``, the row
        tracker's tag of the module's first input (:mod:`.capture.row_provenance`; None: untagged).
        The default says it cannot tell (the rows then use no mask and are reported);
        a type whose rows keep its input's leading dimensions returns ``tag[:-1]``."""
        if tag is None:
            return None
        reason = f"the {self.name} layer type does not map its rows to its input (row_tags)"
        return tuple((("x", reason, n),) for n in lead)

    def rows_lead(self, module, x, output):
        """The rows' leading shape, without forming the rows."""
        return tuple(self.input_rows(module, x).shape[:-1])

    def as_matrix(self, module, weight_like):
        """A tensor shaped like ``module.weight`` as the (d_out, d_in) matrix, a *view* of it
        (writing into the view writes the tensor). The gradient's layout: under FSDP2 the
        preconditioner reads and writes the gathered whole gradient through it."""
        raise NotImplementedError

    def grad_matrix(self, module):
        """``weight.grad`` as a (d_out, d_in) matrix, a view of it where the layout allows."""
        return self.as_matrix(module, module.weight.grad)

    def set_grad_matrix(self, module, delta):
        """Write the (d_out, d_in) matrix ``delta`` into ``weight.grad``."""
        self.grad_matrix(module).copy_(delta)


#: nn.Linear subclasses of other libraries whose own ``forward`` computes x W^T + b on the
#: rows the module receives, by "module.qualname" (no import needed); each has a test against
#: ``F.linear`` (``theory_tests/kronecker/test_linear_subclasses.py``).
_KNOWN_LINEAR_PRODUCTS = frozenset({
    # ``input @ self.weight.T`` then ``+ self.bias``: F.linear unfused (one more bf16 rounding)
    "transformers.models.falcon.modeling_falcon.FalconLinear",
})


def _qualified(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


def forward_owner(cls):
    """The class of ``cls``'s MRO whose ``forward`` instances of ``cls`` run."""
    return next(c for c in cls.__mro__ if "forward" in vars(c))


class LinearType(LayerType):
    """``nn.Linear`` and its subclasses that keep its product: y = x W^T + b, W (d_out, d_in),
    any leading dims (K3). ``LinearType(*classes)`` declares the ``forward`` of each class (an
    ``nn.Linear`` subclass) to compute that product and matches those classes only; register it
    with :func:`register_layer_type` to precondition them (module docstring)."""

    name = "linear"

    def __init__(self, *classes):
        for cls in classes:
            if not (isinstance(cls, type) and issubclass(cls, nn.Linear)):
                raise TypeError(f"LinearType: {cls!r} is not an nn.Linear subclass")
        self.classes = classes

    def matches(self, module):
        return isinstance(module, self.classes or nn.Linear)

    def unsupported(self, module):
        owner = forward_owner(type(module))
        if owner is nn.Linear or owner in self.classes or \
                _qualified(owner) in _KNOWN_LINEAR_PRODUCTS:
            return None
        return (f"nn.Linear subclass {type(module).__name__} overrides forward "
                f"({_qualified(owner)}.forward): its product is not known to be x W^T + b; "
                f"the backbone steps it (register_layer_type(LinearType({owner.__name__})) "
                "declares that it is)")

    def shape(self, module):
        return tuple(module.weight.shape)

    def input_rows(self, module, x):
        return x if x.dim() > 1 else x.unsqueeze(0)  # an unbatched sample: a batch of one

    def grad_rows(self, module, g):
        return g if g.dim() > 1 else g.unsqueeze(0)

    def row_tags(self, module, tag, lead):
        return None if tag is None or len(tag) < 2 else tag[:-1]

    def rows_lead(self, module, x, output):
        return tuple(x.shape[:-1]) if x.dim() > 1 else (1,)

    def as_matrix(self, module, weight_like):
        return weight_like


class Conv2dType(LayerType):
    """``nn.Conv2d`` with groups=1: rows are the unfolded patches (K4), (B, L, C_in kh kw),
    in the layout of the weight reshaped to (C_out, C_in kh kw); one sample is L rows."""

    name = "conv2d"

    def matches(self, module):
        return isinstance(module, nn.Conv2d)

    def unsupported(self, module):
        if module.groups != 1:
            kind = "depthwise" if module.groups == module.in_channels else "grouped"
            return (f"{kind} convolution (groups={module.groups}): one Kronecker factor pair "
                    "per group is not implemented")
        return None

    def shape(self, module):
        return module.weight.shape[0], math.prod(module.weight.shape[1:])

    def input_rows(self, module, x):
        if x.dim() == 3:  # an unbatched (C, H, W) sample: a batch of one
            x = x.unsqueeze(0)
        x, padding = conv_input(module, x)
        patches = F.unfold(x, module.kernel_size, dilation=module.dilation, padding=padding,
                           stride=module.stride)
        return patches.transpose(1, 2)

    def grad_rows(self, module, g):
        if g.dim() == 3:
            g = g.unsqueeze(0)
        return g.flatten(2).transpose(1, 2)

    def rows_per_sample(self, lead):
        return lead[-1]

    def row_tags(self, module, tag, lead):
        """(sample, position) rows: the batch's tag; a token axis among the spatial
        dimensions cannot be followed through the patches (the rows mix positions)."""
        if tag is None or len(tag) != 4:
            return None if tag is None else LayerType.row_tags(self, module, tag, lead)
        if any(e is not None for e in tag[1:]):
            return (tag[0], (("x", "a convolution's patches across token positions",
                              lead[1]),))
        return (tag[0], None)

    def rows_lead(self, module, x, output):
        if output.dim() == 3:
            return (1, output.shape[1] * output.shape[2])
        return (output.shape[0], output.shape[2] * output.shape[3])

    def as_matrix(self, module, weight_like):
        return weight_like.view(weight_like.shape[0], -1)

    def grad_matrix(self, module):
        return module.weight.grad.reshape(module.weight.shape[0], -1)

    def set_grad_matrix(self, module, delta):
        module.weight.grad.copy_(delta.reshape(module.weight.shape))


class HFConv1DType(LayerType):
    """transformers' ``Conv1D`` (GPT-2's attention and MLP): W stored (d_in, d_out),
    y = x W + b. The matrix view of its gradient is the transpose ``weight.grad.T``."""

    name = "hf_conv1d"

    def matches(self, module):
        pytorch_utils = sys.modules.get("transformers.pytorch_utils")
        conv1d = getattr(pytorch_utils, "Conv1D", None)
        return conv1d is not None and isinstance(module, conv1d)

    def shape(self, module):
        d_in, d_out = module.weight.shape
        return d_out, d_in

    def input_rows(self, module, x):
        return x if x.dim() > 1 else x.unsqueeze(0)

    def grad_rows(self, module, g):
        return g if g.dim() > 1 else g.unsqueeze(0)

    def row_tags(self, module, tag, lead):
        return None if tag is None or len(tag) < 2 else tag[:-1]

    def rows_lead(self, module, x, output):
        return tuple(x.shape[:-1]) if x.dim() > 1 else (1,)

    def as_matrix(self, module, weight_like):
        return weight_like.T


def conv_input(module, x):
    """(x, padding) as the convolution sees them: string paddings ('same', 'valid')
    and non-zero padding modes are applied explicitly, like ``Conv2d._conv_forward``."""
    if isinstance(module.padding, str) or module.padding_mode != "zeros":
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        return F.pad(x, module._reversed_padding_repeated_twice, mode=mode), 0
    return x, module.padding


_REGISTRY = [LinearType(), Conv2dType(), HFConv1DType()]


def register_layer_type(layer_type, *, first=True):
    """Add a :class:`LayerType` instance. ``first=True`` (default) lets it take precedence
    over the built-in types (e.g. a special subclass of ``nn.Linear``)."""
    if not isinstance(layer_type, LayerType):
        raise TypeError(f"layer_type must be a LayerType instance, got {type(layer_type)!r}")
    if first:
        _REGISTRY.insert(0, layer_type)
    else:
        _REGISTRY.append(layer_type)
    return layer_type


def unregister_layer_type(layer_type):
    """Remove a type added by :func:`register_layer_type`."""
    _REGISTRY.remove(layer_type)


def layer_types():
    """The registered types, in matching order."""
    return list(_REGISTRY)


def layer_type_for(module):
    """The first registered type that matches ``module``, or None."""
    for layer_type in _REGISTRY:
        if layer_type.matches(module):
            return layer_type
    return None
