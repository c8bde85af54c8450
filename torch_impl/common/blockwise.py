r"""LP4: the block-wise 8-bit quantizer of optimizer state (port of
``reference/common/blockwise.py``, whose docstring states the code maps, the rule and the
bound; this file computes the same codes and scales bit for bit).

* ``signed_code(device)`` (first moments, momentum) and ``unsigned_code(device)`` (second
  moments): the two 256-entry maps, float32, ascending; built on the device itself from exact
  operations (integer arithmetic, one correctly rounded division, frexp, round to even,
  multiplication by a power of two), so every device holds the same bits, and cached per
  device. The tensor returned is shared: never write into it.
* ``quantize_blockwise(x, code, block_size) -> (codes, absmax)``: codes uint8 of x's shape,
  absmax float32 of ceil(numel / block_size) blocks (the last block may be shorter).
* ``dequantize_blockwise(codes, absmax, code, block_size, dtype=torch.float32)``.

Vectorised over blocks (a whole-block view and a tail), no host synchronisation: every check
reads metadata only, and a non-finite block is handled by data (scale NaN, codes of 0), not by
an exception. The nearest entry comes from a binary search over the 255 midpoints, which are
exact float32 numbers (the entries have 16 significant bits); a tie goes to the entry of
smaller magnitude.
"""
import torch

CODE_SIZE = 256
SIGNIFICANT_BITS = 16  # the code's entries and midpoints are exact float32 numbers

_CODES = {}  # (signed, device) -> the map on that device


def _pow2(k):
    """2.0 ** k (float64) for an integer tensor k, from its bit pattern: exact on every device."""
    return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)


def _round_significant(v, bits=SIGNIFICANT_BITS):
    """``v`` (float64) rounded to ``bits`` significant bits, ties to even: v = m 2^e with m in
    [0.5, 1), m 2^bits rounded to an integer (exact: multiplications by powers of two)."""
    m, e = torch.frexp(v)
    return torch.round(m * float(2 ** bits)) * _pow2(e - bits)


def _tree(bits, device):
    """The 2^bits - 1 magnitudes of the dynamic tree, float64, ascending: decade z holds
    (n + 9 k) / (n 10^(z+1)), k = 1..n, n = 2^(bits-1-z)."""
    decades = []
    for z in reversed(range(bits)):  # the decades (7 or 8), smallest first: already ascending
        n = 2 ** (bits - 1 - z)
        numerator = n + 9.0 * torch.arange(1, n + 1, dtype=torch.float64, device=device)
        # a tensor denominator: CUDA divides by a host scalar as a multiplication by its
        # reciprocal, which would not be the correctly rounded quotient the oracle computes
        decades.append(numerator / torch.full_like(numerator, n * 10.0 ** (z + 1)))
    return torch.cat(decades)


def _build(signed, device):
    zero = torch.zeros(1, dtype=torch.float64, device=device)
    if signed:  # 0, the 7-bit tree with both signs, and the next decade's 10^-7
        tree = _tree(7, device)
        extra = torch.full((1,), 1e-7, dtype=torch.float64, device=device)
        values = torch.sort(torch.cat([-tree, zero, extra, tree])).values
    else:  # 0 and the 8-bit tree
        values = torch.cat([zero, _tree(8, device)])
    return _round_significant(values).to(torch.float32)


def _code(signed, device):
    device = torch.empty(0, device=device).device  # "cuda" -> "cuda:<current>"
    key = (signed, device)
    if key not in _CODES:
        _CODES[key] = _build(signed, device)
    return _CODES[key]


def signed_code(device=None):
    """The signed map (first moments, momentum): 256 float32 values in [-1, 1], ascending,
    holding 0 and +-1; symmetric but for its entry +10^-7. Shared: never write into it."""
    return _code(True, device)


def unsigned_code(device=None):
    """The unsigned map (second moments): 256 float32 values in [0, 1], ascending, holding 0 and
    1. Shared: never write into it."""
    return _code(False, device)


def _check_block_size(block_size):
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: expected a positive integer, got {block_size!r}")


def _check_code(code, device):
    if (not torch.is_tensor(code) or code.dtype != torch.float32 or code.dim() != 1
            or not 2 <= code.numel() <= CODE_SIZE):
        raise ValueError("code: expected a 1-D float32 tensor of 2 to 256 ascending entries "
                         "(signed_code / unsigned_code), got "
                         f"{code.dtype if torch.is_tensor(code) else type(code).__name__}"
                         f"{tuple(code.shape) if torch.is_tensor(code) else ''}")
    if code.device != device:
        raise ValueError(f"code: on {code.device}, the tensor on {device}")


def _split(flat, block_size):
    """(the whole blocks as a (full, block_size) view, the shorter last block: a view, maybe
    empty) of a 1-D tensor."""
    full = flat.numel() // block_size
    return flat[:full * block_size].view(full, block_size), flat[full * block_size:]


def _absmax(flat, block_size):
    """Per block max |x| (float32, exact); NaN for a block holding a NaN or +-inf."""
    body, tail = _split(flat.abs(), block_size)
    s = body.amax(dim=1)
    if tail.numel():
        s = torch.cat([s, tail.amax().reshape(1)])
    return s.masked_fill(~torch.isfinite(s), float("nan"))


def quantize_blockwise(x, code, block_size):
    """LP4: x (real floating point, read as float32, row-major) cut into blocks of
    ``block_size``; per block s = max |x|, per value the entry of ``code`` nearest x / s.
    Returns (codes: uint8, x's shape; absmax: float32, (ceil(numel / block_size),)). A block of
    zeros has s = 0 and the codes of 0; a block holding a NaN or +-inf has s = NaN and the codes
    of 0 (it dequantizes to NaN)."""
    _check_block_size(block_size)
    if not torch.is_tensor(x) or not x.is_floating_point():
        raise ValueError("quantize_blockwise: expected a real floating-point tensor, got "
                         f"{x.dtype if torch.is_tensor(x) else type(x).__name__}"
                         + (" (quantize torch.view_as_real(x) instead)"
                            if torch.is_tensor(x) and x.is_complex() else ""))
    _check_code(code, x.device)
    flat = x.detach().reshape(-1).to(torch.float32)
    s = _absmax(flat, block_size)
    safe = torch.where(s > 0, s, torch.ones_like(s))  # zero block: y = 0; NaN > 0 is False
    full = flat.numel() // block_size
    y = torch.empty_like(flat)
    (body, tail), (y_body, y_tail) = _split(flat, block_size), _split(y, block_size)
    torch.div(body, safe[:full, None], out=y_body)  # tensor divisors: correctly rounded
    torch.div(tail, safe[full:], out=y_tail)
    bad = torch.isnan(s)
    y_body.masked_fill_(bad[:full, None], 0.0)
    y_tail.masked_fill_(bad[full:], 0.0)
    mid = (code[1:] + code[:-1]) / 2  # exact: the entries have 16 significant bits
    # bucketize counts the midpoints below y: a tie goes down, toward zero for y >= 0; for
    # y < 0 count those <= y instead (the next float toward zero: no float32 lies between)
    y = torch.where(y < 0, torch.nextafter(y, torch.ones((), device=y.device)), y)
    q = torch.bucketize(y, mid, out_int32=True)
    return q.to(torch.uint8).reshape(x.shape), s


def dequantize_blockwise(codes, absmax, code, block_size, dtype=torch.float32):
    """x_hat = s code[q] in float32 (then rounded to ``dtype``), of the codes' shape."""
    _check_block_size(block_size)
    if not torch.is_tensor(codes) or codes.dtype != torch.uint8:
        raise ValueError(f"codes: expected a uint8 tensor, got "
                         f"{codes.dtype if torch.is_tensor(codes) else type(codes).__name__}")
    n_blocks = -(-codes.numel() // block_size)
    if (not torch.is_tensor(absmax) or absmax.dtype != torch.float32
            or tuple(absmax.shape) != (n_blocks,) or absmax.device != codes.device):
        raise ValueError(f"absmax: expected float32 of shape ({n_blocks},) on {codes.device} "
                         f"for {codes.numel()} codes in blocks of {block_size}, got "
                         f"{absmax.dtype if torch.is_tensor(absmax) else type(absmax).__name__}"
                         f"{tuple(absmax.shape) if torch.is_tensor(absmax) else ''}")
    _check_code(code, codes.device)
    values = code.index_select(0, codes.reshape(-1).to(torch.int32))
    full = values.numel() // block_size
    body, tail = _split(values, block_size)
    body.mul_(absmax[:full, None])
    tail.mul_(absmax[full:])
    return values.reshape(codes.shape).to(dtype)
