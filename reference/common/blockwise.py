r"""LP4: the block-wise 8-bit quantizer of optimizer state, in NumPy (the oracle of
``torch_impl/common/blockwise.py``).

**The code maps.** A "dynamic tree" of ``b`` magnitude bits (after Dettmers' dynamic tree
quantization; our own endpoints) holds, for each decade z = 0, ..., b - 1, the
n_z = 2^(b-1-z) values

    t_{z,k} = 10^(-z) (1 + 9 k / n_z) / 10 = (n_z + 9 k) / (n_z 10^(z+1)),   k = 1, ..., n_z,

spaced evenly over (10^-(z+1), 10^-z]: the top of decade z is exactly 10^-z and its lowest value
lies above the top of decade z + 1, so the decades are disjoint and the tree has 2^b - 1
distinct values, the finest spacing (0.9 / n_0) in the top decade and coarser ones below.
Every value is then rounded (to nearest, ties to even) to 16 significant bits, so that every
entry and every midpoint between two neighbours is an exact float32 number: a midpoint is then
a float32 threshold exactly, and "nearest" has no rounding in its decision.

* ``unsigned_code()`` (second moments v): 0 and the tree of b = 8 bits -- 256 values in [0, 1]
  holding 0 and 1, the smallest positive 10^-7.
* ``signed_code()`` (first moments m, momentum): 0, the tree of b = 7 bits with both signs
  (symmetric, holding +-1; smallest magnitude 10^-6) -- 255 values -- and +10^-7 (the next
  decade's single value), since 256 entries hold one more than a symmetric map with 0 can.

**The quantizer.** x (any real floating dtype, read as float32) is flattened in row-major order
(memory order of a contiguous tensor) and cut into blocks of B consecutive values, the last
one shorter when B does not divide the size. Per block, s = max |x| (float32; exact). Per value
the float32 quotient y = fl32(x / s) (y = 0 in a block of zeros, s = 0) and

    q = argmin_k |y - code[k]|,   a tie going to the entry of smaller magnitude

(so on the symmetric part of the signed map quantizing -x gives the mirrored code, and a tie
never inflates a value). Dequantized: x_hat = fl32(s code[q]).

**The bound.** With gap(r) the length of the code interval [code[j], code[j+1]] holding the
exact quotient r = x / s (inside the map's range) and u = 2^-24 float32's unit roundoff,

    |x - x_hat| <= s gap(x / s) / 2 + 3 u s + 2^-150.

Why: |y - r| <= u (|r| <= 1); the midpoints being exact, code[q] is the entry nearest y, so
|y - code[q]| <= |y - e| <= u + gap / 2 for the endpoint e of r's interval nearest r, and
|r - code[q]| <= 2 u + gap / 2; the product's rounding adds at most u s (2^-150 when it is
subnormal). Below the map's range (x < 0 with the unsigned map) the nearest entry is code[0]
and s (code[0] - r) replaces s gap / 2. ``error_bound`` computes the bound per value; it is
tight: the value at a midpoint has the error s gap / 2, and one just past it goes to the
next entry.

**Non-finite input.** A block holding a NaN or +-inf gets s = NaN and every value of it the
code of y = 0: it dequantizes to NaN throughout, so the failure stays visible
(``isfinite``) and stays in that block. Nothing raises (a check would cost the port a host
synchronisation).
"""
import numpy as np

CODE_SIZE = 256
SIGNIFICANT_BITS = 16  # the code's entries and midpoints are exact float32 numbers


def _tree(bits):
    """The 2^bits - 1 magnitudes of the dynamic tree (float64, ascending, before rounding)."""
    values = []
    for z in range(bits):
        n = 2 ** (bits - 1 - z)
        k = np.arange(1, n + 1, dtype=np.float64)
        values.append((n + 9.0 * k) / (n * 10.0 ** (z + 1)))  # exact integers, one division
    return np.sort(np.concatenate(values))


def _round_significant(v, bits=SIGNIFICANT_BITS):
    """``v`` rounded to ``bits`` significant bits (ties to even): frexp gives v = m 2^e with
    m in [0.5, 1); m 2^bits is rounded to an integer."""
    m, e = np.frexp(v)
    return np.ldexp(np.round(np.ldexp(m, bits)), e - bits)


def unsigned_code():
    """The unsigned map (second moments): 0 and the 8-bit tree; float32, 256, ascending."""
    code = np.concatenate([[0.0], _tree(8)])
    return _round_significant(code).astype(np.float32)


def signed_code():
    """The signed map (first moments): the 7-bit tree with both signs, 0 and +10^-7; float32,
    256, ascending."""
    tree = _tree(7)
    code = np.sort(np.concatenate([-tree, [0.0, 1e-7], tree]))
    return _round_significant(code).astype(np.float32)


def _blocks(x, block_size):
    """(the values as float32 in row-major order, the block index of each)."""
    flat = np.asarray(x, dtype=np.float32).reshape(-1)
    return flat, np.arange(flat.size) // block_size


def _scales(flat, block_size):
    """Per block max |x| in float32 (the last block padded with zeros, which change no maximum);
    NaN for a block holding a NaN or +-inf."""
    n_blocks = -(-flat.size // block_size)
    padded = np.zeros(n_blocks * block_size, dtype=np.float32)
    padded[:flat.size] = np.abs(flat)
    s = padded.reshape(n_blocks, block_size).max(axis=1)
    return np.where(np.isfinite(s), s, np.float32(np.nan)).astype(np.float32)


def _nearest(y, code):
    """argmin_k |y - code[k]| by brute force over all 256 entries (distances in float64, exact
    for float32 y and code), a tie to the entry of smaller magnitude."""
    d = np.abs(y.astype(np.float64)[:, None] - code.astype(np.float64)[None, :])
    ties = d == d.min(axis=1, keepdims=True)
    magnitude = np.where(ties, np.abs(code.astype(np.float64))[None, :], np.inf)
    return np.argmin(magnitude, axis=1)


def quantize_blockwise(x, code, block_size):
    """LP4: (codes uint8 of x's shape, absmax float32 of ceil(size / block_size) blocks)."""
    flat, block = _blocks(x, block_size)
    s = _scales(flat, block_size)
    safe = np.where(s > 0, s, np.float32(1.0))  # a zero block: y = 0; NaN > 0 is False
    y = (flat / safe[block]).astype(np.float32)  # the float32 quotient
    y[np.isnan(s)[block]] = 0.0
    codes = _nearest(y, np.asarray(code, dtype=np.float32)) if flat.size else np.zeros(0, int)
    return codes.astype(np.uint8).reshape(np.shape(x)), s


def dequantize_blockwise(codes, absmax, code, block_size):
    """x_hat = fl32(s code[q]), float32, the codes' shape."""
    codes = np.asarray(codes)
    block = np.arange(codes.size) // block_size
    values = np.asarray(code, dtype=np.float32)[codes.reshape(-1).astype(np.int64)]
    return (np.asarray(absmax, dtype=np.float32)[block] * values).reshape(codes.shape)


def error_bound(x, code, block_size):
    """The per-value bound of LP4 on |x - x_hat| (float64, x's shape): s gap(x/s)/2 + 3 u s +
    2^-150, with s (code[0] - x/s) for gap/2 below the map's range; NaN in a non-finite block."""
    flat, block = _blocks(x, block_size)
    s = _scales(flat, block_size).astype(np.float64)[block]
    code = np.asarray(code, dtype=np.float64)
    r = flat / np.where(s > 0, s, 1.0)  # float64 quotient: within 2^-53 of x / s
    j = np.clip(np.searchsorted(code, r, side="right") - 1, 0, code.size - 2)
    half = np.where(r < code[0], code[0] - r, (code[j + 1] - code[j]) / 2)
    return (s * half + 3 * 2.0 ** -24 * s + 2.0 ** -150).reshape(np.shape(x))
