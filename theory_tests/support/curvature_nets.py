"""The test networks of issue 46 (float64, seeded, tiny so that brute-force curvature takes
milliseconds): each builder returns a :class:`Net`, the model, its inputs and the layers whose
blocks the tests compare, in forward order. ``kind`` ("mse" or "ce") picks the output layout the
loss wants: MSE (..., C); CE puts the classes at dim 1, so per-token logits (N, S, C) become
(N, C, S).
"""
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "Net", "make_loss", "make_targets", "deep_linear", "mlp", "shared_reduce", "mixed",
    "conv_net", "transformer_block", "fused_experts", "FusedExperts", "ACTIVATIONS",
]

DTYPE = torch.float64
ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "sigmoid": nn.Sigmoid}


@dataclass
class Net:
    model: nn.Module
    inputs: torch.Tensor
    layers: list


def make_loss(kind, reduction):
    """nn.MSELoss or nn.CrossEntropyLoss with the given reduction."""
    return {"mse": nn.MSELoss, "ce": nn.CrossEntropyLoss}[kind](reduction=reduction)


def make_targets(kind, output, seed=1):
    """Targets for ``output``: CE labels of shape (N, d1, ...), MSE values like the output."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "ce":
        shape = (output.shape[0], *output.shape[2:])
        return torch.randint(0, output.shape[1], shape, generator=gen)
    return torch.randn(output.shape, generator=gen, dtype=DTYPE)


class ClassesAtDim1(nn.Module):
    """(N, S, C) logits -> (N, C, S), CrossEntropyLoss's layout for per-token targets."""

    def forward(self, x):
        return x.movedim(-1, 1)


class Reduce(nn.Module):
    """Mean or sum over the shared (token) dim 1: the reduce setting's reduction."""

    def __init__(self, how):
        super().__init__()
        if how not in ("mean", "sum"):
            raise ValueError(f"how must be 'mean' or 'sum', got {how!r}")
        self.how = how

    def forward(self, x):
        return x.mean(dim=1) if self.how == "mean" else x.sum(dim=1)


def _seeded(seed):
    torch.manual_seed(seed)


def _inputs(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed + 100), dtype=DTYPE)


def _finish(modules, kind, inputs, per_token):
    """Sequential of ``modules`` (CE per-token logits moved to dim 1) in float64."""
    if kind == "ce" and per_token:
        modules = modules + [ClassesAtDim1()]
    model = nn.Sequential(*modules).to(DTYPE)
    layers = [m for m in model if isinstance(m, (nn.Linear, nn.Conv2d))]
    return Net(model, inputs, layers)


def deep_linear(kind="mse", N=6, S=None, dims=(3, 4, 3, 2), bias=True, seed=0):
    """L = len(dims) - 1 linear layers; inputs (N, d) or, with S, (N, S, d) and per-token
    outputs (the expand setting)."""
    _seeded(seed)
    layers = [nn.Linear(i, o, bias=bias) for i, o in zip(dims[:-1], dims[1:])]
    shape = (N, dims[0]) if S is None else (N, S, dims[0])
    return _finish(layers, kind, _inputs(shape, seed), per_token=S is not None)


def mlp(activation, kind="mse", N=1, dims=(3, 4, 3), bias=True, seed=0):
    """Linear, activation, Linear (issue 46's nonlinear case, batch size 1 by default)."""
    _seeded(seed)
    act = ACTIVATIONS[activation]
    modules = [nn.Linear(dims[0], dims[1], bias=bias), act(), nn.Linear(dims[1], dims[2], bias=bias)]
    return _finish(modules, kind, _inputs((N, dims[0]), seed), per_token=False)


def shared_reduce(how, kind="mse", N=4, S=3, dims=(3, 4, 2), bias=True, seed=0):
    """Linear layers shared over S tokens, then a mean or sum over the tokens, then the loss
    (the reduce setting): output (N, C)."""
    _seeded(seed)
    layers = [nn.Linear(i, o, bias=bias) for i, o in zip(dims[:-1], dims[1:])]
    return _finish(layers + [Reduce(how)], kind, _inputs((N, S, dims[0]), seed), per_token=False)


def mixed(how, kind="mse", N=4, S=3, dims=(3, 4, 3, 2), bias=True, seed=0):
    """Two shared layers, the reduction over tokens, then a third layer (one row per sample)."""
    _seeded(seed)
    l1, l2, l3 = [nn.Linear(i, o, bias=bias) for i, o in zip(dims[:-1], dims[1:])]
    return _finish([l1, l2, Reduce(how), l3], kind, _inputs((N, S, dims[0]), seed),
                   per_token=False)


class SumPositions(nn.Module):
    """(N, C, H, W) -> (N, C): the reduce setting of a conv net (sum over positions)."""

    def forward(self, x):
        return x.sum(dim=(2, 3))


def conv_net(kind="mse", N=2, channels=(2, 3, 2), size=4, out=2, bias=True, seed=0):
    """Conv2d(2x2) twice (linear), a sum over the positions, a Linear: its convs are shared
    over their L output positions and reduced before the loss."""
    _seeded(seed)
    c0, c1, c2 = channels
    modules = [nn.Conv2d(c0, c1, 2, bias=bias), nn.Conv2d(c1, c2, 2, bias=bias), SumPositions(),
               nn.Linear(c2, out, bias=bias)]
    return _finish(modules, kind, _inputs((N, c0, size, size), seed), per_token=False)


class TinyBlock(nn.Module):
    """One pre-norm-free transformer block on (N, S, d): single-head softmax attention with
    q, k, v, o projections and a residual, a Tanh MLP with a residual, a per-token head."""

    def __init__(self, d, hidden, classes):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(1, 2) / x.shape[-1] ** 0.5
        h = x + self.o(torch.softmax(scores, dim=-1) @ self.v(x))
        h = h + self.fc2(torch.tanh(self.fc1(h)))
        return self.head(h)


def transformer_block(kind="ce", N=2, S=3, d=4, hidden=5, classes=3, seed=0):
    """:class:`TinyBlock` with per-token outputs."""
    _seeded(seed)
    block = TinyBlock(d, hidden, classes)
    modules = [block] + ([ClassesAtDim1()] if kind == "ce" else [])
    model = nn.Sequential(*modules).to(DTYPE)
    layers = [block.q, block.k, block.v, block.o, block.fc1, block.fc2, block.head]
    return Net(model, _inputs((N, S, d), seed), layers)


class FusedExperts(nn.Module):
    """E experts in one 3-D weight (E, d_out, d_in) and bias (E, d_out); token t goes to the
    fixed expert ``routes[t]`` (top-1, weight 1): y_t = W[r_t] x_t + b[r_t]."""

    def __init__(self, experts, d_in, d_out, routes):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, d_out, d_in) / d_in ** 0.5)
        self.bias = nn.Parameter(torch.randn(experts, d_out) / 4)
        self.register_buffer("routes", torch.as_tensor(routes, dtype=torch.long))

    def forward(self, x):
        return torch.einsum("toi,ti->to", self.weight[self.routes], x) + self.bias[self.routes]


def fused_experts(kind="mse", routes=(0, 2, 0, 2, 2), experts=3, dims=(3, 4, 2), seed=0):
    """T tokens (one data point each) through a fused-expert layer and a shared linear head;
    with the default routes expert 1 gets no token."""
    _seeded(seed)
    layer = FusedExperts(experts, dims[0], dims[1], routes)
    model = nn.Sequential(layer, nn.Linear(dims[1], dims[2])).to(DTYPE)
    return Net(model, _inputs((len(routes), dims[0]), seed), [layer, model[1]])
