r"""MKOR rank-1 statistics in PyTorch (spec MKOR.md K3, K4, K6).

MKOR keeps one vector per Kronecker factor: the batch mean of the rows, so that
A ~ a_bar a_bar^T and G ~ g_bar g_bar^T (K6). These pure functions mirror the NumPy
oracle ``reference/mkor/vectors.py`` function for function.

For gradient accumulation the hooks need the statistics in *additive* form, so each
vector is also exposed as a sum over rows plus a row count:

* ``a_bar = a_sum / n``  with ``a_sum = sum_i [a_i | 1]`` over every captured row;
* ``g_bar = g_sum``      with ``g_sum = sum_i g_i`` (Linear) or ``(1/L) sum_{b,l} g_{b,l}``
  (Conv2d), the gradient of whatever loss was back-propagated.

With a mean-reduced loss divided by the number of micro-batches (the usual
accumulation recipe), summing these over micro-batches gives exactly the full-batch
vectors of the oracle.
"""
import torch
import torch.nn.functional as F

__all__ = [
    "row_sum", "expert_row_sum", "input_row_sum", "grad_row_sum",
    "linear_input_sum", "linear_grad_sum", "linear_rank1_vectors",
    "unfold2d", "conv2d_input_sum", "conv2d_grad_sum", "conv2d_rank1_vectors",
]


def _rows(x):
    """(..., d) -> (N, d): every leading dimension becomes a row (K3)."""
    return x.reshape(-1, x.shape[-1])


def _with_one(v, count):
    """[v | count]: the bias column's input is 1 in every row, so its sum is the count."""
    return torch.cat([v, v.new_full((1,), float(count))])


def row_sum(rows, mask=None):
    r"""(sum of the selected rows, their number) of ``rows`` (*lead, d); ``mask`` (a bool
    tensor of shape ``lead``, or None for all rows) selects real tokens. Masked rows are
    replaced by 0 before summing (not multiplied), so their values cannot leak, even if
    they are not finite. The count is an int, or a 0-d tensor with a mask (no host sync)."""
    lead = tuple(range(rows.dim() - 1))
    if mask is None:
        return rows.sum(dim=lead), rows[..., 0].numel()
    return torch.where(mask.unsqueeze(-1), rows, 0).sum(dim=lead), mask.sum()


def expert_row_sum(rows, mask, experts, num_experts):
    r"""Per-expert :func:`row_sum` of routed rows (S, d), ``experts`` (S,) each row's expert:
    ((E, d) sums, (E,) counts), expert e's the sum and number of the selected rows routed to
    it (zeros and 0 for an expert routed none). One ``index_add_`` each: no loop over the
    experts, no host sync."""
    kept = rows if mask is None else torch.where(mask.unsqueeze(-1), rows, 0)
    total = rows.new_zeros(num_experts, rows.shape[-1]).index_add_(0, experts, kept)
    ones = (torch.ones_like(experts) if mask is None else mask.long())
    count = torch.zeros(num_experts, dtype=torch.long, device=rows.device).index_add_(
        0, experts, ones)
    return total, count


def input_row_sum(rows, mask, has_bias, experts=None, num_experts=None):
    r"""Additive input statistic of any layer type: (sum_i [a_i | 1], N) over its rows; for
    a stack of experts (``experts``: each row's expert) the (E, d_in') sums and (E,) counts."""
    if experts is not None:
        total, n = expert_row_sum(rows, mask, experts, num_experts)
        if not has_bias:
            return total, n
        return torch.cat([total, n.unsqueeze(-1).to(total.dtype)], dim=-1), n
    total, n = row_sum(rows, mask)
    if not has_bias:
        return total, n
    ones = (total.new_full((1,), float(n)) if not isinstance(n, torch.Tensor)
            else n.reshape(1).to(total.dtype))
    return torch.cat([total, ones]), n


def grad_row_sum(rows, mask, rows_per_sample, experts=None, num_experts=None):
    r"""Additive output-gradient statistic: (sum_i g_i / r, N / r), r rows per sample, so
    g_bar = sum_i g_i for Linear (K6) and (1/L) sum_{b,l} g_{b,l} for Conv2d (K4); per expert
    for a stack of experts (one row per routed pair, r = 1)."""
    if experts is not None:
        return expert_row_sum(rows, mask, experts, num_experts)
    total, n = row_sum(rows, mask)
    if rows_per_sample == 1:
        return total, n
    return total / rows_per_sample, n / rows_per_sample


def linear_input_sum(a, has_bias):
    r"""Additive input statistic of a Linear layer: (sum_i [a_i | 1], N)."""
    rows = _rows(a)
    total = rows.sum(dim=0)
    n = rows.shape[0]
    return (_with_one(total, n) if has_bias else total), n


def linear_grad_sum(g_out):
    r"""Additive output-gradient statistic of a Linear layer: sum_i g_i = dloss/db (K6)."""
    return _rows(g_out).sum(dim=0)


def linear_rank1_vectors(a, g_out, has_bias):
    r"""Rank-1 vectors of a Linear layer (K3, K6), mirroring the oracle.

    .. math::
        \bar a = \tfrac1N \sum_i [a_i \,|\, 1], \qquad
        \bar g = \tfrac1N \sum_i (N g_i) = \sum_i g_i = \partial\ell/\partial b.
    """
    if _rows(a).shape[0] != _rows(g_out).shape[0]:
        raise ValueError("a and g_out have different numbers of rows")
    a_sum, n = linear_input_sum(a, has_bias)
    return a_sum / n, linear_grad_sum(g_out)


def unfold2d(x, kernel_size, dilation=1, padding=0, stride=1):
    r"""im2col with ``F.unfold``'s layout: (B, C, H, W) -> (B, C*kh*kw, H'*W') (K4).

    Entry ``c*kh*kw + i*kw + j`` of a column is channel c, kernel tap (i, j): the layout
    of a conv weight reshaped to (C_out, C_in*kh*kw).
    """
    return F.unfold(x, kernel_size, dilation=dilation, padding=padding, stride=stride)


def conv2d_input_sum(x, kernel_size, stride, padding, dilation, has_bias):
    r"""Additive input statistic of a Conv2d: (sum_b mean_l [P_b[:, l] | 1], B)."""
    patches = unfold2d(x, kernel_size, dilation=dilation, padding=padding, stride=stride)
    batch = patches.shape[0]
    total = patches.mean(dim=2).sum(dim=0)
    return (_with_one(total, batch) if has_bias else total), batch


def conv2d_grad_sum(g_out):
    r"""Additive output-gradient statistic of a Conv2d: (1/L) sum_{b,l} g_b[:, l] (K4)."""
    return g_out.flatten(2).mean(dim=2).sum(dim=0)


def conv2d_rank1_vectors(x, g_out, kernel_size, stride, padding, dilation, has_bias):
    r"""Rank-1 vectors of a Conv2d layer (K4, K6), mirroring the oracle.

    .. math::
        \bar a = \tfrac1B \sum_b \tfrac1L \sum_l [P_b[:, l] \,|\, 1], \qquad
        \bar g = \tfrac1B \sum_b \tfrac1L \sum_l B\, g_b[:, l]
               = \tfrac1L \sum_{b,l} g_b[:, l] = (\partial\ell/\partial b) / L.
    """
    a_sum, batch = conv2d_input_sum(x, kernel_size, stride, padding, dilation, has_bias)
    if g_out.shape[0] != batch:
        raise ValueError("g_out batch size does not match x")
    return a_sum / batch, conv2d_grad_sum(g_out)
