r"""K-FAC in every flavour (issue 46; labels KC1-KC5 of ``tools/issue46_conventions``, the
oracle ``reference/baselines/kfac_flavours.py``): which loss-side columns are back-propagated
(``fisher_type``) and how a layer's rows shared by one sample are combined (``kfac_approx``).

For ``loss_func(model(inputs), targets)`` with ``loss_func`` a ``torch.nn.MSELoss`` or
``CrossEntropyLoss`` (reduction "mean" or "sum"), let f_n be the output at data point n and
ℓ_n its unreduced loss, L = R Σ_n ℓ_n (R: 1 for "sum"; for "mean" 1 / (counted positions)
for the cross-entropy and 1 / numel(output) for MSE, as torch divides). The *columns* of a
data point are vectors over its C outputs, back-propagated to every layer output:

* ``"empirical"``: one column, ∇_f ℓ_n at the data's own target;
* ``"type-2"`` (KC2): the C columns of a square root S_n of the loss Hessian H_n = S_n S_nᵀ:
  CE, S = diag(√p) - p √pᵀ (column c = √p_c (e_c - p)); MSE (ℓ = Σ_c (f - y)²), S = √2 I;
* ``"mc"`` (KC3): M columns ∇_f ℓ_n(ỹ_m) / √M with ỹ_m drawn from the *model's* predictive
  distribution (CE: categorical softmax(f); MSE: ỹ = f + ε/√2, ε ~ N(0, I)), from a
  ``torch.Generator``.

With the layer's input rows a (a trailing 1 for a bias) and its output-gradient rows g_c of
column c, at the S positions s that share the weight within a sample n (tokens; a Conv2d's L
patches; S = 1 for rows (N, d)):

* ``"expand"`` (KC4): A = (1/(N S)) Σ_{n,s} a aᵀ, G = R Σ_{n,s,c} g gᵀ;
* ``"reduce"`` (KC5): ā_n = (1/S) Σ_s a_{ns}, ĝ_{nc} = Σ_s g_{nsc}; A = (1/N) Σ_n ā ā ᵀ,
  G = R Σ_{n,c} ĝ ĝᵀ.

so that ``torch.kron(G, A)`` approximates the layer's block of the GGN (type-2), the Fisher
(mc) or the empirical Fisher (empirical) with respect to [W | b] flattened row-major (KC1).
:func:`kfac_factors` computes them for every layer :class:`~.kfac.KFAC` preconditions; the
optimizer takes the same options (``fisher_type``, ``kfac_approx``, and
:meth:`~.kfac.KFAC.curvature_backward`).
"""
import math

import torch
import torch.nn as nn

from ..common.validation import check_choice, check_int
from ..kronecker.discovery import discover, unwrap_model
from .kfac_equations import grad_stat, input_stat

__all__ = ["FISHER_TYPES", "KFAC_APPROXES", "check_flavour", "check_loss", "reduction_factor",
           "kfac_columns", "reduce_input_stat", "reduce_grad_stat", "kfac_factors"]

FISHER_TYPES = ("empirical", "mc", "type-2")
KFAC_APPROXES = ("expand", "reduce")


def check_flavour(fisher_type, kfac_approx, mc_samples, generator):
    """Named ValueErrors for the flavour options (torch.optim's convention)."""
    check_choice("fisher_type", fisher_type, FISHER_TYPES)
    check_choice("kfac_approx", kfac_approx, KFAC_APPROXES)
    check_int("mc_samples", mc_samples, low=1)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator: expected a torch.Generator or None, got {generator!r}")


def check_loss(loss_func):
    """"mse" or "ce" for a loss whose columns are known exactly; ValueError otherwise (a
    subclass may compute anything, and the options below change the Hessian)."""
    if type(loss_func) is nn.MSELoss:
        kind = "mse"
    elif type(loss_func) is nn.CrossEntropyLoss:
        kind = "ce"
        if loss_func.label_smoothing != 0.0:
            raise ValueError("loss_func: CrossEntropyLoss label_smoothing "
                             f"{loss_func.label_smoothing} is not supported (its Hessian is "
                             "not the softmax's); use label_smoothing=0")
        if loss_func.weight is not None:
            raise ValueError("loss_func: CrossEntropyLoss weight (class weights) is not "
                             "supported: the weighted loss's Hessian is not implemented")
    else:
        raise ValueError("loss_func: expected a torch.nn.MSELoss or torch.nn.CrossEntropyLoss "
                         f"(their columns are known exactly), got {type(loss_func).__name__}")
    if loss_func.reduction not in ("mean", "sum"):
        raise ValueError(f"loss_func: reduction {loss_func.reduction!r} is not supported: "
                         "expected 'mean' or 'sum' (one scalar loss)")
    return kind


def _class_dim(output):
    return 1 if output.dim() >= 2 else 0


def _ce_keep(loss_func, output, targets):
    """The counted positions of a cross-entropy (targets != ignore_index), shaped like the
    targets; class-index targets only."""
    if targets.is_floating_point() or targets.is_complex():
        raise ValueError("targets: class-probability targets of CrossEntropyLoss are not "
                         "supported; expected class indices")
    want = output.shape[:_class_dim(output)] + output.shape[_class_dim(output) + 1:]
    if tuple(targets.shape) != tuple(want):
        raise ValueError(f"targets: expected shape {tuple(want)} for output "
                         f"{tuple(output.shape)}, got {tuple(targets.shape)}")
    return targets != loss_func.ignore_index


def reduction_factor(loss_func, output, targets):
    """R of ``loss_func(output, targets)`` = R Σ_n ℓ_n: 1 for "sum"; for "mean" 1/numel for
    MSE and 1/(positions whose target is not ignore_index) for CE (a 0-d tensor: no host
    sync)."""
    kind = check_loss(loss_func)
    if kind == "mse":
        if tuple(targets.shape) != tuple(output.shape):
            raise ValueError(f"targets: expected the output's shape {tuple(output.shape)} "
                             f"(no broadcasting), got {tuple(targets.shape)}")
        return 1.0 if loss_func.reduction == "sum" else 1.0 / output.numel()
    keep = _ce_keep(loss_func, output, targets)
    if loss_func.reduction == "sum":
        return 1.0
    return 1.0 / keep.sum().to(torch.promote_types(output.dtype, torch.float32))


def _one_hot(index, like, cdim):
    """A one-hot tensor shaped like ``like`` (classes along ``cdim``) from class indices
    shaped like ``like`` without ``cdim`` (out-of-range indices, the ignored ones: clamped,
    their columns are zeroed by the caller)."""
    out = torch.zeros_like(like)
    return out.scatter_(cdim, index.clamp(0, like.shape[cdim] - 1).unsqueeze(cdim), 1.0)


def kfac_columns(loss_func, output, targets, fisher_type, mc_samples=1, generator=None):
    """The columns (KC2/KC3, module docstring) of every data point at once: a list of tensors
    shaped like ``output`` (column k of every data point in the k-th), R not applied,
    zero at positions a cross-entropy ignores. Computed in float32 or wider from
    ``output`` detached, returned in ``output``'s dtype (the gradient it takes)."""
    kind = check_loss(loss_func)
    check_choice("fisher_type", fisher_type, FISHER_TYPES)
    check_int("mc_samples", mc_samples, low=1)
    reduction_factor(loss_func, output, targets)  # shape checks
    f = output.detach().to(torch.promote_types(output.dtype, torch.float32))
    if kind == "mse":
        cols = _mse_columns(f, targets, fisher_type, mc_samples, generator)
    else:
        keep = _ce_keep(loss_func, output, targets).unsqueeze(_class_dim(output))
        cols = [c * keep for c in _ce_columns(f, targets, fisher_type, mc_samples, generator)]
    return [c.to(output.dtype) for c in cols]


def _mse_columns(f, targets, fisher_type, mc_samples, generator):
    # l = sum_c (f - y)^2: gradient 2 (f - y), Hessian 2 I
    if fisher_type == "empirical":
        return [2 * (f - targets.to(f.dtype))]
    if fisher_type == "type-2":
        cols = []
        for c in range(f.shape[-1]):
            col = torch.zeros_like(f)
            col[..., c] = math.sqrt(2.0)
            cols.append(col)
        return cols
    # y~ = f + eps / sqrt(2): 2 (f - y~) = -sqrt(2) eps, each of M samples weighted 1/sqrt(M)
    scale = math.sqrt(2.0 / mc_samples)
    return [-scale * torch.randn(f.shape, generator=generator, dtype=f.dtype, device=f.device)
            for _ in range(mc_samples)]


def _ce_columns(f, targets, fisher_type, mc_samples, generator):
    cdim = _class_dim(f)
    p = torch.softmax(f, dim=cdim)
    if fisher_type == "empirical":  # grad of -log softmax(f)_y = p - e_y
        return [p - _one_hot(targets, p, cdim)]
    if fisher_type == "type-2":  # S = diag(sqrt p) - p sqrt(p)^T: column c = sqrt(p_c)(e_c - p)
        sq = p.sqrt()
        cols = []
        for c in range(p.shape[cdim]):
            col = -p * sq.narrow(cdim, c, 1)
            col.select(cdim, c).add_(sq.select(cdim, c))
            cols.append(col)
        return cols
    # y~ ~ categorical(p) per data point, M draws (one pass over the data points each, in
    # their row-major order); column (p - e_y~) / sqrt(M)
    flat = p.movedim(cdim, -1).reshape(-1, p.shape[cdim])
    shape = p.movedim(cdim, -1).shape[:-1]
    cols = []
    for _ in range(mc_samples):
        draw = torch.multinomial(flat, 1, generator=generator).reshape(shape)
        cols.append((p - _one_hot(draw, p, cdim)) / math.sqrt(mc_samples))
    return cols


def _per_sample(rows, mask):
    """(N, S, d) rows and (N, S) keep weights (or None) from rows (*lead, d): the first
    leading dimension indexes the samples, the others the positions they share (one
    position when rows are (N, d))."""
    lead = rows.shape[:-1]
    if len(lead) == 0:
        rows, lead = rows.unsqueeze(0), (1,)
    n = lead[0]
    r = rows.reshape(n, -1, rows.shape[-1])
    w = None if mask is None else mask.reshape(n, -1)
    return r, w


def _reduce(rows, mask, has_bias, mean):
    """(ā or ĝ (N, d), kept samples): per sample the mean (``mean``) or sum of its kept
    rows, a trailing 1 (0 where a sample has no row) appended with ``has_bias``."""
    rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
    r, w = _per_sample(rows, mask)
    w = r.new_ones(r.shape[:2]) if w is None else w.to(r.dtype)
    total = (r * w.unsqueeze(-1)).sum(1)
    count = w.sum(1)
    if has_bias:
        total = torch.cat([total, count.unsqueeze(-1)], dim=-1)
    if mean:
        total = total / count.clamp(min=1).unsqueeze(-1)
    kept = (count > 0).sum() if mask is not None else r.shape[0]
    return total, kept


def reduce_input_stat(layer, rows, mask, experts=None):
    """KC5's A side of one call: (Σ_n ā_n ā_nᵀ, N) with ā_n the mean of sample n's kept rows
    [a | 1] (the first leading dimension indexes samples) and N the samples with rows; A =
    the sum / N. An identity side stores nothing (the count is kept)."""
    if experts is not None:
        raise ValueError(f"kfac_approx='reduce': {layer.name} is a stack of experts, whose "
                         "routed rows have no per-sample structure")
    a, n = _reduce(rows, mask, layer.has_bias, mean=True)
    return (a.new_zeros(0) if layer.identity_R else a.T @ a), n


def reduce_grad_stat(layer, rows, mask, experts=None):
    """KC5's G side of one call: (Σ_n ĝ_n ĝ_nᵀ, N) with ĝ_n the sum of sample n's kept
    output-gradient rows (the optimizer's empirical G = N x the sum, as expand's is)."""
    if experts is not None:
        raise ValueError(f"kfac_approx='reduce': {layer.name} is a stack of experts")
    g, n = _reduce(rows, mask, False, mean=False)
    return (g.new_zeros(0) if layer.identity_L else g.T @ g), n


# -- the stateless function ----------------------------------------------------------------
class _Calls:
    """Forward hooks recording each call of the discovered layers (removed by ``remove``)."""

    def __init__(self, layers):
        self.calls = {layer.name: [] for layer in layers}
        self.handles = []
        for layer in layers:
            target = layer.module.experts if layer.experts is not None else layer.module
            if layer.experts is not None and any(
                    l.experts is not None and l.module.experts is target and l is not layer
                    for l in layers[:layers.index(layer)]):
                continue  # one hook per experts module, for all its projections
            self.handles.append(target.register_forward_hook(
                self._hook(layer, layers), with_kwargs=True))

    def _hook(self, layer, layers):
        def hook(module, args, kwargs, output):
            if not isinstance(output, torch.Tensor) or not output.requires_grad:
                return
            if layer.experts is None:
                self.calls[layer.name].append((args[0] if args else next(
                    v for v in kwargs.values() if isinstance(v, torch.Tensor)), output, None))
                return
            layout = layer.module.layout
            inputs = layout.bind(module, args, kwargs, layer.module.expert_shard)
            arithmetic = layout.observe(module, inputs)
            for l in layers:
                if l.experts is not None and l.module.experts is module:
                    self.calls[l.name].append((inputs, output, arithmetic))
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []


def _layer_rows(layer, call, grad):
    """(a rows, g rows or None, experts or None) of one call; g from the call output's
    gradient ``grad`` (None: the input rows only)."""
    x, _, arithmetic = call
    m = layer.module
    if layer.experts is None:
        a = layer.type.input_rows(m, x)
        return a, (None if grad is None else layer.type.grad_rows(m, grad)), None
    _, expert, rows = m.layout.rows(m.experts, x, grad, arithmetic, m.expert_shard)
    names = [name for name, _ in m.layout.projections(m.experts)]
    a, g = rows[names.index(m.weight_name)]
    return a, g, expert


def kfac_factors(model, loss_func, inputs, targets, *, fisher_type="type-2",
                 kfac_approx="expand", mc_samples=1, generator=None):
    """``{module name: (A, G)}`` for every layer :class:`~.kfac.KFAC` would precondition
    (its discovery, without size guard): ``torch.kron(G, A)`` is the flavour's approximation
    (module docstring, KC4/KC5) of the block of ``loss_func(model(inputs), targets)``'s
    curvature for [W | b] flattened row-major (KC1). A stack of E fused experts gives (E, d,
    d) stacks: expert e's factors over the rows routed to it (zeros where none).

    Stateless: one forward, one backward per column (``autograd.grad`` to the layers'
    outputs, so no ``.grad`` is touched), hooks removed even on error. ``model(inputs)``
    must return the tensor ``loss_func`` takes. ``generator`` seeds "mc" (default: torch's
    global generator).
    """
    check_flavour(fisher_type, kfac_approx, mc_samples, generator)
    check_loss(loss_func)
    found = discover(unwrap_model(model), (), None, None)
    layers = found.layers
    for layer in layers:
        if layer.kind == "mha_out":
            raise ValueError(f"kfac_factors: {layer.name} is an nn.MultiheadAttention "
                             "out-projection, whose rows the attention kernel computes: not "
                             "supported here")
        if layer.experts is not None and kfac_approx == "reduce":
            raise ValueError(f"kfac_approx='reduce': {layer.name} is a stack of experts, whose "
                             "routed rows have no per-sample structure")
    calls = _Calls(layers)
    try:
        with torch.enable_grad():
            output = model(inputs)
    finally:
        calls.remove()
    if not isinstance(output, torch.Tensor):
        raise ValueError(f"model(inputs): expected the tensor loss_func takes, got "
                         f"{type(output).__name__} (wrap the model to return it)")
    missing = [l.name for l in layers if not calls.calls[l.name]]
    if missing:
        raise ValueError(f"kfac_factors: the layers {missing} were not called with grad by "
                         "model(inputs)")
    R = reduction_factor(loss_func, output, targets)
    columns = kfac_columns(loss_func, output, targets, fisher_type, mc_samples, generator)
    A = {l.name: _input_factor(l, calls.calls[l.name], kfac_approx) for l in layers}
    G = {l.name: None for l in layers}
    # every call's output once (an experts module's is shared by its projections)
    unique = list({id(c[1]): c[1] for l in layers for c in calls.calls[l.name]}.values())
    for k, col in enumerate(columns):
        grads = torch.autograd.grad(output, unique, grad_outputs=col,
                                    retain_graph=k < len(columns) - 1, allow_unused=True)
        by_id = {id(t): g for t, g in zip(unique, grads)}
        for layer in layers:
            per_call = [_layer_rows(layer, c, _zero_if_none(by_id[id(c[1])], c[1]))
                        for c in calls.calls[layer.name]]
            if A[layer.name] is None:  # experts: the rows come with a gradient
                A[layer.name] = _expert_input_factor(layer, per_call)
            stat = _grad_sum(layer, per_call, kfac_approx)
            G[layer.name] = stat if G[layer.name] is None else G[layer.name] + stat
    del output, columns, unique  # the graph goes with them
    return {l.name: (A[l.name], G[l.name] * R) for l in layers}


def _zero_if_none(grad, output):
    return torch.zeros_like(output) if grad is None else grad


def _input_factor(layer, calls, kfac_approx):
    """A over every call's rows (KC4) or their per-sample means (KC5: each sample's rows of
    all calls together)."""
    with torch.no_grad():
        rows = [_layer_rows(layer, c, None) if layer.experts is None else None for c in calls]
        if layer.experts is None and kfac_approx == "expand":
            total, n = 0, 0
            for a, _, _ in rows:
                s, k = input_stat(layer, a.detach(), None)
                total, n = total + s, n + k
            return total / n
        if layer.experts is None:
            a = torch.cat([_per_sample(r[0].detach(), None)[0] for r in rows], dim=1)
            s, n = reduce_input_stat(layer, a, None)
            return s / n
        return None  # experts: A comes with the rows recomputed from a gradient (below)


def _expert_input_factor(layer, per_call):
    """(E, d, d): each expert's A over its routed rows of every call (zero without rows)."""
    with torch.no_grad():
        total, n = 0, 0
        for a, _, e in per_call:
            s, k = input_stat(layer, a.detach(), None, experts=e)
            total, n = total + s, n + k
        return total / n.clamp(min=1)[:, None, None]


def _grad_sum(layer, per_call, kfac_approx):
    """Σ g gᵀ (expand) or Σ_n ĝ ĝᵀ (reduce) of one column's rows over every call."""
    with torch.no_grad():
        if layer.experts is not None:
            return sum(grad_stat(layer, g.detach(), None, experts=e)[0] for _, g, e in per_call)
        if kfac_approx == "expand":
            return sum(grad_stat(layer, g.detach(), None)[0] for _, g, _ in per_call)
        g = torch.cat([_per_sample(g.detach(), None)[0] for _, g, _ in per_call], dim=1)
        return reduce_grad_stat(layer, g, None)[0]
