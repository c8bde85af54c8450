r"""8-bit block-wise optimizer state (LP4) as MARS and MARS-M store it: ``state_quantization=
"blockwise8"`` and ``block_size`` (the quantizer is ``common/blockwise.py``; the write-back
that calls this is ``common/state_storage.py``).

A quantized buffer ``name`` is kept as two state entries, ``<name>_codes`` (uint8, the
parameter's shape) and ``<name>_absmax`` (float32, ceil(numel / block_size) block scales);
the signed map holds first moments and momenta, the unsigned one second moments:

====================  ========  ======================================================
buffer                map       optimizer
====================  ========  ======================================================
``exp_avg``           signed    MARS (every route, the 1-D fallback too)
``exp_avg_sq``        unsigned  MARS (the AdamW rule and the fallback)
``max_exp_avg_sq``    unsigned  MARS (amsgrad)
``momentum_buffer``   signed    MARS-M (its matrices, the efficient recursion's buffer)
``moment1``           signed    MARS-M (its AdamW backup)
``moment2``           unsigned  MARS-M (its AdamW backup)
====================  ========  ======================================================

``last_grad`` is not quantized (a gradient copy: it stays in ``state_dtype``).  A step
dequantizes into its working copy, x = s code[q] in the step's compute dtype (float32 at
least), and quantizes that copy back after the update.  Zeros are stored as the codes of 0 with
scale 0 (what quantizing zeros gives).  A group whose option changes converts its state at the
next step: plain buffers are quantized, quantized ones dequantized into ``state_dtype``.
"""
import torch

from .blockwise import dequantize_blockwise, quantize_blockwise, signed_code, unsigned_code
from .sharding import is_dtensor

__all__ = ["QUANTIZATIONS", "QUANTIZED_BUFFERS", "CODES", "ABSMAX", "check_quantization",
           "quantizes", "Quantized", "dequantize", "quantize_into", "ensure_quantized",
           "is_quantized_entry"]

QUANTIZATIONS = (None, "blockwise8")
QUANTIZED_BUFFERS = {"exp_avg": True, "exp_avg_sq": False, "max_exp_avg_sq": False,
                     "momentum_buffer": True, "moment1": True, "moment2": False}  # signed?
CODES, ABSMAX = "_codes", "_absmax"


def is_quantized_entry(key):
    """Whether a state key is a quantized buffer's codes or scales."""
    return key.endswith(CODES) or key.endswith(ABSMAX)


def quantizes(group, name):
    """Whether ``group`` stores its buffer ``name`` in 8 bits."""
    return group.get("state_quantization") == "blockwise8" and name in QUANTIZED_BUFFERS


def check_quantization(group):
    """``state_quantization`` and ``block_size`` against the group's parameters: every tensor
    must fill a block (ValueError naming both and the shape), be real and not a DTensor."""
    if "state_quantization" not in group:  # an optimizer without the option (LAMB)
        return
    mode, block = group["state_quantization"], group["block_size"]
    if mode not in QUANTIZATIONS:
        raise ValueError(f"state_quantization: expected one of {QUANTIZATIONS}, got {mode!r}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block_size: expected an int >= 1, got {block!r}")
    if mode is None:
        return
    for p in group["params"]:
        if p.is_complex():
            raise ValueError(f"state_quantization: a complex parameter (shape {tuple(p.shape)}) "
                             "has no 8-bit state (the maps are real); optimize "
                             "torch.view_as_real(p), or put it in a group without the option")
        if is_dtensor(p):
            raise ValueError(f"state_quantization: a DTensor (FSDP2) parameter (shape "
                             f"{tuple(p.shape)}): its blocks would cut across the shards, whose "
                             "scales no rank holds whole; keep its state unquantized")
        if p.numel() < block:
            raise ValueError(f"state_quantization='blockwise8' with block_size={block}: the "
                             f"tensor of shape {tuple(p.shape)} has {p.numel()} elements, fewer "
                             "than a block (put such tensors in another group, without "
                             "state_quantization, or lower block_size)")


def _code(name, device):
    return signed_code(device) if QUANTIZED_BUFFERS[name] else unsigned_code(device)


class Quantized:
    """Stands in a state column for a buffer held as codes and scales (``WriteBack.column``
    dequantizes it into the step's working copy)."""
    __slots__ = ()


def dequantize(st, name, group, dtype):
    """The buffer ``name`` of state ``st``, dequantized into a new tensor of ``dtype``."""
    codes = st[name + CODES]
    return dequantize_blockwise(codes, st[name + ABSMAX], _code(name, codes.device),
                                group["block_size"], dtype=dtype)


def quantize_into(st, name, group, values):
    """``st``'s codes and scales of ``name`` <- the quantization of ``values`` (in place)."""
    codes, absmax = quantize_blockwise(values, _code(name, values.device), group["block_size"])
    st[name + CODES].copy_(codes)
    st[name + ABSMAX].copy_(absmax)


def ensure_quantized(st, p, group, name, plain_dtype):
    """Bring ``st``'s buffer ``name`` to the form the group asks for: codes and scales (created
    as the quantization of zeros, or of a plain buffer held since), or a plain buffer in
    ``plain_dtype`` (dequantized from codes held since).  Returns whether it is quantized."""
    if quantizes(group, name):
        if name + CODES not in st:
            values = st.pop(name) if name in st else torch.zeros_like(p, dtype=torch.float32)
            codes, absmax = quantize_blockwise(values, _code(name, p.device), group["block_size"])
            st[name + CODES], st[name + ABSMAX] = codes, absmax
        blocks = -(-p.numel() // group["block_size"])
        if st[name + ABSMAX].numel() != blocks:
            raise ValueError(f"block_size: the state of the tensor of shape {tuple(p.shape)} "
                             f"holds {st[name + ABSMAX].numel()} block scales, block_size="
                             f"{group['block_size']} needs {blocks} (block_size cannot change "
                             "once the state is quantized)")
        return True
    if name + CODES in st:  # the option turned off since: the values back, in plain storage
        st[name] = dequantize(st, name, group, plain_dtype)
        del st[name + CODES], st[name + ABSMAX]
    return False
