r"""Kronecker factors stored in a narrower dtype than they are computed in (issue 47 item 3,
LP5): the write of a computed factor into its storage dtype, by round-to-nearest or by
stochastic rounding (LP1) from a counter-based stream (LP2), and the stream's seed.

**The write.** ``store_factor(x, dtype, None)`` is ``x.to(dtype)`` (round to nearest, what
MKOR and K-FAC always did). With a seed, the *upper triangle* of x (diagonal included) is
rounded by LP1 (:func:`torch_impl.common.rounding.stochastic_round`) and mirrored into the
lower one, so the stored factor is exactly symmetric, as the factors are in exact arithmetic
(MKOR.md 2.5): rounding J_ij and J_ji independently would leave an antisymmetric part that
MKOR's update, J_t = A J + B I - a a^T, multiplies by A = 1/rho between stabiliser firings
and never damps. Each stored entry is still LP1 of its computed value (unbiased, less than one
ulp away); the lower triangle's uniforms are drawn and unused.

**The stream** (LP2). The seed of one write is ``stream_seed(rounding_seed, index,
name_word(name), count)``:

* ``rounding_seed``: the optimizer's (an int in its ``state_dict``);
* ``index``: the layer's place in the optimizer's list of preconditioned layers (discovery
  order, the same on every rank and in a resumed run);
* ``name``: which factor (MKOR: ``"L_inv"`` or ``"R_inv"``);
* ``count``: the optimizer's step count at the write (at most one factor update per step, so
  it numbers the updates; a Python int, read without a host sync).

No word names the rank: replicated factors (DDP) round identically on every rank, and under
FSDP2's owner placement the owner rounds exactly as every rank of the replicated placement
would. A stack of E experts is one write (one seed; its E d^2 uniforms are distinct).
"""
import torch
import torch.distributed as dist

from ..common.rounding import (ROUNDING_DTYPES, default_rounding_seed, name_word,
                               stochastic_round, stream_seed)
from .exchange import world_size

__all__ = ["store_factor", "factor_seed", "resolve_rounding_seed", "ROUNDING_DTYPES"]


def store_factor(x, dtype, seed=None):
    """x written in ``dtype``: to nearest (``seed`` None, or nothing to round), else the
    upper triangle by LP1 with ``seed`` and mirrored (module docstring). x: (..., d, d)."""
    if seed is None or x.dtype == dtype:
        return x.to(dtype)
    upper = torch.triu(stochastic_round(x, dtype, seed))
    return upper + torch.triu(upper, 1).mT  # exact: one of each pair is 0


def factor_seed(rounding_seed, index, name, count):
    """The LP2 seed of one factor write (module docstring)."""
    return stream_seed(rounding_seed, index, name_word(name), count)


def resolve_rounding_seed(rounding_seed, process_group=None, device="cpu"):
    """``rounding_seed`` as given, or (None) one draw of :func:`default_rounding_seed`;
    distributed, rank 0's draw is broadcast (once, at construction), so replicated factors
    round identically even when the ranks' torch generators differ."""
    if rounding_seed is not None:
        return int(rounding_seed)
    seed = default_rounding_seed()
    if world_size(process_group) > 1:
        box = torch.tensor([seed], dtype=torch.int64, device=device)
        dist.broadcast(box, group=process_group, group_src=0)
        seed = int(box.item())
    return seed
