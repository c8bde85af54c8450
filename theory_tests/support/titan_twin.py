"""torchtitan's ``GroupedExperts`` in a tiny model with a fixed routing, and its twin with
E x 3 ``nn.Linear`` experts computing the same bf16 products (``torch_impl/kronecker/experts/README.md``).

:class:`Routed` feeds one ``GroupedExperts`` (torchtitan's own module) the rows of a fixed
routing: a trainable ``nn.Linear`` in front (so the experts' input rows move with training),
the rows gathered in expert order (expert e gets ``counts[e]`` of them; an expert may get none),
the outputs weighted and added back to their tokens as torchtitan's combine does. :class:`Twin`
is the same model whose experts are ``nn.Linear`` layers (w1, w3: F x D, w2: D x F, no bias) of
:class:`BF16Linear`: each multiplies its bf16 input by its weight cast to bf16, as
``GroupedExperts`` casts x and W to bfloat16 before its grouped mm (so each linear's own hooks
see the bf16 rows the product multiplied); silu and the product stay in bf16, and the output
is cast back to x's dtype. BF16Linear overrides ``forward``, so discovery refuses it unless its
product is declared: ``BF16_LINEAR`` (``LinearType(BF16Linear)``), registered by the tests.
"""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_impl.kronecker.layers import LinearType

__all__ = ["Routed", "Twin", "grouped_experts", "routing", "twin_of", "PARAMS", "as_stacks",
           "hand_rows", "BF16Linear", "BF16_LINEAR"]

PARAMS = ("w1_EFD", "w3_EFD", "w2_EDF")
_LINEARS = ("w1", "w3", "w2")


def grouped_experts(dim, hidden, experts, cls=None, dtype=torch.float64):
    """torchtitan's GroupedExperts (or ``cls``, a subclass) with normal(0, 0.1) weights."""
    from torchtitan.models.common.moe import GroupedExperts
    cls = cls or GroupedExperts
    module = cls(cls.Config(dim=dim, hidden_dim=hidden, num_experts=experts)).to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.1)
    return module


def routing(tokens, top_k, counts, seed=0):
    """(order, counts, weights): the token of each routed row in expert order, the rows per
    expert, each row's routing weight; ``counts`` sums to tokens * top_k."""
    g = torch.Generator().manual_seed(seed)
    assert sum(counts) == tokens * top_k
    order = torch.arange(tokens).repeat(top_k)[torch.randperm(tokens * top_k, generator=g)]
    return order, torch.tensor(counts), torch.rand(tokens * top_k, generator=g,
                                                    dtype=torch.float64)


class BF16Linear(nn.Linear):
    """An ``nn.Linear`` whose product is bf16 input times bf16 weight (``torch.matmul``, the
    kernel ``torch._grouped_mm`` runs per group on CPU)."""

    def forward(self, x):
        return x @ self.weight.bfloat16().T


#: x W^T in bf16 is a linear product: the declaration that lets discovery precondition it
BF16_LINEAR = LinearType(BF16Linear)


class Routed(nn.Module):
    """x -> proj(x) -> rows in expert order -> experts -> weighted sum back per token."""

    def __init__(self, experts, route, dim, dtype=torch.float64):
        super().__init__()
        self.proj = nn.Linear(dim, dim, dtype=dtype)
        self.experts = experts
        order, counts, weights = route
        self.register_buffer("order", order)
        self.register_buffer("counts", counts)
        self.register_buffer("weights", weights)

    def run_experts(self, rows):
        return self.experts(rows, self.counts)

    def forward(self, x):
        y = self.proj(x)
        out = self.run_experts(y[self.order]) * self.weights[:, None].to(y.dtype)
        return torch.zeros_like(y).index_add_(0, self.order, out)


class Twin(Routed):
    """:class:`Routed` with ``nn.Linear`` experts (module docstring)."""

    def __init__(self, routed):
        experts = routed.experts
        E, F_, D = experts.w1_EFD.shape
        twins = nn.ModuleList()
        for e in range(E):
            expert = nn.ModuleDict({n: BF16Linear(*((F_, D) if n == "w2" else (D, F_)),
                                                 bias=False, dtype=experts.w1_EFD.dtype)
                                    for n in _LINEARS})
            with torch.no_grad():
                for n, p in zip(_LINEARS, PARAMS):
                    expert[n].weight.copy_(getattr(experts, p)[e])
            twins.append(expert)
        super().__init__(twins, (routed.order, routed.counts, routed.weights),
                         routed.proj.in_features)
        self.proj.load_state_dict(routed.proj.state_dict())

    def run_experts(self, rows):
        parts, start = [], 0
        for expert, n in zip(self.experts, self.counts.tolist()):
            x = rows[start:start + n]
            start += n
            if n:  # x cast twice, as GroupedExperts does (each cast's gradient its own)
                h = F.silu(expert["w1"](x.bfloat16())) * expert["w3"](x.bfloat16())
                parts.append(expert["w2"](h))
        return torch.cat(parts).to(rows.dtype)


def twin_of(routed):
    return Twin(copy.deepcopy(routed))


def as_stacks(twin):
    """The twin's expert weights stacked as GroupedExperts' parameters {name: (E, ., .)}."""
    return {p: torch.stack([expert[n].weight.detach() for expert in twin.experts])
            for n, p in zip(_LINEARS, PARAMS)}


def hand_rows(module, x, counts, grad_out):
    """Each expert's (a, g) of w1, w3, w2 from a per-expert forward written out with
    ``torch.matmul`` and autograd (``retain_grad`` on each product): the independent rows."""
    out = {p: [] for p in PARAMS}
    start = 0
    for e, n in enumerate(counts.tolist()):
        xb = x[start:start + n].detach().bfloat16()
        w1, w3, w2 = (getattr(module, p).detach()[e].bfloat16() for p in PARAMS)
        u1, u3 = xb @ w1.T, xb @ w3.T
        for t in (u1, u3):
            t.requires_grad_()
        h = F.silu(u1) * u3
        h.retain_grad()
        y = h @ w2.T
        y.backward(grad_out[start:start + n].to(y.dtype))
        start += n
        out["w1_EFD"].append((xb, u1.grad))
        out["w3_EFD"].append((xb, u3.grad))
        out["w2_EDF"].append((h.detach(), grad_out[start - n:start].to(y.dtype)))
    return out
