"""The composition matrix's independent statistics: :class:`Observer` computes MKOR's and
K-FAC's statistics without ``torch_impl.kronecker.capture.capture`` (its own forward hooks and
``retain_grad``), with a rounding bound derived from the rows it saw; :func:`oracle_errors`
compares a run's statistics with it.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.pytorch_utils import Conv1D


from theory_tests.support.composition_moe import RoutedCalls, fused_layers
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

    Fused experts (a projection ``<experts>.gate_up_proj`` of a module holding E experts as a
    3-D parameter, :mod:`composition_moe`): the layer is E layers, expert e's rows the routed
    pairs :class:`~composition_moe.RoutedCalls` recomputes for it, masked by their tokens'
    mask; its statistics are stacks, (E, d) for MKOR (an expert routed no pair: zeros), and
    (E, d, d) for K-FAC (the EMA of an expert advances only in a step where it has rows; N =
    its own rows, as for an ``nn.Linear`` expert called on its tokens). The bound takes n =
    every pair of the layer's calls plus one per call, for every expert.
    """

    def __init__(self, model, names, case=None, kind="mkor", decay=0.95):
        self.case, self.kind, self.decay = case, kind, decay
        self.fused = fused_layers(model, names)   # {name: (experts module name, parameter)}
        self.modules = {n: model.get_submodule(self.fused[n][0] if n in self.fused else n)
                        for n in names}
        self.batch = None
        self.unmatched = set()     # token layers no (B, T) mask indexes (listed_unmasked)
        self._calls = {n: [] for n in names}
        self._ema = {}
        self._seen = {}            # a stack's experts whose factors have had rows (K-FAC)
        self._handles = [m.register_forward_hook(self._hook(n), with_kwargs=True)
                         for n, m in self.modules.items() if n not in self.fused]
        self._routed = {}          # experts module name: RoutedCalls
        for name, (parent, _) in self.fused.items():
            if parent not in self._routed:
                self._routed[parent] = RoutedCalls(self.modules[name], lambda: self.batch)

    def remove(self):
        for h in self._handles:
            h.remove()
        for routed in self._routed.values():
            routed.remove()

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

    def _parts(self, name):
        """(a, g, per_sample, n_terms, expert) of the rows of ``name``'s calls since the last
        step (``expert``: each row's expert, for fused experts; else None), or None without
        rows; forgets the calls."""
        calls = self._calls[name]
        # a call whose output the loss does not reach (an unused pooler) has no rows
        calls[:] = [call for call in calls if call[1].grad is not None]
        if not calls:
            return None
        parts = [self._rows(name, x, o, b) for x, o, b in calls]
        calls.clear()
        a = torch.cat([p[0] for p in parts])
        g = torch.cat([p[1] for p in parts])
        return a, g, parts[0][2], sum(p[3] for p in parts) + len(parts), None

    def _routed_rows(self):
        """Every fused experts module's calls since the last step, as :meth:`_parts` per
        projection (only the real tokens' pairs kept)."""
        out = {}
        for parent, routed in self._routed.items():
            name_of = {param: name for name, (p, param) in self.fused.items() if p == parent}
            calls = routed.rows(self.case.rows if self.case is not None and self.case.tokens
                                else None, name_of)
            for param, name in name_of.items():
                if not calls:
                    continue
                a, g, experts, n_terms = [], [], [], 0
                for call in calls:
                    rows_a, rows_g, expert, keep, total = call[param]
                    if keep is not None:
                        rows_a, rows_g, expert = rows_a[keep], rows_g[keep], expert[keep]
                    a.append(rows_a)
                    g.append(rows_g)
                    experts.append(expert)
                    n_terms += total + 1
                out[name] = (torch.cat(a), torch.cat(g), 1, n_terms, torch.cat(experts))
        return out

    def step(self):
        """{name: (stat_1, stat_2, bound_1, bound_2)}, and forget the rows. MKOR: (a_bar,
        g_bar, ...) of the layers called since the last call; K-FAC: the factor EMAs (A, G,
        ...) after this update of every layer updated so far (``KFAC.factors()``'s keys)."""
        out = {}
        routed = self._routed_rows()
        for name in self._calls:
            found = routed.get(name) if name in self.fused else self._parts(name)
            if found is None:
                continue
            a, g, per_sample, n_terms, expert = found
            module = self.modules[name]
            dtype = torch.promote_types(a.dtype, torch.float32)
            a, g = a.to(dtype), g.to(dtype)
            if self._has_bias(name):
                a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=dtype)], dim=1)
            if expert is None:
                stats = self._statistics(a, g, per_sample, n_terms)
            else:  # a stack: each expert's rows on their own
                per_expert = [self._statistics(a[expert == e], g[expert == e], 1, n_terms)
                              for e in range(module.num_experts)]
                stats = tuple(torch.stack(s) for s in zip(*per_expert))
            if self.kind == "mkor":
                out[name] = stats
            else:
                self._ema[name] = self._ema_update(name, stats, expert)
        if self.kind == "kfac":  # every layer: K-FAC's factors() lists all once decomposed
            out = {name: self._ema.get(name) or self._identity(name) for name in self.modules}
        return out

    def _has_bias(self, name):
        module = self.modules[name]
        if name in self.fused:
            bias = (getattr(module, self.fused[name][1] + "_bias", None) if module.has_bias
                    else None)
        else:
            bias = module.bias
        return bias is not None and bias.requires_grad

    def _statistics(self, a, g, per_sample, n_terms):
        """One layer's statistics of rows a, g and their bounds: MKOR (a_bar, g_bar, ...);
        K-FAC the new factors (A_new, G_new, ...). No rows (an expert routed nothing): MKOR
        zeros, K-FAC None."""
        dtype = a.dtype
        u, gam = torch.finfo(dtype).eps / 2, _gamma(n_terms, dtype)
        n = a.shape[0]
        if self.kind == "mkor":
            a_bar = a.sum(0) / max(n, 1)
            g_bar = g.sum(0) / per_sample
            a_tol = 2 * gam * a.abs().sum(0) / max(n, 1) + 2 * u * a_bar.abs()
            g_tol = 2 * gam * g.abs().sum(0) / per_sample + 2 * u * g_bar.abs()
            return a_bar, g_bar, a_tol, g_tol
        if n == 0:
            d_a, d_g = a.shape[1], g.shape[1]
            return (torch.full((d_a, d_a), math.nan, dtype=dtype),
                    torch.full((d_g, d_g), math.nan, dtype=dtype),
                    torch.zeros(d_a, d_a, dtype=dtype), torch.zeros(d_g, d_g, dtype=dtype))
        samples = n / per_sample
        A_new = a.T @ a / n
        G_new = (g.T @ g) * samples
        A_tol = 2 * gam * (a.abs().T @ a.abs()) / n + 2 * u * A_new.abs()
        G_tol = 2 * gam * (g.abs().T @ g.abs()) * samples + 2 * u * G_new.abs()
        return A_new, G_new, A_tol, G_tol

    def _ema_update(self, name, new, expert):
        """K-FAC's EMA A <- beta A + (1 - beta) A_new, the first update taking A_new, with its
        bound. A stack's experts each on their own: one without rows this step (NaN A_new)
        keeps its factors (the identity before its first rows), its first rows set them."""
        A_new, G_new, A_tol, G_tol = new
        old = self._ema.get(name)
        if expert is None:
            if old is None:
                return new
            return self._ema_step(old, new)
        E = A_new.shape[0]
        fresh = ~torch.isnan(A_new.reshape(E, -1)[:, 0])
        seen = self._seen.get(name, torch.zeros(E, dtype=torch.bool))
        old = old or self._identity(name)
        ema = self._ema_step(old, new)
        pick = []
        for prev, avg, taken in zip(old, ema, new):
            choose = torch.where(seen.view(-1, 1, 1), avg, taken)
            pick.append(torch.where(fresh.view(-1, 1, 1), choose, prev))
        self._seen[name] = seen | fresh
        return tuple(pick)

    def _ema_step(self, old, new):
        (A0, G0, At0, Gt0), (A_new, G_new, A_tol, G_tol) = old, new
        b, u = self.decay, torch.finfo(A_new.dtype).eps / 2
        A, G = b * A0 + (1 - b) * A_new, b * G0 + (1 - b) * G_new
        A_tol = b * At0 + (1 - b) * A_tol + 4 * u * (b * A0.abs() + A_new.abs())
        G_tol = b * Gt0 + (1 - b) * G_tol + 4 * u * (b * G0.abs() + G_new.abs())
        return A, G, A_tol, G_tol

    def _identity(self, name):
        """K-FAC's initial factors (I, I), exact: bound 0; a stack of E (I, I)."""
        module = self.modules[name]
        stack = None
        if name in self.fused:
            weight = getattr(module, self.fused[name][1])
            stack, rows, cols = weight.shape
            d_out, d_in = (cols, rows) if module.is_transposed else (rows, cols)
        elif isinstance(module, Conv1D):
            d_in, d_out = module.weight.shape
        else:
            d_out, d_in = module.weight.shape[0], module.weight[0].numel()
        d_in += int(self._has_bias(name))
        dtype = torch.promote_types(_weight_dtype(self, name), torch.float32)
        A, G = torch.eye(d_in, dtype=dtype), torch.eye(d_out, dtype=dtype)
        if stack is not None:
            A, G = A.expand(stack, d_in, d_in).clone(), G.expand(stack, d_out, d_out).clone()
        return A, G, torch.zeros_like(A), torch.zeros_like(G)


def _weight_dtype(observer, name):
    """The dtype of layer ``name``'s weight."""
    module = observer.modules[name]
    weight = getattr(module, observer.fused[name][1]) if name in observer.fused else module.weight
    return weight.dtype


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


