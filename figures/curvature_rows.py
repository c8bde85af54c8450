r"""The rows a Kronecker method builds its factors from, read off one forward of a network
(figure ``curvature_distance``; issue 46, KC4, KC5, KC7).

For each ``nn.Linear`` / ``nn.Conv2d`` layer: its input rows ``a`` as (N, S, d_in) -- a Linear's
input (N, d) read as S = 1, a Conv2d's unfolded patches (N, L, C_in·kh·kw), in the order of
``weight.reshape(-1)``'s columns -- and, for any list of output-space columns, each column
back-propagated to the layer output as (K, N, S, d_out) (``autograd.grad``: nothing is written
to ``.grad``). These are the oracle's inputs (``reference/baselines/kfac_flavours.py``), and
with the training loss's own gradient they are MKOR's rows (K3, K4).

Written here, from the module's own hooks, so that the figure's oracle path does not depend on
the library's capture: the distances it draws are of the oracle's formulas applied to these.
"""
import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["Forward", "input_rows", "output_rows"]


def input_rows(layer, x):
    """(N, S, d_in) rows of ``layer``'s input ``x`` (no bias column: the oracle appends it)."""
    if isinstance(layer, nn.Conv2d):
        patches = F.unfold(x, layer.kernel_size, dilation=layer.dilation,
                           padding=layer.padding, stride=layer.stride)
        return patches.transpose(1, 2)  # (N, L, C_in kh kw): the weight's column order
    return x if x.dim() == 3 else x.reshape(x.shape[0], -1, x.shape[-1])


def output_rows(layer, grad):
    """(N, S, d_out) rows of a gradient w.r.t. ``layer``'s output (a Conv2d's per position)."""
    if isinstance(layer, nn.Conv2d):
        return grad.flatten(2).transpose(1, 2)
    return grad if grad.dim() == 3 else grad.reshape(grad.shape[0], -1, grad.shape[-1])


class Forward:
    """One forward of ``model`` on ``inputs`` with every layer of ``layers`` observed:
    ``output`` (with its graph), ``a[name]`` the input rows, and :meth:`backprop`."""

    def __init__(self, model, layers, inputs):
        names = {module: name for name, module in model.named_modules()}
        self.names = [names[layer] for layer in layers]
        self.layers = dict(zip(self.names, layers))
        self.a, self._out = {}, {}
        hooks = [layer.register_forward_hook(self._hook(name))
                 for name, layer in self.layers.items()]
        try:
            self.output = model(inputs)
        finally:
            for h in hooks:
                h.remove()

    def _hook(self, name):
        def hook(module, args, output):
            if name in self._out:
                raise ValueError(f"{name} is called twice: one call per layer expected")
            self.a[name] = input_rows(module, args[0].detach())
            self._out[name] = output
        return hook

    def backprop(self, grad_output):
        """{name: (N, S, d_out) rows} of ``grad_output`` (shaped like ``output``)
        back-propagated to every layer's output."""
        grads = torch.autograd.grad(self.output, [self._out[n] for n in self.names],
                                    grad_outputs=grad_output, retain_graph=True)
        return {n: output_rows(self.layers[n], g) for n, g in zip(self.names, grads)}

    def loss_rows(self, loss):
        """{name: rows} of the gradient of the (reduced) training loss ``loss`` w.r.t. each
        layer's output: MKOR's g rows before its per-sample multiplier."""
        grads = torch.autograd.grad(loss, [self._out[n] for n in self.names], retain_graph=True)
        return {n: output_rows(self.layers[n], g) for n, g in zip(self.names, grads)}
