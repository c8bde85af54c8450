"""torchtitan's ``GroupedExperts`` with its expert products in the parameters' dtype.

torchtitan 0.3 computes every expert product in bf16 (``GroupedExperts.forward`` casts the
tokens and the weights with ``.bfloat16()`` before ``torch._grouped_mm``, which on the CPU
takes no float64).  With expert parallelism alone (``efsdp`` = 1) each expert sees all its
tokens on one rank, in the one process's order, so the bf16 products and the weight
gradients are the one process's bit for bit.  With ``efsdp`` > 1 an expert's tokens are
split over the ``efsdp`` ranks that hold it: each rank's part of the weight gradient is
rounded to bf16 before FSDP sums them, so the gradients agree with one process only to bf16
rounding (measured: 2^-8 of an expert's largest entry), whatever the optimizer does.

:func:`use_float64_products` swaps ``GroupedExperts.forward`` for the same computation --
``silu(x W1^T) * (x W3^T)`` then ``W2^T``, expert by expert over the rows
``num_tokens_per_expert`` assigns it -- in the dtype of the tokens and weights, so that such
a run can be compared with one process at float64 precision.  For a forked rank (it patches
the class, in that process only).
"""
import torch
import torch.nn.functional as F

__all__ = ["use_float64_products"]


def _forward(self, x_RD, num_tokens_per_expert_E):
    from torch.distributed.tensor import DTensor
    w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w
                  for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
    counts = num_tokens_per_expert_E.tolist()
    if sum(counts) != x_RD.shape[0] or len(counts) != w1.shape[0]:
        raise RuntimeError(f"float64 experts: {len(counts)} experts and {sum(counts)} routed "
                           f"rows for {w1.shape[0]} local experts and {x_RD.shape[0]} rows")
    out, start = [], 0
    for e, n in enumerate(counts):
        x = x_RD[start:start + n]
        start += n
        h = F.silu(x @ w1[e].transpose(0, 1)) * (x @ w3[e].transpose(0, 1))
        out.append(h @ w2[e].transpose(0, 1))
    return torch.cat(out) if out else x_RD.new_zeros(0, w2.shape[1])


def use_float64_products():
    """Patch ``GroupedExperts.forward`` (module docstring) in this process."""
    from torchtitan.models.common.moe import GroupedExperts
    GroupedExperts.forward = _forward
