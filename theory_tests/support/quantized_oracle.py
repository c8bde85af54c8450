"""The oracle run of an optimizer with 8-bit state (LP4): a NumPy reference optimizer
(``reference.mars.mars.MARSReference``, ``reference.mars.mars_m.MARSMReference``) whose stored
moments pass through the LP4 quantizer (``reference/common/blockwise.py``) at the points where
the port stores them: before each step every quantized buffer is the dequantization of its
codes (what the step reads); after the step it is quantized again (what the step writes). The
step itself -- the update from the fresh moments -- is the reference's, unchanged.

``margin`` records the smallest relative distance, over every value written, of y = x / s
from a midpoint of the map (|y - midpoint| / |y|): a run in another precision differs from the
float64 oracle by rounding, a relative error (float32: ~1e-7 of a value; float64: ~1e-16),
which can move a value across a midpoint only where the margin is of that size; a test
asserts the margin is far larger, so an exact comparison of codes is sound."""
import numpy as np

from reference.common import blockwise


def _code(signed):
    return blockwise.signed_code() if signed else blockwise.unsigned_code()


def _margin(x, code, block_size):
    """min over the values of |y - nearest midpoint| / |y|, y = x/s (s the block's absmax)."""
    flat = np.asarray(x, dtype=np.float32).reshape(-1)
    if flat.size == 0:
        return np.inf
    s = np.repeat(blockwise._scales(flat, block_size), block_size)[:flat.size].astype(np.float64)
    y = flat / np.where(s > 0, s, 1.0)
    c = code.astype(np.float64)
    mid = (c[1:] + c[:-1]) / 2
    j = np.clip(np.searchsorted(mid, y), 1, mid.size - 1)
    near = np.minimum(np.abs(y - mid[j - 1]), np.abs(y - mid[j]))
    return float(np.min(near / np.maximum(np.abs(y), 2.0 ** -126)))


class QuantizedReference:
    """``reference`` with the buffers named in ``signed_buffers`` ({attribute: signed map?})
    stored as LP4 codes and scales of blocks of ``block_size``; ``used[name]`` lists the
    indices of the tensors whose buffer the port stores (the rest stay the reference's)."""

    def __init__(self, reference, signed_buffers, block_size, used):
        self.ref, self.buffers, self.block_size = reference, signed_buffers, block_size
        self.stored = {name: {i: blockwise.quantize_blockwise(
                                  np.zeros_like(reference.params[i]), _code(signed), block_size)
                              for i in used[name]}
                       for name, signed in signed_buffers.items()}
        self.margin = np.inf

    def step(self, grads, prev_grads=None):
        for name, signed in self.buffers.items():
            column = getattr(self.ref, name)
            for i, (q, s) in self.stored[name].items():
                column[i] = blockwise.dequantize_blockwise(q, s, _code(signed),
                                                           self.block_size).astype(np.float64)
        out = self.ref.step(grads, prev_grads)
        for name, signed in self.buffers.items():
            column = getattr(self.ref, name)
            for i in self.stored[name]:
                self.margin = min(self.margin, _margin(column[i], _code(signed), self.block_size))
                self.stored[name][i] = blockwise.quantize_blockwise(column[i], _code(signed),
                                                                    self.block_size)
        return out
