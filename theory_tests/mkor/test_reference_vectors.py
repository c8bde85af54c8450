"""Rank-1 vectors and im2col of the NumPy MKOR reference (KT8; K3, K4, K6).

Oracles are independent: a hand-derived gradient checked by central differences, and
a loop-based patch extraction / convolution.
"""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from theory_tests.support.mkor_cases import EPS, seeds
from reference.mkor.preconditioner import conv2d_rank1_vectors, linear_rank1_vectors, unfold2d


def mse_loss(W, b, a, target):
    """Mean over rows of 0.5 ||a_i W^T + b - t_i||^2 (a mean-reduced loss)."""
    y = a @ W.T + b
    return 0.5 * np.mean(np.sum((y - target) ** 2, axis=-1))


@given(seed=seeds, lead=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       d_in=st.integers(1, 6), d_out=st.integers(1, 6))
def test_linear_vectors_are_row_mean_and_bias_gradient(seed, lead, d_in, d_out):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(*lead, d_in))
    target = rng.normal(size=(*lead, d_out))
    W, b = rng.normal(size=(d_out, d_in)), rng.normal(size=d_out)
    n = int(np.prod(lead))
    # dloss/dy for the mean-reduced loss above, derived by hand: (y - t) / N.
    g_out = (a @ W.T + b - target) / n
    a_bar, g_bar = linear_rank1_vectors(a, g_out, has_bias=True)
    rows = a.reshape(n, d_in)
    np.testing.assert_allclose(a_bar[:-1], rows.mean(axis=0), rtol=0, atol=10 * n * EPS * np.abs(rows).max())
    assert a_bar[-1] == 1.0 and a_bar.shape == (d_in + 1,)
    # g_bar equals the bias gradient; check it by central differences, exact up to
    # rounding for a quadratic loss: error ~ eps |loss| / h, with h = 1e-4.
    h = 1e-4
    fd = np.array([(mse_loss(W, b + h * e, a, target) - mse_loss(W, b - h * e, a, target)) / (2 * h)
                   for e in np.eye(d_out)])
    loss_scale = 1 + mse_loss(W, b, a, target)
    np.testing.assert_allclose(g_bar, fd, rtol=0, atol=100 * EPS * loss_scale / h)
    a_plain, g_plain = linear_rank1_vectors(a, g_out, has_bias=False)
    np.testing.assert_array_equal(a_plain, a_bar[:-1])
    np.testing.assert_array_equal(g_plain, g_bar)


def test_linear_vectors_reject_mismatched_rows():
    with pytest.raises(ValueError):
        linear_rank1_vectors(np.ones((3, 2)), np.ones((4, 2)), has_bias=False)


def loop_patches(x, k, stride, padding, dilation):
    """Direct patch extraction: column l = (oh, ow) row-major, entries (c, i, j)."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = k, stride, padding, dilation
    B, C, H, W = x.shape
    xp = np.zeros((B, C, H + 2 * ph, W + 2 * pw))
    xp[:, :, ph:ph + H, pw:pw + W] = x
    out_h = (H + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    out_w = (W + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    cols = np.zeros((B, C * kh * kw, out_h * out_w))
    for bi in range(B):
        for oh in range(out_h):
            for ow in range(out_w):
                column = [xp[bi, c, oh * sh + i * dh, ow * sw + j * dw]
                          for c in range(C) for i in range(kh) for j in range(kw)]
                cols[bi, :, oh * out_w + ow] = column
    return cols, out_h, out_w


def loop_conv(x, weight, bias, stride, padding, dilation):
    """Convolution by explicit sums over (c, i, j), no im2col."""
    C_out, C, kh, kw = weight.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    B, _, H, W = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    out_h = (H + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    out_w = (W + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    y = np.zeros((B, C_out, out_h, out_w)) + bias[None, :, None, None]
    for i in range(kh):
        for j in range(kw):
            window = xp[:, :, i * dh:i * dh + sh * (out_h - 1) + 1:sh, j * dw:j * dw + sw * (out_w - 1) + 1:sw]
            y += np.einsum("bchw,oc->bohw", window, weight[:, :, i, j])
    return y


conv_geometry = st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 2), st.integers(1, 2),
                          st.integers(0, 2), st.integers(0, 1), st.integers(1, 2), st.integers(1, 2))


@given(seed=seeds, geometry=conv_geometry, B=st.integers(1, 3), C=st.integers(1, 3))
def test_unfold_matches_loop_patches(seed, geometry, B, C):
    kh, kw, sh, sw, ph, pw, dh, dw = geometry
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, C, 7, 6))
    cols = unfold2d(x, (kh, kw), dilation=(dh, dw), padding=(ph, pw), stride=(sh, sw))
    expected, _, _ = loop_patches(x, (kh, kw), (sh, sw), (ph, pw), (dh, dw))
    np.testing.assert_array_equal(cols, expected)  # pure copies: bit-exact


@given(seed=seeds, geometry=conv_geometry, B=st.integers(1, 3), C=st.integers(1, 3),
       C_out=st.integers(1, 3))
def test_conv_vectors_match_loop_oracle(seed, geometry, B, C, C_out):
    kh, kw, sh, sw, ph, pw, dh, dw = geometry
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, C, 7, 6))
    weight, bias = rng.normal(size=(C_out, C, kh, kw)), rng.normal(size=C_out)
    y = loop_conv(x, weight, bias, (sh, sw), (ph, pw), (dh, dw))
    # The weight layout (out, in*kh*kw) contracts with unfold2d's columns (K13).
    cols = unfold2d(x, (kh, kw), dilation=(dh, dw), padding=(ph, pw), stride=(sh, sw))
    via_cols = np.einsum("ok,bkl->bol", weight.reshape(C_out, -1), cols) + bias[None, :, None]
    # Sums of C kh kw products of O(1) normals: error <= C kh kw eps max|term| sum, ~1e-13.
    np.testing.assert_allclose(via_cols.reshape(y.shape), y, rtol=0, atol=1e-12)
    g_out = rng.normal(size=y.shape) / y.size  # any mean-reduced loss gradient
    a_bar, g_bar = conv2d_rank1_vectors(x, g_out, (kh, kw), (sh, sw), (ph, pw), (dh, dw), True)
    patches, out_h, out_w = loop_patches(x, (kh, kw), (sh, sw), (ph, pw), (dh, dw))
    L = out_h * out_w
    np.testing.assert_allclose(a_bar[:-1], patches.mean(axis=(0, 2)), rtol=1e-13, atol=1e-15)
    assert a_bar[-1] == 1.0 and a_bar.shape == (C * kh * kw + 1,)
    # K4: B times the gradient, averaged over positions and batch = bias grad / L.
    bias_grad = g_out.sum(axis=(0, 2, 3))
    np.testing.assert_allclose(g_bar, bias_grad / L, rtol=1e-12, atol=1e-18)


def test_unfold_matches_torch_layout():
    """Column order is torch.nn.functional.unfold's (channel, kernel row, kernel col)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    x = rng.normal(size=(2, 3, 8, 7))
    ours = unfold2d(x, (3, 2), dilation=(2, 1), padding=(1, 2), stride=(2, 3))
    theirs = torch.nn.functional.unfold(torch.from_numpy(x), (3, 2), dilation=(2, 1),
                                        padding=(1, 2), stride=(2, 3)).numpy()
    np.testing.assert_array_equal(ours, theirs)
