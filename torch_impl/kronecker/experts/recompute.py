r"""One call's rows of a transformers fused experts module, recomputed with the arithmetic its
forward ran (:mod:`.arithmetic`): the rows each projection's product multiplied and the
gradient of that product's result, for a group of routed pairs.

The recompute follows the forward's *structure* as well as its dtypes, because rounding
depends on it: a CPU matrix product of 5 rows is not the same rows of a product of 40 to the
last bit, nor is an elementwise float32 gate on a 5-row chunk the same gate on the whole
(vectorised and scalar tails round differently). When the forward multiplied one expert's
matrix at a time (transformers' eager loop over the experts that got pairs, in ascending
order, each expert's pairs in the loop's order: slot-major), every step here runs per expert
on that expert's pairs in that order; when it multiplied a stack (``grouped_mm``,
``batched_mm``), the gate, the norm and the weighting run on all pairs at once and each
expert's product on its pairs. The products run with autocast off in the dtype observed
(the dtype the forward's kernel ran in), the gate and the norm under the forward's autocast
state (the caller's). The a rows are the rows each product multiplied, except where autocast
cast them to its dtype: then the rows before its cast, as for every layer under autocast.
"""
import torch

__all__ = ["Linear", "ByExpert", "group_rows", "eager_order", "in_pair_order"]


def _product(rows, weight, bias, transposed, product):
    """rows @ W (+ b) as the forward formed it (:class:`~.arithmetic.Product`): the product
    in its dtype, the bias added in the dtype it entered the add with (``addmm``'s when the
    product added it), the sum rounded to h's dtype (an in-place add's)."""
    w = weight.to(product.dtype)
    w = w if transposed else w.T
    if bias is not None and product.fused:
        return torch.addmm(bias.to(product.bias), rows, w)
    y = rows @ w
    return y if bias is None else (y + bias.to(product.bias)).to(product.out)


def _input_grad(g, weight, transposed, product):
    """dL/drows = dL/d(rows @ W) W^T, in the product's dtype (its backward's)."""
    w = weight.to(product.dtype)
    return g @ (w.T if transposed else w)


class Linear:
    """One expert's projection: ``forward(rows)`` its h, ``input_grad(g)`` its backward."""

    def __init__(self, projection, product, e):
        self.weight = projection.weight.detach()[e]
        bias = projection.bias
        self.bias = None if bias is None else bias.detach()[e]
        self.transposed, self.product = projection.transposed, product

    def forward(self, rows):
        return _product(rows, self.weight, self.bias, self.transposed, self.product)

    def input_grad(self, g):
        return _input_grad(g, self.weight, self.transposed, self.product)


class ByExpert:
    """A projection over all pairs: each expert's product on its pairs (a contiguous run of
    the pairs sorted by expert, ``order``, ``counts``), put back in the pairs' order."""

    def __init__(self, projection, product, order, counts):
        self.experts = [Linear(projection, product, e) if n else None
                        for e, n in enumerate(counts)]
        self.order, self.counts = order, counts

    def _each(self, rows, fn):
        parts, start = [], 0
        for linear, n in zip(self.experts, self.counts):
            if n:
                parts.append(fn(linear, rows[self.order[start:start + n]]))
            start += n
        if not parts:
            return rows.new_zeros(0, 0)
        sorted_out = torch.cat(parts)
        out = sorted_out.new_empty(sorted_out.shape)
        out[self.order] = sorted_out
        return out

    def forward(self, rows):
        return self._each(rows, lambda linear, r: linear.forward(r))

    def input_grad(self, g):
        return self._each(g, lambda linear, r: linear.input_grad(r))


def _statistic_rows(rows, product):
    """The a rows a projection's statistics take: the rows the product multiplied, but where
    autocast cast them to its dtype, the rows before that cast (every layer's convention
    under autocast: an ``nn.Linear``'s statistics read its input, not autocast's copy)."""
    device = rows.device.type
    if torch.is_autocast_enabled(device) and product.dtype == torch.get_autocast_dtype(device):
        return rows
    return rows.to(product.dtype)


def eager_order(expert, slot, token, n_pairs):
    """The pairs sorted as transformers' eager loop visits them: by expert, then slot, then
    token (``torch.where`` over each expert's (slot, token) mask)."""
    return torch.argsort((expert * n_pairs + slot) * n_pairs + token)


def group_rows(module, arithmetic, names, x, weights, g_out, up, down):
    """``[(a_up, g_up), (a_down, g_down)]`` of a group of pairs (module docstring).

    ``x``: the pairs' input rows (the module's); ``weights``: (n, 1) their routing weights;
    ``g_out``: the output's gradient at their tokens; ``up``, ``down``: a :class:`Linear`
    (one expert's pairs) or :class:`ByExpert` (all pairs). Runs under the forward's autocast
    state, which decides the a rows' convention (:func:`_statistic_rows`)."""
    p_up, p_down = arithmetic.products[names[0]], arithmetic.products[names[1]]
    device = x.device.type
    a_up = _statistic_rows(x, p_up)
    with torch.autocast(device, enabled=False):
        h = up.forward(x.to(p_up.dtype))
    with torch.enable_grad():
        h = h.requires_grad_()
        a2 = module._apply_gate(h) if module.has_gate else module.act_fn(h)
        a_down = _statistic_rows(a2.detach(), p_down)
        with torch.autocast(device, enabled=False):
            y = down.forward(a2.detach().to(p_down.dtype))
        y = y.requires_grad_()
        z = module.post_expert_norm(y) if module.has_post_expert_norm else y
        # the weighted outputs' gradient: the output's, rounded to the accumulator the
        # forward summed them in, then to the weighted product's dtype; times the weight
        weighted = torch.promote_types(z.dtype, weights.dtype)
        g_w = g_out.to(arithmetic.accumulator).to(weighted)
        g_z = (g_w * weights.to(weighted)).to(z.dtype)
        if z is not y:  # dL/dy through the norm applied after each expert
            (g_z,) = torch.autograd.grad(z, y, g_z)
        g_y = g_z.to(p_down.dtype)  # the bias add's backward: the product's dtype
        with torch.autocast(device, enabled=False):  # dL/da2 = dL/dy W_down, then the gate's
            g_a2 = down.input_grad(g_y)
        (g_h,) = torch.autograd.grad(a2, h, g_a2.to(a2.dtype))
    return [(a_up, g_h.detach().to(p_up.dtype)), (a_down, g_y.detach())]


def in_pair_order(groups, n_pairs):
    """The rows of the groups ``[(pair indices, group_rows(...))]`` put back in the pairs'
    order: ``[(a, g)]`` per projection, each (n_pairs, d)."""
    rows = []
    for projection in range(2):
        out = []
        for side in range(2):
            pieces = [(pick, part[projection][side]) for pick, part in groups]
            if not pieces:
                out.append(torch.zeros(n_pairs, 0))
                continue
            first = pieces[0][1]
            whole = first.new_empty((n_pairs,) + tuple(first.shape[1:]))
            for pick, piece in pieces:
                whole[pick] = piece
            out.append(whole)
        rows.append(tuple(out))
    return rows
