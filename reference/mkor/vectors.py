"""MKOR rank-1 statistics, NumPy float64 (spec MKOR.md section 2.1, K3, K4, K6).

MKOR never forms the Kronecker factors A = E[a a^T] or G = E[g g^T]. It keeps one
vector per factor, the batch mean of the rows, so that A ~ a_bar a_bar^T and
G ~ g_bar g_bar^T (K6). This module turns a layer's input and output gradient into
those two vectors.

Conventions, matching the paper and the released code:

* ``a`` is the layer input, ``g_out`` the gradient of the *mean-reduced* loss with
  respect to the layer output. Both arrive with any leading dimensions.
* Rows of g are multiplied by the number of rows N (Linear) or by the batch size B
  (Conv2d), undoing the loss's 1/N, so that g_bar is a per-sample quantity (K3, K4).
* The released code's clamp to +-100 and fp16 cast (K5) are numerical safety nets of
  its fp16 pipeline; this float64 oracle leaves them out.
"""
import numpy as np


def _pair(x):
    """An int or a pair, as torch's ``_pair``: 3 -> (3, 3)."""
    if np.ndim(x) == 0:
        return int(x), int(x)
    first, second = x
    return int(first), int(second)


def _rows(x):
    """Flatten every leading dimension into rows: (..., d) -> (N, d)."""
    x = np.asarray(x, dtype=np.float64)
    return x.reshape(-1, x.shape[-1])


def _append_one(vector):
    """[v | 1]: the bias is a weight column whose input is always 1 (d_in' = d_in + 1)."""
    return np.concatenate([vector, np.ones(1)])


def linear_rank1_vectors(a, g_out, has_bias):
    r"""Rank-1 vectors of a Linear layer (K3, K6).

    With rows a_i (i = 1..N, N = product of the leading dims) and rows g_i of the
    gradient of the mean-reduced loss:

        a_bar = (1/N) sum_i [a_i | 1]          (the 1 only with a bias)
        g_bar = (1/N) sum_i (N g_i) = sum_i g_i = dloss/db

    so g_bar equals the bias gradient (K6).

    Args:
        a: layer input, shape (..., d_in).
        g_out: gradient of the loss w.r.t. the layer output, shape (..., d_out).
        has_bias: whether the layer has a bias (appends the trailing 1 to a_bar).

    Returns:
        (a_bar, g_bar): 1-D arrays of length d_in' and d_out.
    """
    a_rows, g_rows = _rows(a), _rows(g_out)
    if a_rows.shape[0] != g_rows.shape[0]:
        raise ValueError(f"a has {a_rows.shape[0]} rows but g_out has {g_rows.shape[0]}")
    n = a_rows.shape[0]
    a_bar = a_rows.mean(axis=0)
    if has_bias:
        a_bar = _append_one(a_bar)
    g_bar = (n * g_rows).mean(axis=0)
    return a_bar, g_bar


def unfold2d(x, kernel_size, dilation=1, padding=0, stride=1):
    r"""im2col with ``torch.nn.functional.unfold``'s layout (used by K4).

    Output column l holds the patch under output position l (row-major over
    (H', W')); within a column the entries run channel-major, then kernel row, then
    kernel column, i.e. index c*kh*kw + i*kw + j. That is the layout of a conv weight
    (C_out, C_in, kh, kw) reshaped to (C_out, C_in*kh*kw), so conv = W_flat @ cols.

        H' = floor((H + 2 p_h - d_h (kh - 1) - 1) / s_h) + 1, and likewise W'.

    Args:
        x: input, shape (B, C, H, W).
        kernel_size, dilation, padding, stride: ints or pairs, as torch.

    Returns:
        Array of shape (B, C*kh*kw, H'*W').
    """
    x = np.asarray(x, dtype=np.float64)
    (kh, kw), (dh, dw) = _pair(kernel_size), _pair(dilation)
    (ph, pw), (sh, sw) = _pair(padding), _pair(stride)
    batch, channels, height, width = x.shape
    out_h = (height + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    out_w = (width + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    if out_h <= 0 or out_w <= 0:
        raise ValueError("kernel larger than the padded input")
    padded = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    cols = np.empty((batch, channels, kh, kw, out_h, out_w))
    for i in range(kh):
        for j in range(kw):
            # Kernel tap (i, j) sees a strided sub-grid of the padded input.
            top, left = i * dh, j * dw
            cols[:, :, i, j] = padded[:, :, top:top + sh * (out_h - 1) + 1:sh,
                                      left:left + sw * (out_w - 1) + 1:sw]
    return cols.reshape(batch, channels * kh * kw, out_h * out_w)


def conv2d_rank1_vectors(x, g_out, kernel_size, stride, padding, dilation, has_bias):
    r"""Rank-1 vectors of a Conv2d layer (K4, K6).

    With patches P_b = unfold(x_b) in R^{(C_in kh kw) x L} and output gradients
    g_b in R^{C_out x L} (L = H' W' positions, B samples):

        a_bar = (1/B) sum_b (1/L) sum_l [P_b[:, l] | 1]
        g_bar = (1/B) sum_b (1/L) sum_l B g_b[:, l] = (1/L) sum_{b,l} g_b[:, l]

    so g_bar is the bias gradient divided by L.

    Args:
        x: input, shape (B, C_in, H, W).
        g_out: gradient of the mean-reduced loss w.r.t. the output, (B, C_out, H', W').
        kernel_size, stride, padding, dilation: ints or pairs, as ``nn.Conv2d``.
        has_bias: append the trailing 1 to a_bar.

    Returns:
        (a_bar, g_bar) of lengths C_in*kh*kw (+1 with a bias) and C_out.
    """
    patches = unfold2d(x, kernel_size, dilation=dilation, padding=padding, stride=stride)
    g_out = np.asarray(g_out, dtype=np.float64)
    batch = patches.shape[0]
    if g_out.shape[0] != batch or g_out.shape[2] * g_out.shape[3] != patches.shape[2]:
        raise ValueError(f"g_out shape {g_out.shape} does not match the unfolded input")
    a_bar = patches.mean(axis=(0, 2))
    if has_bias:
        a_bar = _append_one(a_bar)
    g_positions = g_out.reshape(batch, g_out.shape[1], -1)
    g_bar = (batch * g_positions).mean(axis=(0, 2))
    return a_bar, g_bar
