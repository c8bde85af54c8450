"""The LP4 quantizer run twice, by the oracle (``reference/common/blockwise.py``) and by the port
(``torch_impl/common/blockwise.py``), on the same float32 values, and the inputs the tests feed
both: random values over 60 decades of magnitude, zero blocks, shorter last blocks."""
import numpy as np
import torch

from reference.common import blockwise as oracle
from torch_impl.common import blockwise as port

MAPS = {"signed": (oracle.signed_code, port.signed_code),
        "unsigned": (oracle.unsigned_code, port.unsigned_code)}


def bits(a):
    """A float32 array's bit patterns (NaN == NaN, -0.0 != 0.0): "bit for bit"."""
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def run_both(x, kind, block_size):
    """{"oracle" | "port": (codes, absmax, dequantized)} as NumPy arrays, for float32 ``x``."""
    x = np.asarray(x, dtype=np.float32)
    code_o, code_p = MAPS[kind][0](), MAPS[kind][1]()
    q, s = oracle.quantize_blockwise(x, code_o, block_size)
    qt, st = port.quantize_blockwise(torch.from_numpy(x), code_p, block_size)
    return {"oracle": (q, s, oracle.dequantize_blockwise(q, s, code_o, block_size)),
            "port": (qt.numpy(), st.numpy(),
                     port.dequantize_blockwise(qt, st, code_p, block_size).numpy())}


def wide_values(seed, n, decades=60):
    """n float32 values with random signs and magnitudes spread over ``decades`` decades around
    1 (so a block's absmax is far above most of its values), a few exact zeros."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * 10.0 ** rng.uniform(-decades / 2, decades / 2, n)
    x[rng.random(n) < 0.05] = 0.0
    return x.astype(np.float32)

