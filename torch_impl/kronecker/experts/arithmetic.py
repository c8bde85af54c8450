r"""The dtypes a fused experts forward really computed in, read from the forward itself.

The rows of a fused experts projection are recomputed in the gradient hook of the call's
output (:mod:`.transformers`), so the recompute has to do the forward's arithmetic: the rows
are the ones the forward's product multiplied only if they are rounded as that product's
operands were, and the output-gradient rows are the gradient autograd formed the weight's
gradient from only if they pass through the roundings the forward's casts put on its
backward. Those dtypes are a property of the experts *implementation*, not of the model's
dtype or the autocast state alone (transformers 5.25, measured):

* ``grouped_mm`` (the default) casts the rows to the weight's dtype and calls
  ``torch.nn.functional.grouped_mm``, which autocast does not touch: a float32 model under
  bf16 autocast multiplies **float32** rows, while ``eager`` and ``batched_mm`` (``F.linear``,
  ``bmm``) multiply bf16 ones;
* the OpenAI privacy filter's own forward casts rows, weights and biases to float32 and
  accumulates in float32: a float64 model multiplies **float32** rows;
* Inkling2's own forward sums the routed outputs in a **float32** accumulator whatever the
  model's dtype, so the output gradient reaches every pair rounded to float32;
* ``batched_mm`` adds the bias in place (the sum rounded to the product's dtype), the eager
  forwards out of place (the sum in the promoted dtype).

So nothing here is a table: :func:`observe` runs the module's own forward once more on the
call's first token (its k routed pairs), without grad, under the call's autocast state, and
watches the ATen operations it dispatches (a ``TorchDispatchMode``, below autocast: the
dtypes the kernels really ran in). Each expert weight and bias is followed through the
operations that only reshape, index or cast it; the first operation that combines a
weight with other floating data is that projection's **product** (its result dtype is the
dtype its operands were multiplied in); the operation that then combines the product with
the projection's bias is its **bias add** (the bias operand's dtype and the sum's). The
forward's returned tensor, when it was cast from another dtype, was summed in that one
(the **accumulator**). One projection multiplied in two dtypes, an operation combining both
projections' weights, or a projection whose product or bias add was not seen is an error
naming what was seen: the recompute could not be the forward's.
"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Product", "Arithmetic", "observe"]


class Product:
    """How the forward formed one projection's output h = rows @ W (+ b): ``dtype``, the
    dtype of the product (its operands and result); ``bias`` (None without a bias), the
    dtype the bias entered its add in; ``out``, the dtype of h; ``fused``, whether the bias
    was added by the product's own operation (``addmm``); ``per_expert``, whether the
    product multiplied one expert's matrix (an eager loop) rather than a stack of them."""

    __slots__ = ("dtype", "bias", "out", "fused", "per_expert")

    def __init__(self, dtype, bias=None, out=None, fused=False, per_expert=False):
        self.dtype, self.bias, self.fused, self.per_expert = dtype, bias, fused, per_expert
        self.out = dtype if out is None else out

    def __eq__(self, other):
        return isinstance(other, Product) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def _key(self):
        return (self.dtype, self.bias, self.out, self.fused, self.per_expert)

    def __repr__(self):
        bias = "" if self.bias is None else f", bias {self.bias} -> {self.out}"
        return (f"Product({self.dtype}{bias}{', fused' if self.fused else ''}"
                f"{', per expert' if self.per_expert else ', stacked'})")


class Arithmetic:
    """The forward's arithmetic of one call: ``products`` ({projection name: Product}) and
    ``accumulator``, the dtype its routed outputs were summed in; ``per_expert``: its
    products multiplied one expert's matrix at a time."""

    __slots__ = ("products", "accumulator")

    def __init__(self, products, accumulator):
        self.products, self.accumulator = products, accumulator

    @property
    def per_expert(self):
        return all(p.per_expert for p in self.products.values())

    def __repr__(self):
        return f"Arithmetic({self.products}, accumulator {self.accumulator})"


def _storage(t):
    """The address of ``t``'s storage (shared by its views), or None (no storage of its own:
    an empty or non-plain tensor), so that nothing is followed by accident."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return ptr or None


def _tensors(value, out):
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors(v, out)
    return out


class _Watch(TorchDispatchMode):
    """Follows the projections' weights and biases through one forward (module docstring).
    Roles, by storage: ("w", name), ("b", name), ("p", name) (a product's result, before its
    bias). Every tensor given a role is held until the watch ends, so no storage address is
    reused while it is read."""

    def __init__(self, weights, biases):
        super().__init__()
        self.roles, self.held = {}, []
        for name, w in weights.items():
            self._set(w, ("w", name))
        for name, b in biases.items():
            if b is not None:
                self._set(b, ("b", name))
        self.products = {name: set() for name in weights}
        self.bias_adds = {name: set() for name in weights}
        self.fused_with = []   # operations that combined two projections' weights
        self.cast_from = {}    # storage of a cast's result: the dtype it was cast from

    def _set(self, t, role):
        ptr = _storage(t)
        if ptr is not None:
            self.roles[ptr] = role
            self.held.append(t)

    def _role(self, t):
        ptr = _storage(t)
        return None if ptr is None else self.roles.get(ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        floats = [t for t in _tensors((args, tuple(kwargs.values())), [])
                  if t.is_floating_point()]
        outs = [o for o in _tensors(out, []) if o.is_floating_point()]
        if not floats or not outs:
            return out
        roles = [self._role(t) for t in floats]
        weights = {r[1] for r in roles if r is not None and r[0] == "w"}
        if len(weights) > 1:
            self.fused_with.append(str(func))
        elif weights:
            (name,) = weights
            others = [r for r in roles if r != ("w", name)]
            if not others:  # the weight reshaped, indexed or cast: still the weight
                for o in outs:
                    self._set(o, ("w", name))
            else:  # the weight multiplied by other data: the product
                weight = next(t for t, r in zip(floats, roles) if r == ("w", name))
                one = weight.dim() == 2  # one expert's matrix, not a stack of them
                bias = [t for t, r in zip(floats, roles) if r == ("b", name)]
                if bias:  # addmm: the bias added by the product itself
                    self.products[name].add(Product(outs[0].dtype, bias[0].dtype,
                                                    outs[0].dtype, True, one))
                else:
                    self.products[name].add(Product(outs[0].dtype, per_expert=one))
                    for o in outs:
                        self._set(o, ("p", name))
            return out
        biases = {r[1] for r in roles if r is not None and r[0] == "b"}
        products = {r[1] for r in roles if r is not None and r[0] == "p"}
        if len(biases) == 1 and not products and all(r is not None for r in roles):
            for o in outs:  # the bias reshaped, indexed or cast
                self._set(o, roles[0])
        elif len(biases) == 1 and products == biases:  # the product plus its bias
            (name,) = biases
            b = next(t for t, r in zip(floats, roles) if r == ("b", name))
            self.bias_adds[name].add((b.dtype, outs[0].dtype))
            for o in outs:  # in place, the product's storage now holds h
                ptr = _storage(o)
                if ptr is not None:
                    self.roles.pop(ptr, None)
        if len(floats) == 1 and len(outs) == 1 and outs[0].dtype != floats[0].dtype \
                and tuple(outs[0].shape) == tuple(floats[0].shape):
            ptr = _storage(outs[0])
            if ptr is not None:
                self.cast_from[ptr] = floats[0].dtype
                self.held.append(outs[0])
        return out

    def arithmetic(self, names, has_bias, output):
        """The :class:`Arithmetic` seen, or a ValueError saying what could not be followed."""
        if self.fused_with:
            raise ValueError(f"the experts forward combined the weights of {list(names)} in "
                             f"one operation ({self.fused_with[0]}): their rows cannot be "
                             "followed")
        products = {}
        for name in names:
            seen = self.products[name]
            if len(seen) != 1:
                what = "no product" if not seen else f"products in several dtypes {seen}"
                raise ValueError(f"the experts forward's {name}: {what} seen; the rows it "
                                 "multiplied cannot be followed")
            (product,) = seen
            adds = self.bias_adds[name]
            if has_bias and not product.fused:
                if len(adds) != 1:
                    what = "no bias add" if not adds else f"bias adds in several dtypes {adds}"
                    raise ValueError(f"the experts forward's {name}: {what} seen after its "
                                     "product; its output cannot be followed")
                ((bias, out),) = adds
                product = Product(product.dtype, bias, out, per_expert=product.per_expert)
            products[name] = product
        if len({p.per_expert for p in products.values()}) > 1:
            raise ValueError(f"the experts forward multiplied {products}: one projection "
                             "expert by expert, the other as a stack")
        ptr = _storage(output)
        accumulator = self.cast_from.get(ptr, output.dtype) if ptr is not None else output.dtype
        return Arithmetic(products, accumulator)


def observe(module, args, kwargs, projections):
    """The :class:`Arithmetic` of ``module``'s forward on these inputs (module docstring).

    ``args``, ``kwargs``: the class's forward's arguments, already cut to the pairs of one
    token; ``projections``: [(name, ExpertProjection)]. Run without grad, with the module's
    hooks bypassed (the class's own forward), under the caller's autocast state."""
    weights = {name: p.weight for name, p in projections}
    biases = {name: p.bias for name, p in projections}
    watch = _Watch(weights, biases)
    with torch.no_grad(), watch:
        output = type(module).forward(module, *args, **kwargs)
    if not isinstance(output, torch.Tensor):
        raise ValueError(f"the experts forward returned {type(output).__name__}, not a tensor")
    has_bias = any(b is not None for b in biases.values())
    return watch.arithmetic([name for name, _ in projections], has_bias, output)
