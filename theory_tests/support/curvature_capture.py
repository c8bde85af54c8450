"""Feeding the K-FAC-flavours oracle (``reference/baselines/kfac_flavours.py``) from a torch
model, float64: a forward hook keeps one layer's input rows a and its output y, the oracle
chooses output-space columns (KC2, KC3), and ``torch.autograd.grad(output, y, column)`` backpropagates
each column for all data points at once. The rows come back in the oracle's shapes:
a (N, S, d_in), g (K, N, S, d_out); a Conv2d's S are its L output positions (unfolded
patches), a (N, d) input is S = 1. Plain autograd: nothing of the port's capture is used.
"""
import numpy as np
import torch
from torch import nn

from reference.baselines import kfac_flavours as oracle
from theory_tests.support.curvature import (loss_kind, output_points, points_to_output,
                                            reduction_factor, target_points)

__all__ = ["Captured", "capture", "flavour_factors", "oracle_factors"]


class Captured:
    """One forward of ``model`` with ``layer``'s input rows and output kept in the graph."""

    def __init__(self, model, loss_func, inputs, targets, layer):
        store = {}

        def hook(module, args, out):
            store["a"], store["y"] = args[0], out

        handle = layer.register_forward_hook(hook)
        try:
            self.output = model(inputs)
        finally:
            handle.remove()
        self.layer, self.loss_func = layer, loss_func
        self.a, self.y = store["a"], store["y"]
        self.kind = loss_kind(loss_func)
        self.points = output_points(loss_func, self.output).detach().numpy()
        self.targets = target_points(loss_func, targets, self.output).numpy()
        # the oracle's R (KC1), held to the brute force's on every capture
        self.R = oracle.reduction_factor(self.kind, loss_func.reduction, self.points.shape[0],
                                         self.output.numel())
        if self.R != reduction_factor(loss_func, self.output):
            raise AssertionError(f"oracle R {self.R} != brute-force R")
        self.loss = loss_func(self.output, targets)

    def backprop(self, columns):
        """(K, P, C) output-space columns -> (K, *y.shape) at the layer output."""
        cols = points_to_output(torch.from_numpy(np.ascontiguousarray(columns)),
                                self.output.shape, self.loss_func)
        # one vmapped backward for all K columns (backprop is linear in the column)
        return torch.autograd.grad(self.output, self.y, cols, retain_graph=True,
                                   is_grads_batched=True)[0]

    def loss_gradient(self):
        """∂L/∂y of the reduced training loss (for MKOR's ḡ and the empirical check)."""
        return torch.autograd.grad(self.loss, self.y, retain_graph=True)[0]

    def rows(self, g):
        """(a, g) in the oracle's shapes: (N, S, d_in) and (K, N, S, d_out)."""
        a = self.a.detach()
        if isinstance(self.layer, nn.Conv2d):
            lay = self.layer
            patches = nn.functional.unfold(a, lay.kernel_size, lay.dilation, lay.padding,
                                           lay.stride)           # (N, C_in kh kw, L)
            a = patches.transpose(1, 2)
            g = g.flatten(3).transpose(2, 3)                      # (K, N, L, C_out)
        elif a.dim() == 2:
            a, g = a[:, None, :], g[:, :, None, :]
        return a.numpy(), g.detach().numpy()


def capture(model, loss_func, inputs, targets, layer):
    return Captured(model, loss_func, inputs, targets, layer)


def flavour_factors(cap, fisher_type, approx, *, samples=1, seed=0):
    """(A, G) of one flavour from a :class:`Captured` forward."""
    rng = np.random.default_rng(seed)
    columns = oracle.kfac_columns(cap.kind, fisher_type, cap.points, cap.targets,
                                  samples=samples, rng=rng)
    a, g = cap.rows(cap.backprop(columns))
    has_bias = getattr(cap.layer, "bias", None) is not None
    factors = {"expand": oracle.expand_factors, "reduce": oracle.reduce_factors}[approx]
    return factors(a, g, cap.R, has_bias)


def oracle_factors(model, loss_func, inputs, targets, layer, fisher_type="type-2",
                   approx="expand", *, samples=1, seed=0):
    """(A, G) of one flavour for one layer: kron(G, A) approximates its KC1 block."""
    cap = capture(model, loss_func, inputs, targets, layer)
    return flavour_factors(cap, fisher_type, approx, samples=samples, seed=seed)
