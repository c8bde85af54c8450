r"""torchtitan's ``GroupedExperts`` as three stacks of expert linear layers (the adapter of
:mod:`.layout`; ``torch_impl/kronecker/experts/README.md``).

``torchtitan.models.common.moe.GroupedExperts`` holds ``w1_EFD`` (E, F, D), ``w2_EDF``
(E, D, F) and ``w3_EFD`` (E, F, D); its forward takes the routed rows ``x_RD``, already sorted
by expert, and ``num_tokens_per_expert_E``; expert e's rows are the ``counts[e]`` after those
of the experts before it (offsets = cumsum(counts)), and every product is a bf16 grouped mm
(``self._grouped_mm``, x and W cast to bfloat16), the output cast back to x's dtype:

.. math::
    u_1 = x W_{1,e}^T,\quad u_3 = x W_{3,e}^T,\quad h = \mathrm{silu}(u_1) \odot u_3,\quad
    \mathrm{out} = h W_{2,e}^T.

Each parameter is a stack of E ``nn.Linear`` weights (d_out x d_in: F x D, F x D, D x F, no
bias), expert e's rows the bf16 rows its product multiplied:

* w1: a = x, g = dL/du_1 (through silu and the product with the w3 branch);
* w3: a = x, g = dL/du_3 (through the product with silu(u_1));
* w2: a = h, g = dL/dout (rounded to the product's dtype, as the cast's backward does).

They are recomputed in the gradient hook of the call's output from its inputs, with the
module's own ``_grouped_mm``: u_1, u_3 and h exactly as the forward made them, dL/dh by one
grouped mm of dL/dout with W_2, then the VJP of silu(u_1) u_3. An expert with 0 rows has none.

**Recognised by structure**, without importing torchtitan: a class of that qualified name
and module in the module's MRO, exactly its three parameters in the declared layout (3-D,
leading size ``num_experts``, one F and one D), and GroupedExperts' own ``forward`` and
``_grouped_mm`` (a subclass overriding either, torchtitan's MXFP8 converter for one, computes
other products: skipped, with the reason). torchtitan's ``parallelize`` wraps the forward of
every module it places (``Module.parallelize``'s ``forward_with_redistribution``); that wrapper
is accepted when it provably runs GroupedExperts' own forward on the same module with no input
or output redistribution and no ``local_map`` (read from its closure and the module's sharding
config), the way torchtitan shards the experts' weights and nothing else.

**Expert parallelism** (:mod:`.parallel`): an EP token dispatcher with its EP mesh wired
beside the module (torchtitan's ``AllToAllTokenDispatcher``) and the three stacks DTensors
``Shard(0)`` on that mesh's dimension (FSDP's ``efsdp`` sharding of dim 0 beside it) make each
projection a stack of this rank's EP chunk: its rows are the chunk's (the forward's local
weights and counts, checked at every capture), its factors the experts the rank holds. The
all-to-all dispatchers of torchtitan's "standard" backend with no EP mesh wired fall back to
the local dispatch, and are accepted as before. Refused, naming it: any other dispatcher with
an EP mesh, a stack placement other than whole experts (expert tensor parallelism), DTensor
parameters without an EP dispatcher.
"""
import inspect

import torch
import torch.nn.functional as F

from .layout import ExpertProjection, ExpertsLayout, product_dtype
from .parallel import check_forward_chunk, ep_problem, expert_shard

__all__ = ["GroupedExpertsLayout", "TITAN"]

_MODULE, _CLASS = "torchtitan.models.common.moe", "GroupedExperts"
_PARAMS = ("w1_EFD", "w3_EFD", "w2_EDF")  # in the order of the rows: w1, w3, w2
_DISPATCHERS = "torchtitan.models.common.token_dispatcher"
#: the dispatchers that keep every token on this rank: the local one, and the all-to-all ones
#: while no EP mesh is wired (they fall back to the local dispatch)
_LOCAL = ("LocalTokenDispatcher",)
_FALL_BACK = ("AllToAllTokenDispatcher", "TorchAOTokenDispatcher")
#: the dispatcher whose EP path is followed: a plain all-to-all of the routed rows
_EP_DISPATCH = ("AllToAllTokenDispatcher",)
_WRAPPER = ("torchtitan.protocols.module", "Module.parallelize.<locals>.forward_with_redistribution")
_EP = ("expert parallelism: the rows of the experts other ranks hold are not here, and the "
       "statistics of this rank's experts would be summed with other experts' over the ranks")


def _base(module):
    """torchtitan's GroupedExperts class among ``module``'s classes, or None."""
    return next((c for c in type(module).__mro__
                 if c.__module__ == _MODULE and c.__qualname__ == _CLASS), None)


def _local(dispatcher):
    """Whether a token dispatcher keeps every routed row on this rank."""
    kind = type(dispatcher)
    if kind.__module__ != _DISPATCHERS:
        return False
    return kind.__qualname__ in _LOCAL or (kind.__qualname__ in _FALL_BACK
                                           and getattr(dispatcher, "ep_mesh", 0) is None)


def _ep_mesh(dispatcher):
    """The EP mesh of torchtitan's all-to-all dispatcher, or None (no EP, or another kind)."""
    kind = type(dispatcher)
    if kind.__module__ != _DISPATCHERS or kind.__qualname__ not in _EP_DISPATCH:
        return None
    return getattr(dispatcher, "ep_mesh", None)


def _wrapper_problem(module, base):
    """None if the instance's ``forward`` is torchtitan's parallelize wrapper around
    GroupedExperts' own forward of ``module`` with nothing redistributed, else why not."""
    wrapper = vars(module)["forward"]
    if (getattr(wrapper, "__module__", None), getattr(wrapper, "__qualname__", None)) != _WRAPPER:
        return "an instance forward that is not torchtitan's parallelize wrapper"
    inner = inspect.getclosurevars(wrapper).nonlocals.get("fn")
    if getattr(inner, "__self__", None) is not module or \
            getattr(inner, "__func__", None) is not base.forward:
        return "torchtitan's parallelize wrapper around another function than its forward"
    config = getattr(module, "_sharding_config", None)
    moved = [f for f in ("in_src_shardings", "in_dst_shardings", "out_src_shardings",
                         "out_dst_shardings", "local_map") if getattr(config, f, None)]
    if config is None or moved:
        return f"torchtitan's parallelize wrapper redistributing {moved or 'unknown'}"
    return None


def _local_tensor(tensor):
    """A DTensor's local tensor (the forward's ``to_local``), a tensor itself."""
    return tensor.to_local() if _dtensor(tensor) else tensor


def _dtensor(tensor):
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor
    return isinstance(tensor, DTensor)


class GroupedExpertsLayout(ExpertsLayout):
    """The adapter of torchtitan's ``GroupedExperts`` (module docstring)."""

    name = "torchtitan GroupedExperts"

    def matches(self, module):
        return _base(module) is not None

    def problem(self, module, parent=None):
        base, cls = _base(module), type(module).__qualname__
        for method in ("forward", "_grouped_mm"):
            overridden = getattr(type(module), method) is not getattr(base, method)
            if method in vars(module) and not overridden and method == "forward":
                why = _wrapper_problem(module, base)
                overridden = why is not None
            elif method in vars(module):
                overridden = True
            if overridden:
                return (f"{cls} overrides GroupedExperts.{method}: its products are not "
                        "GroupedExperts' SwiGLU of bf16 grouped mms, whose rows the capture "
                        "recomputes")
        params = dict(module.named_parameters(recurse=False))
        if sorted(params) != sorted(_PARAMS):
            return (f"{cls} holds the parameters {sorted(params)}, not GroupedExperts' "
                    f"{sorted(_PARAMS)}")
        E = getattr(module, "num_experts", None)
        w1, w3, w2 = (params[n] for n in _PARAMS)
        if not all(w.dim() == 3 for w in (w1, w3, w2)) or w1.shape[0] != E:
            return (f"{cls} parameters of shapes {[tuple(w.shape) for w in (w1, w3, w2)]}: "
                    f"expected (num_experts={E}, ., .)")
        _, f, d = w1.shape
        if tuple(w3.shape) != (E, f, d) or tuple(w2.shape) != (E, d, f):
            return (f"{cls} parameters of shapes {[tuple(w.shape) for w in (w1, w3, w2)]}: "
                    f"expected w1, w3 (E, F, D) and w2 (E, D, F)")
        dispatcher = getattr(parent, "token_dispatcher", None)
        ep_mesh = _ep_mesh(dispatcher)
        if ep_mesh is not None:
            why = ep_problem(E, params, ep_mesh)
            return None if why is None else (
                f"{type(dispatcher).__qualname__} beside {cls} with an EP mesh (expert "
                f"parallelism) not laid out as torchtitan's EP: {why}")
        if dispatcher is not None and not _local(dispatcher):
            return f"{type(dispatcher).__qualname__} beside {cls}: {_EP}"
        return None

    def projections(self, module, parent=None):
        ep_mesh = _ep_mesh(getattr(parent, "token_dispatcher", None))
        shard = None if ep_mesh is None else expert_shard(
            module.num_experts, {n: getattr(module, n) for n in _PARAMS}, ep_mesh)
        return [(n, ExpertProjection(module, n, self, shard=shard)) for n in _PARAMS]

    def bind(self, module, args, kwargs, shard=None):
        if shard is None and any(_dtensor(getattr(module, n)) for n in _PARAMS):
            raise ValueError(f"{type(module).__qualname__} runs on DTensor parameters (its "
                             f"to_local path) without an EP dispatcher: {_EP}")
        bound = inspect.signature(_base(module).forward).bind(module, *args, **kwargs)
        return tuple(bound.arguments.values())[1:]

    def rows(self, module, inputs, grad_out, arithmetic=None, shard=None):
        x, counts = inputs
        E = module.num_experts
        if shard is not None:  # EP: this rank's chunk, its local (FSDP-unsharded) weights
            check_forward_chunk(shard, module.w1_EFD, counts)
            E = shard.n_seen
        elif counts.numel() != E:
            raise ValueError(f"token counts for {counts.numel()} experts, not num_experts={E}: "
                             f"{_EP}")
        n = counts.tolist()  # one host sync
        S = sum(n)
        if S > x.shape[0]:
            raise ValueError(f"counts for {S} rows, but {x.shape[0]} rows were given")
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        token = torch.arange(S, device=x.device)
        expert = torch.repeat_interleave(torch.arange(E, device=x.device),
                                         counts.to(x.device), output_size=S)
        dtype = torch.bfloat16  # GroupedExperts casts x and W to it before each product
        w1, w3, w2 = (_local_tensor(getattr(module, p)).detach().to(dtype) for p in _PARAMS)
        xb = x.detach()[:S].to(dtype)
        mm = module._grouped_mm
        u1 = mm(A=xb, B_t=w1.transpose(-2, -1), offs=offsets)
        u3 = mm(A=xb, B_t=w3.transpose(-2, -1), offs=offsets)
        with torch.enable_grad():
            u1, u3 = u1.requires_grad_(), u3.requires_grad_()
            h = F.silu(u1) * u3
            g_out = grad_out.detach()[:S].to(product_dtype(h, w2))
            g_h = mm(A=g_out, B_t=w2, offs=offsets)  # dL/dh = dL/dout W_2
            g1, g3 = torch.autograd.grad(h, (u1, u3), g_h.to(h.dtype))
        g_dtype = product_dtype(xb, w1)
        return token, expert, [(xb, g1.to(g_dtype)), (xb, g3.to(g_dtype)),
                               (h.detach(), g_out)]


TITAN = GroupedExpertsLayout()
