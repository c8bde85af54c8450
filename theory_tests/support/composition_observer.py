"""The composition matrix's independent statistics: :class:`Observer` computes MKOR's and
K-FAC's statistics without ``torch_impl.mkor.capture`` (its own forward hooks and
``retain_grad``), with a rounding bound derived from the rows it saw; :func:`oracle_errors`
compares a run's statistics with it.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.pytorch_utils import Conv1D


from theory_tests.support.composition_rows import listed_unmasked, token_mask

f64 = torch.float64


# -- independent statistics --------------------------------------------------------------------
def _first_tensor(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def _gamma(n, dtype):
    u = torch.finfo(dtype).eps / 2
    return n * u / (1 - n * u)


class Observer:
    """The statistics of the preconditioned layers, computed without ``torch_impl``'s capture
    code: a forward hook per layer keeps a copy of its input and calls ``retain_grad()`` on
    its output; after the backward the rows are formed here (Linear / Conv1D: the input's and
    the output gradient's last dimension; Conv2d: ``F.unfold`` patches, L positions per
    sample) and, with the masks ``case.rows`` prescribes (``composition_rows``), padded rows
    are dropped. :meth:`step` turns the
    rows of every backward since the last call into the statistics of one factor update and
    a bound on the rounding difference from any other summation order:

    * MKOR (spec K3-K6): a_bar = mean over rows of [a | 1]; g_bar = sum over rows of g, / L
      for a convolution;
    * K-FAC (K19): A = mean over rows of [a|1][a|1]^T, G = N sum g g^T with N samples, then
      the EMA A <- beta A + (1 - beta) A_new (the first update takes A_new).

    Bounds: a sum of n terms computed in two orders differs by at most 2 gamma_n times the
    sum of the terms' magnitudes (gamma_n = n u / (1 - n u), u the unit roundoff), each
    division or scaling adds u of the result on either side, and the EMA carries the bound
    linearly. n counts every row a layer received (masked rows enter the capture code's sums
    as zeros) plus one per call (per-call partial sums are added).
    """

    def __init__(self, model, names, case=None, kind="mkor", decay=0.95):
        self.case, self.kind, self.decay = case, kind, decay
        self.modules = {n: model.get_submodule(n) for n in names}
        self.batch = None
        self.unmatched = set()     # token layers no (B, T) mask indexes (listed_unmasked)
        self._calls = {n: [] for n in names}
        self._ema = {}
        self._handles = [m.register_forward_hook(self._hook(n), with_kwargs=True)
                         for n, m in self.modules.items()]

    def remove(self):
        for h in self._handles:
            h.remove()

    def _hook(self, name):
        def hook(module, args, kwargs, out):
            if not (module.training and torch.is_grad_enabled() and out.requires_grad):
                return
            out.retain_grad()
            self._calls[name].append((_first_tensor(args, kwargs).detach().clone(), out,
                                      self.batch))
        return hook

    def _rows(self, name, x, out, batch):
        module = self.modules[name]
        if isinstance(module, nn.Conv2d):
            assert module.padding_mode == "zeros" and not isinstance(module.padding, str)
            a = F.unfold(x, module.kernel_size, dilation=module.dilation,
                         padding=module.padding, stride=module.stride).transpose(1, 2)
            g = out.grad.flatten(2).transpose(1, 2)
            per_sample = a.shape[1]
        else:
            a, g, per_sample = x, out.grad, 1
        mask = None
        if self.case is not None and self.case.tokens and batch is not None:
            mask = token_mask(self.case.rows, batch, name, a.shape[:-1])
            if listed_unmasked(self.case.rows, name) and "attention_mask" in batch:
                self.unmatched.add(name)
        total = a[..., 0].numel()
        a, g = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
        if mask is not None:
            keep = mask.reshape(-1)
            a, g = a[keep], g[keep]
        return a, g, per_sample, total

    def step(self):
        """{name: (stat_1, stat_2, bound_1, bound_2)}, and forget the rows. MKOR: (a_bar,
        g_bar, ...) of the layers called since the last call; K-FAC: the factor EMAs (A, G,
        ...) after this update of every layer updated so far (``KFAC.factors()``'s keys)."""
        out = {}
        for name, calls in self._calls.items():
            # a call whose output the loss does not reach (an unused pooler) has no rows
            calls[:] = [call for call in calls if call[1].grad is not None]
            if not calls:
                continue
            module = self.modules[name]
            has_bias = module.bias is not None and module.bias.requires_grad
            parts = [self._rows(name, x, o, b) for x, o, b in calls]
            a = torch.cat([p[0] for p in parts])
            g = torch.cat([p[1] for p in parts])
            per_sample = parts[0][2]
            n_terms = sum(p[3] for p in parts) + len(parts)
            dtype = torch.promote_types(a.dtype, torch.float32)
            a, g = a.to(dtype), g.to(dtype)
            u, gam = torch.finfo(dtype).eps / 2, _gamma(n_terms, dtype)
            n = a.shape[0]
            if has_bias:
                a = torch.cat([a, torch.ones(n, 1, dtype=dtype)], dim=1)
            if self.kind == "mkor":
                a_bar = a.sum(0) / n
                g_bar = g.sum(0) / per_sample
                a_tol = 2 * gam * a.abs().sum(0) / n + 2 * u * a_bar.abs()
                g_tol = 2 * gam * g.abs().sum(0) / per_sample + 2 * u * g_bar.abs()
                out[name] = (a_bar, g_bar, a_tol, g_tol)
            else:
                samples = n / per_sample
                A_new = a.T @ a / n
                G_new = (g.T @ g) * samples
                A_tol = 2 * gam * (a.abs().T @ a.abs()) / n + 2 * u * A_new.abs()
                G_tol = 2 * gam * (g.abs().T @ g.abs()) * samples + 2 * u * G_new.abs()
                if name in self._ema:
                    A0, G0, At0, Gt0 = self._ema[name]
                    b = self.decay
                    A, G = b * A0 + (1 - b) * A_new, b * G0 + (1 - b) * G_new
                    A_tol = b * At0 + (1 - b) * A_tol + 4 * u * (b * A0.abs() + A_new.abs())
                    G_tol = b * Gt0 + (1 - b) * G_tol + 4 * u * (b * G0.abs() + G_new.abs())
                else:
                    A, G = A_new, G_new
                self._ema[name] = (A, G, A_tol, G_tol)
            calls.clear()
        if self.kind == "kfac":  # every layer: K-FAC's factors() lists all once decomposed
            out = {name: self._ema.get(name) or self._identity(name) for name in self.modules}
        return out

    def _identity(self, name):
        """K-FAC's initial factors (I, I), exact: bound 0."""
        module = self.modules[name]
        if isinstance(module, Conv1D):
            d_in, d_out = module.weight.shape
        else:
            d_out, d_in = module.weight.shape[0], module.weight[0].numel()
        d_in += int(module.bias is not None and module.bias.requires_grad)
        dtype = torch.promote_types(module.weight.dtype, torch.float32)
        A, G = torch.eye(d_in, dtype=dtype), torch.eye(d_out, dtype=dtype)
        return A, G, torch.zeros_like(A), torch.zeros_like(G)


def oracle_errors(steps_mine, steps_oracle):
    """(max abs difference, max of difference / bound, worst layer) between the
    preconditioner's statistics per step ({name: (x, y)}) and the Observer's
    ({name: (x, y, x_tol, y_tol)}); layers must match exactly (else inf)."""
    worst_abs, worst_ratio, where = 0.0, 0.0, None
    for t, (mine, ref) in enumerate(zip(steps_mine, steps_oracle)):
        if set(mine) != set(ref):
            return math.inf, math.inf, f"step {t}: layers {sorted(set(mine) ^ set(ref))}"
        for name, (x, y, xt, yt) in ref.items():
            for got, want, tol in ((mine[name][0], x, xt), (mine[name][1], y, yt)):
                diff = (got.to(want.dtype) - want).abs()
                ratio = float((diff / tol.clamp_min(torch.finfo(want.dtype).tiny)).max())
                if float(diff.max()) > worst_abs:
                    worst_abs = float(diff.max())
                if ratio > worst_ratio:
                    worst_ratio, where = ratio, f"step {t}: {name}"
    return worst_abs, worst_ratio, where


