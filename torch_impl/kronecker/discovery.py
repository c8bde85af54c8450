r"""Which modules of a model get preconditioned, and why the others do not (spec MKOR.md K1).

:func:`discover` walks ``model.named_modules()`` and gives every module that owns
parameters one of two fates:

* **preconditioned**: its class has a registered :class:`~.layers.LayerType` (``nn.Linear``
  and the subclasses that keep its forward, ``nn.Conv2d`` with groups=1, transformers'
  ``Conv1D``), its weight is trainable, real, held by the optimizer and owned by this module
  alone;
* **skipped**, with the reason: an embedding, a normalisation layer, a grouped or
  depthwise convolution, an unregistered type, an ``nn.Linear`` subclass whose forward is
  not known to be x W^T + b (:class:`~.layers.LinearType`), a frozen weight, a
  ``skip_modules`` pattern, a weight the optimizer does not hold, or a *tied* weight.

**skip_modules** are glob patterns (``fnmatch``) of the names ``model.named_modules()`` gives
(a DDP wrapper's ``module.`` stripped). A fused experts module's own name skips all its
projections; a projection's name (``...experts.gate_up_proj``, its parameter's) skips it
alone. A pattern that matches no module with parameters of its own and no projection is an
error naming it (with the near names), raised before anything is hooked: a typo must not
leave every layer preconditioned in silence.

**Tied weights** (e.g. GPT-2's and BERT's output head sharing the input embedding's
matrix) follow one rule: a weight owned by more than one module is never preconditioned.
Its gradient is the sum of every use (the embedding's row lookups and the head's
matrix product), while a layer's Kronecker factors model one product only; the
preconditioned direction would be wrong for the shared part. The whole parameter goes to
the backbone unchanged.

**Size guard.** A factor side above ``max_factor_dim`` (a vocabulary-sized output, say) is
not built: that side is preconditioned by the identity, so the layer keeps the other
side's factor (one-sided preconditioning, O(d^2) in the small side only). A layer with
both sides above the limit is skipped. An identity side is exactly what the factor would
be if it were never updated, so the rest of the algorithm is unchanged.

A frozen bias (``requires_grad=False``) is treated as a constant: the layer counts as
bias-free, so R has no bias column and the rescale (K14) compares the trainable parts only.
"""
import difflib
import fnmatch
import warnings

import torch
import torch.nn as nn

from .experts import EXPERTS, experts_layout
from .layers import layer_type_for

__all__ = ["Layer", "Discovery", "discover", "unwrap_model", "DEFAULT_MAX_FACTOR_DIM",
           "warn_identity_sides", "warn_nothing_preconditioned"]

#: Factor sides above this are preconditioned by the identity. 8192^2 float32 is 256 MiB per
#: factor (K-FAC keeps a factor and its eigenvectors); a 50,257-token GPT-2 head would need
#: 9.4 GiB for its output factor alone.
DEFAULT_MAX_FACTOR_DIM = 8192


class Layer:
    """A preconditioned module: its name, :class:`~.layers.LayerType`, and factor sizes.

    ``kind`` is the type's name, or ``"mha_out"`` for the out-projection of an
    ``nn.MultiheadAttention`` (captured through its ``parent``). ``identity_L`` /
    ``identity_R`` mark factor sides left at the identity by the size guard.
    """

    def __init__(self, name, module, layer_type, parent=None):
        self.name = name
        self.module = module
        self.type = layer_type
        self.parent = parent
        self.kind = "mha_out" if parent is not None else layer_type.name
        self.experts = layer_type.stack(module)  # None, or E for a stack of expert layers
        # expert parallelism: the stack's statistics are the E experts of this rank's chunk,
        # its factors those of the ``kept`` experts it holds (experts/parallel.py)
        self.expert_shard = getattr(module, "expert_shard", None) if self.experts else None
        self.kept = self.experts if self.expert_shard is None else self.expert_shard.n_held
        self.has_bias = module.bias is not None and module.bias.requires_grad
        self.d_out, d_in = layer_type.shape(module)
        self.d_in = d_in + int(self.has_bias)  # d_in' = columns of [W | b]
        self.identity_L = self.identity_R = False

    def __repr__(self):
        sides = "".join(f", {s}=I" for s, flag in (("L", self.identity_L),
                                                   ("R", self.identity_R)) if flag)
        stack = "" if self.experts is None else f", experts={self.experts}"
        return (f"Layer({self.name!r}, {self.kind}{stack}, d_out={self.d_out}, "
                f"d_in'={self.d_in}{sides})")


class Discovery:
    """What :func:`discover` found: ``layers`` (a list of :class:`Layer`), ``skipped``
    ({module name: reason}) and ``identity`` ({layer name: sides at the identity})."""

    def __init__(self, layers, skipped, identity, frozen=None):
        self.layers, self.skipped, self.identity = layers, skipped, identity
        self.frozen = frozen if frozen is not None else {}  # {name: module} frozen at the start


def unwrap_model(model):
    """Strip DistributedDataParallel / DataParallel wrappers (their ``module.`` prefix)."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model


_UNREGISTERED = "is not a registered layer type (see torch_impl.kronecker.register_layer_type)"
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)


def _unsupported_type_reason(module):
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return "embedding: a row lookup, not a matrix product of its input"
    if isinstance(module, _NORMS) or type(module).__name__.endswith(("Norm", "RMSNorm")):
        return "normalisation layer: elementwise gain and bias, no Kronecker structure"
    if isinstance(module, nn.MultiheadAttention):
        return ("nn.MultiheadAttention's packed q/k/v in-projection is not a Linear module "
                "(its out_proj is handled on its own)")
    return f"{type(module).__name__} {_UNREGISTERED}"


def _owners(model):
    """{id(parameter): [names of the modules that own it]} (tied weights have several)."""
    owners = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module._parameters.values():
            if param is not None:
                names = owners.setdefault(id(param), [])
                if name not in names:
                    names.append(name)
    return owners


_ROUTER_REASON = (
    "an MoE router beside fused experts ({experts}): its weight enters through a product "
    "inside the module whose output is the softmax / top-k of the logits, so the output "
    "gradient of the product is not observable at the module's boundary; the backbone "
    "steps it")


def _routers(model):
    """{name: reason} for the routers of fused experts: the siblings of a fused experts
    module that hold parameters and are of no registered or otherwise known type (not a
    norm, not an embedding); they keep the generic skip, with the reason made specific."""
    out = {}
    for parent_name, parent in model.named_modules():
        children = dict(parent.named_children())
        experts = [n for n, c in children.items() if experts_layout(c) is not None]
        for n, child in children.items():
            if experts and n not in experts and layer_type_for(child) is None and any(
                    True for _ in child.parameters(recurse=False)) and \
                    _unsupported_type_reason(child).endswith(_UNREGISTERED):
                full = f"{parent_name}.{n}" if parent_name else n
                out[full] = _ROUTER_REASON.format(experts=", ".join(
                    f"{parent_name}.{e}" if parent_name else e for e in experts))
    return out


def _skip_patterns(skip):
    """``skip_modules`` as a tuple of patterns: one string is one pattern (never its letters)."""
    skip = (skip,) if isinstance(skip, str) else tuple(skip)
    bad = [p for p in skip if not isinstance(p, str)]
    if bad:
        raise ValueError(f"skip_modules: expected glob patterns of module names (strings), "
                         f"got {bad!r}")
    return skip


def _unmatched_patterns(unmatched, names, model):
    """The ValueError naming the skip patterns that match nothing, each with a hint."""
    bare = [n for n, m in model.named_modules()
            if not any(True for _ in m.parameters(recurse=False))]
    told = []
    for pattern in unmatched:
        holders = [n for n in bare if fnmatch.fnmatchcase(n, pattern)]
        near = difflib.get_close_matches(pattern, names, n=3)
        if holders:
            hint = (f" (it names {holders[0]!r}, which holds no parameters itself; "
                    f"{pattern + '.*'!r} names what is inside it)")
        elif near:
            hint = f" (near names: {', '.join(map(repr, near))})"
        else:
            hint = ""
        told.append(f"{pattern!r}{hint}")
    return ValueError(
        f"skip_modules: {'; '.join(told)} match{'es' if len(told) == 1 else ''} no module with parameters and no fused "
        "experts projection of this model; patterns are fnmatch globs of the names "
        "model.named_modules() gives (without a DDP 'module.' prefix)")


def discover(model, skip=(), optimizer=None, max_factor_dim=DEFAULT_MAX_FACTOR_DIM):
    """Find the preconditioned layers of ``model`` (module docstring for the rules).

    Args:
        model: any ``nn.Module`` (DDP / DataParallel wrappers are unwrapped).
        skip: glob patterns of module names to leave to the backbone (the released code's
            ``sgd_layers``); a fused experts module's name skips all its projections.
        optimizer: if given, layers whose weight it does not hold are skipped.
        max_factor_dim: factor sides above it are left at the identity (None: no limit).

    Raises:
        ValueError: a layer of a registered type has complex parameters; a ``skip`` pattern
            matches nothing (module docstring).
    """
    model = unwrap_model(model)
    skip = _skip_patterns(skip)
    names = []  # what a skip pattern may name: modules with parameters, experts projections
    held = None
    if optimizer is not None:
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    owners = _owners(model)
    mha_parent = {id(m.out_proj): m for m in model.modules()
                  if isinstance(m, nn.MultiheadAttention)}
    layers, skipped, identity, frozen = [], {}, {}, {}

    def judge(name, module, layer_type, reason=None, within=None):
        """Add ``module`` as a layer of ``layer_type`` or record why it is skipped
        (``within``: the name of the fused experts module holding the projection)."""
        pattern = next((p for p in skip if fnmatch.fnmatchcase(name, p)
                        or within is not None and fnmatch.fnmatchcase(within, p)), None)
        if reason is None and pattern is not None:
            reason = f"skipped by the skip_modules pattern {pattern!r}"
        elif reason is None and layer_type is None:
            reason = _unsupported_type_reason(module)
        elif reason is None:
            reason = layer_type.unsupported(module)
        weight = getattr(module, "weight", None) if reason is None else None
        if reason is None and (weight is None or not isinstance(weight, torch.Tensor)):
            reason = "no weight parameter"
        if reason is None and layer_type is not None and 0 in layer_type.shape(module):
            reason = (f"zero-width layer (d_out, d_in) = {tuple(layer_type.shape(module))}: "
                      "no rows to factor")
        if reason is None and weight.is_complex():
            raise ValueError(
                f"MKOR/K-FAC: layer {name!r} ({type(module).__name__}) has complex parameters; "
                "Kronecker-factored preconditioning of complex layers is not implemented "
                f"(it would drop the imaginary part). Pass skip_modules=[{name!r}] to leave "
                "it to the backbone optimizer.")
        if reason is None and not weight.requires_grad:
            reason = "frozen weight (requires_grad=False)"
            frozen[name] = module
        if reason is None and len(owners.get(id(weight), ())) > 1:
            others = [n for n in owners[id(weight)] if n != name]
            reason = (f"weight tied to {', '.join(others)}: its gradient sums every use, "
                      "which this layer's factors do not model")
        if reason is None and held is not None and id(weight) not in held:
            reason = "weight not in the optimizer's param_groups"
        if reason is None:
            layer = Layer(name, module, layer_type, mha_parent.get(id(module)))
            if max_factor_dim is not None:
                layer.identity_L = layer.d_out > max_factor_dim
                layer.identity_R = layer.d_in > max_factor_dim
            if layer.identity_L and layer.identity_R:
                reason = (f"both factor sides (d_out={layer.d_out}, d_in'={layer.d_in}) "
                          f"exceed max_factor_dim={max_factor_dim}")
            else:
                layers.append(layer)
                if layer.identity_L or layer.identity_R:
                    identity[name] = ("L" if layer.identity_L else "R")
        if reason is not None:
            skipped[name] = reason

    routers = _routers(model)
    for name, module in model.named_modules():
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        names.append(name)
        if name in routers:
            judge(name, module, None, routers[name])
            continue
        layout = experts_layout(module)
        if layout is not None:  # a stack of E linear layers per projection
            parent = model.get_submodule(name.rpartition(".")[0]) if name else None
            problem = layout.problem(module, parent)
            prefix = f"{name}." if name else ""
            names.extend(prefix + p for p, _ in module.named_parameters(recurse=False))
            projections = layout.projections(module, parent) if problem is None else []
            for pname, projection in projections:
                owners.setdefault(id(projection.weight), [])
                owners[id(projection.weight)] = [
                    prefix + pname if n == name else n for n in owners[id(projection.weight)]]
                judge(prefix + pname, projection, EXPERTS, within=name)
            if problem is not None:
                skipped[name] = problem
            continue
        judge(name, module, layer_type_for(module))
    unmatched = [p for p in skip if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unmatched:
        raise _unmatched_patterns(unmatched, names, model)
    return Discovery(layers, skipped, identity, frozen)


def warn_identity_sides(name, layers, itemsize_per_side):
    """One warning naming the layers whose factor sides the size guard left at I."""
    sides = [(layer.name, side, d) for layer in layers
             for side, d, flag in (("L", layer.d_out, layer.identity_L),
                                   ("R", layer.d_in, layer.identity_R)) if flag]
    if not sides:
        return
    saved = sum(d * d for _, _, d in sides) * itemsize_per_side
    listed = ", ".join(f"{n} ({s}: {d} x {d})" for n, s, d in sides)
    warnings.warn(f"{name}: factor sides above max_factor_dim are preconditioned by the "
                  f"identity (not built): {listed}; {saved / 2**30:.2f} GiB of factors saved",
                  UserWarning, stacklevel=4)


def warn_nothing_preconditioned(name, skipped):
    reasons = "; ".join(f"{n or '<model>'}: {r}" for n, r in skipped.items()) or "no parameters"
    warnings.warn(f"{name}: nothing is preconditioned, every parameter goes to the backbone "
                  f"unchanged (skipped: {reasons})", UserWarning, stacklevel=4)
