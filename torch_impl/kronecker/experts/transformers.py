r"""Fused mixture-of-experts modules as stacks of linear layers (issue 31; oracle:
``reference/common/moe.py``).

transformers 5 stores a model's experts as 3-D parameters of one module, decorated with
``transformers.integrations.moe.use_experts_implementation``, which also declares the
layout: ``has_gate`` (a ``gate_up_proj`` [gate; up] or a plain ``up_proj``),
``is_concatenated`` (how gate and up interleave: the module's own ``_apply_gate`` reads it),
``is_transposed`` (experts stored (E, d_in, d_out) instead of (E, d_out, d_in)), ``has_bias``
and ``has_post_expert_norm``. Per routed (token t, slot j) pair, expert e = top_k_index[t, j],
weight w = top_k_weights[t, j]:

.. math::
    h = W^{up}_e x_t (+ b^{up}_e),\quad a_2 = \mathrm{gate}(h),\quad
    y = W^{down}_e a_2 (+ b^{down}_e),\quad \mathrm{out}_t \mathrel{+}= w\, \mathrm{norm}(y).

Each projection is one :class:`~.discovery.Layer` holding E independent linear layers
(``layer.experts = E``; ``d_out``, ``d_in`` are one expert's): expert e's rows are those of the
pairs routed to it, exactly the rows an ``nn.Linear`` expert would see in the loop over the
experts that got tokens, so

* up projection: a = x_t, g = dL/dh (the gate's VJP of the down projection's input gradient);
* down projection: a = a_2, g = dL/dy = w dL/dout_t (through the post-norm's VJP if any):
  the routing weight enters the output gradient there;
* an expert routed no pair has 0 rows ("no rows", not a skip); a padding mask follows each
  pair's token (``token``).

The rows are not observable at the module's boundary (h and a_2 live inside its forward,
whichever experts implementation runs it), so on a capture step they are recomputed from the
module's inputs and the gradient of its output, in the gradient hook: one more pass through
the routed experts, with the module's own ``_apply_gate``, activation and norm, so every
layout the decorator declares is handled, and with the arithmetic the forward really ran
(its products' dtypes, bias adds, structure and accumulator), read in the forward hook from
the forward itself (:mod:`.arithmetic`; the recompute: :mod:`.recompute`).

**Expert parallelism**: transformers' own (``DistributedConfig(ep_size=...)``, all-to-all
dispatch; :mod:`.transformers_ep`) makes each projection a stack of this rank's EP chunk
(:mod:`.parallel`, the rule torchtitan's EP follows): the capture hooks the dispatch's call of
the class forward on the rows it delivered (local expert ids, checked against the chunk at
every capture, with the FSDP-unsharded weights' offset), the recompute multiplies the local
experts, and the factors are those of the experts the rank holds. Refused with the layout
named: other EP implementations (``AllReduceEP``'s sentinel ids, Mega MoE), EP parameters
without transformers' dispatch; a forward that does not take (hidden_states, top_k_index,
top_k_weights). :class:`TransformersExperts` is this layout's adapter
(:mod:`.layout`; torchtitan's ``GroupedExperts`` is :mod:`.torchtitan`).
"""
import inspect

import torch

from .arithmetic import Arithmetic, Product, observe
from .layout import ExpertProjection, ExpertsLayout, product_dtype
from .parallel import check_forward_chunk, ep_problem, expert_shard
from .recompute import ByExpert, Linear, eager_order, group_rows, in_pair_order
from .transformers_ep import DispatchedCall, dispatch_of

__all__ = ["TransformersExperts", "TRANSFORMERS", "is_fused_experts", "expert_projections",
           "expert_rows", "bind_expert_inputs", "observe_arithmetic"]

#: what ``use_experts_implementation`` sets on every instance of a decorated class
_LAYOUT = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm")
#: the forward's three inputs, under the names transformers' experts classes give them (GPT-OSS
#: calls the routing inputs router_indices / routing_weights)
_INPUTS = (("hidden_states",), ("top_k_index", "router_indices"),
           ("top_k_weights", "routing_weights"))


def _input_names(module):
    """The names of (hidden_states, top_k_index, top_k_weights) in the class's forward, or
    None when one of them is not there."""
    params = inspect.signature(type(module).forward).parameters
    names = [next((n for n in aliases if n in params), None) for aliases in _INPUTS]
    return None if None in names else names


def is_fused_experts(module):
    """Whether ``module`` is an instance of a class decorated by transformers'
    ``use_experts_implementation``: the decorator's layout attributes are there and the class's
    forward is the decorator's wrapper of its own (``__wrapped__``)."""
    forward = getattr(type(module), "forward", None)
    return (all(hasattr(module, a) for a in _LAYOUT) and hasattr(module, "num_experts")
            and getattr(forward, "__wrapped__", None) is not None)


def expert_projections(module, shard=None):
    """[(parameter name, ExpertProjection)] of a fused experts module: the up (or gate-up)
    projection, then the down projection (``shard``: their :class:`~.parallel.ExpertShard`
    under expert parallelism)."""
    up = "gate_up_proj" if module.has_gate else "up_proj"
    return [(n, ExpertProjection(module, n, TRANSFORMERS, n + "_bias" if module.has_bias else None,
                                 module.is_transposed, shard=shard)) for n in (up, "down_proj")]


def _local(tensor):
    """A DTensor's local tensor (what transformers' EP forward multiplies), a tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _local_projections(module):
    """:func:`expert_projections` multiplying this rank's experts: each parameter's local
    tensor (the FSDP-unsharded chunk the dispatch's forward ran on)."""
    projections = expert_projections(module)
    for _, p in projections:
        p.weight = _local(p.weight)
        p.bias = None if p.bias is None else _local(p.bias)
    return projections


def layout_problem(module):
    """None if the module's declared layout is one the capture can follow, else why not."""
    names = [n for n, _ in expert_projections(module)]
    missing = [n for n in names if not isinstance(getattr(module, n, None), torch.nn.Parameter)]
    if missing:
        return f"fused experts without the parameters {missing} its layout declares"
    if _input_names(module) is None:
        params = inspect.signature(type(module).forward).parameters
        return (f"fused experts whose forward takes {list(params)[1:]}, not (hidden_states, "
                "top_k_index, top_k_weights): the routed rows cannot be followed")
    dispatch, why = dispatch_of(module)
    if why is not None:
        return f"fused experts under {why}"
    # under EP, num_experts is this rank's count; the parameters hold all E (DTensors)
    E = module.num_experts if dispatch is None else dispatch.experts
    for n in names:
        w = getattr(module, n)
        if w.dim() != 3 or w.shape[0] != E:
            return (f"fused experts parameter {n} of shape {tuple(w.shape)}: expected "
                    f"(num_experts={E}, ., .)")
        b = getattr(module, n + "_bias", None) if module.has_bias else None
        d_out = w.shape[2] if module.is_transposed else w.shape[1]
        if module.has_bias and (b is None or tuple(b.shape) != (E, d_out)):
            return f"fused experts declare has_bias but {n}_bias is not an (E, {d_out}) tensor"
    if dispatch is not None:
        why = ep_problem(E, _stacks(module), dispatch.ep_mesh)
        if why is not None:
            return f"fused experts under transformers' expert parallelism not laid out as EP: {why}"
    return None


def _stacks(module):
    """{name: parameter} of the module's expert stacks (weights and biases)."""
    names = [n for n, _ in expert_projections(module)]
    if module.has_bias:
        names += [n + "_bias" for n in names]
    return {n: getattr(module, n) for n in names}


def bind_expert_inputs(module, args, kwargs):
    """(hidden_states, top_k_index, top_k_weights) of one call, bound by name to the class's
    own forward signature (never by position alone)."""
    bound = inspect.signature(type(module).forward).bind(module, *args, **kwargs)
    return tuple(bound.arguments[n] for n in _input_names(module))


def observe_arithmetic(module, hidden, top_k_index, top_k_weights):
    """The dtypes this call's forward computed in (:func:`~.arithmetic.observe`), read from
    the module's own forward on the call's first token, or None for a call with no tokens
    (it has no rows)."""
    if hidden.shape[0] == 0:
        return None
    names = _input_names(module)
    probe = (hidden[:1], top_k_index[:1], top_k_weights[:1])
    first = list(inspect.signature(type(module).forward).parameters)[1:4]
    # positionally where the forward takes them first (the experts implementations
    # transformers dispatches to name them their own way), else by the class's names
    args, kwargs = (probe, {}) if first == names else ((), dict(zip(names, probe)))
    return observe(module, args, kwargs, expert_projections(module))


def _nothing_multiplied(module, hidden):
    """The arithmetic of a call with no tokens, which multiplies nothing (its rows are
    empty, whatever their dtypes): the promoted ones."""
    products = {}
    for name, p in expert_projections(module):
        dtype = product_dtype(hidden, p.weight)
        bias = None if p.bias is None else torch.promote_types(dtype, p.bias.dtype)
        products[name] = Product(dtype, bias, bias)
    return Arithmetic(products, hidden.dtype)


def _no_rows(projection, product, device):
    """(a, g) of a projection for no pairs: (0, d_in) and (0, d_out), in the product's dtype."""
    _, rows, cols = projection.weight.shape
    d_out, d_in = (cols, rows) if projection.transposed else (rows, cols)
    return (torch.zeros(0, d_in, dtype=product.dtype, device=device),
            torch.zeros(0, d_out, dtype=product.dtype, device=device))


def expert_rows(module, hidden, top_k_index, top_k_weights, grad_out, arithmetic=None,
                shard=None):
    """Every routed pair's rows of both projections, recomputed from the call's inputs and
    the gradient of its output with the forward's ``arithmetic``
    (:func:`observe_arithmetic`; :mod:`.recompute`; module docstring). Returns
    ``(token, expert, rows)``: ``token``, ``expert`` (S,) per pair in (token, slot) order,
    and ``rows`` a list of ``(a, g)`` per projection (up, down), each (S, d): a the rows the
    projection's product multiplied, g the gradient of that product's result. No graph is
    kept. The caller runs it under the forward's autocast state. Under expert parallelism
    (``shard``) the call is the dispatch's, its expert ids local to this rank's EP chunk."""
    T, k = top_k_index.shape
    expert = top_k_index.reshape(-1)
    if shard is None and getattr(module, "_is_expert_parallel", False):
        raise ValueError("fused experts under expert parallelism without transformers' "
                         "dispatch (sentinel expert ids): the rows of the experts this rank "
                         "does not hold are not here")
    if shard is not None:  # the chunk's ids and weights (a sentinel id makes E/ep + 1 counts)
        check_forward_chunk(shard, getattr(module, expert_projections(module)[0][0]),
                            torch.bincount(expert, minlength=shard.n_seen))
    token = torch.arange(T, device=expert.device).repeat_interleave(k)
    (up_name, up), (down_name, down) = (expert_projections(module) if shard is None
                                        else _local_projections(module))
    if arithmetic is None:  # read now (the caller runs under the forward's autocast)
        arithmetic = observe_arithmetic(module, hidden, top_k_index, top_k_weights)
    if arithmetic is None:
        arithmetic = _nothing_multiplied(module, hidden)
    names = (up_name, down_name)
    if expert.numel() == 0:  # no pairs (AllToAllEP's placeholder call: none dispatched here)
        return token, expert, [_no_rows(p, arithmetic.products[n], hidden.device)
                               for n, p in ((up_name, up), (down_name, down))]
    x = hidden.detach()[token]
    weights = top_k_weights.detach().reshape(-1, 1)
    g_out = grad_out.detach()[token]
    counts = torch.bincount(expert, minlength=module.num_experts).tolist()  # one host sync
    if not arithmetic.per_expert:  # a stack multiplied at once: all pairs together
        order = torch.argsort(expert, stable=True)
        rows = group_rows(module, arithmetic, names, x, weights, g_out,
                          ByExpert(up, arithmetic.products[up_name], order, counts),
                          ByExpert(down, arithmetic.products[down_name], order, counts))
        return token, expert, rows
    # one expert's matrix at a time: each expert's pairs alone, in the eager loop's order
    slot = torch.arange(k, device=expert.device).repeat(T)
    order = eager_order(expert, slot, token, T * k)
    groups, start = [], 0
    for e, n in enumerate(counts):
        if n:
            pick = order[start:start + n]
            groups.append((pick, group_rows(
                module, arithmetic, names, x[pick], weights[pick], g_out[pick],
                Linear(up, arithmetic.products[up_name], e),
                Linear(down, arithmetic.products[down_name], e))))
        start += n
    return token, expert, in_pair_order(groups, T * k)


class TransformersExperts(ExpertsLayout):
    """The adapter (:class:`~.layout.ExpertsLayout`) of transformers 5's fused
    experts: the functions above."""

    name = "transformers fused experts"

    def matches(self, module):
        return is_fused_experts(module)

    def problem(self, module, parent=None):
        return layout_problem(module)

    def projections(self, module, parent=None):
        dispatch, _ = dispatch_of(module)
        shard = None if dispatch is None else expert_shard(
            dispatch.experts, _stacks(module), dispatch.ep_mesh)
        return expert_projections(module, shard)

    def hook_target(self, module, shard=None):
        if shard is None:
            return module
        dispatch, why = dispatch_of(module)
        if dispatch is None:
            raise ValueError(f"fused experts preconditioned under expert parallelism, now "
                             f"{why or 'without it'}")
        return DispatchedCall(dispatch)

    def bind(self, module, args, kwargs, shard=None):
        return bind_expert_inputs(module, args, kwargs)

    def observe(self, module, inputs):
        return observe_arithmetic(module, *inputs)

    def rows(self, module, inputs, grad_out, arithmetic=None, shard=None):
        return expert_rows(module, *inputs, grad_out, arithmetic, shard)


TRANSFORMERS = TransformersExperts()
