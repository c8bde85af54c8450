"""Which rounding law a write followed, judged from many independent draws of the same value.

An experiment writes the same float32 value x_j (column j) into R rows of a 16-bit tensor, each
row's write drawing its own randomness (``peer_rounding.one_step``).  For each column the
neighbours lo_j <= x_j <= hi_j of the narrow type come from the LP1 oracle
(``reference/common/rounding.py::neighbours``) and p_j = (x_j - lo_j)/(hi_j - lo_j).  Under LP1
the count K_j of rows that wrote hi_j is Binomial(R, p_j); under round-to-nearest every row
writes RN(x_j).

The verdict (``classify``):

* ``"unrounded"``: the tensor is not narrower than float32 and holds x exactly;
* ``"nearest"``: every row holds RN(x_j) (and some column is not representable, so nearest and
  a stochastic write could be told apart);
* ``"stochastic"``: every row holds lo_j or hi_j, every column's |K_j - R p_j| <= Z σ_j + 1
  (σ_j = √(R p_j (1 - p_j)); the 1 covers a float32 ulp of x_j, which moves p_j by at most
  2^-16 per ulp, R 2^-16 < 1 for R <= 65536), and the mean over all written values agrees
  with the mean of x within Z standard errors (the variance of LP1 is (hi - x)(x - lo));
* ``"other"``: anything else (a written value outside {lo, hi}, or a count outside its band).

Z = 5: with the normal approximation a column leaves its band with probability 5.7e-7 under
LP1, so a test of 64 columns x 3 tensors fails by chance about once in 10,000 seeds; the seeds
are fixed, so a test is a deterministic check.  Round-to-nearest and round-toward-zero leave
the band in every column with 0.2 <= p_j <= 0.8 once R >= 100 (Rp_j > 5 σ_j + 1).
"""
from dataclasses import dataclass

import numpy as np
import torch

from reference.common.rounding import neighbours

__all__ = ["Z", "Law", "classify", "same_law"]

Z = 5.0


@dataclass
class Law:
    verdict: str
    p: np.ndarray          # per column: (x - lo)/(hi - lo) (0 where x is representable)
    freq: np.ndarray       # per column: the fraction of rows that wrote hi
    worst_z: float         # max over columns of |K - R p| / σ (0 where σ = 0)
    mean_z: float          # the mean's deviation in standard errors
    rows: int


def _names(dtype):
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]


def classify(written, x):
    """The law by which ``written`` (R x n) holds the float32 values ``x`` (n), R draws each."""
    rows = written.shape[0]
    if written.dtype in (torch.float32, torch.float64):
        same = bool((written.double() == x.double().expand_as(written)).all())
        n = x.numel()
        return Law("unrounded" if same else "other", np.zeros(n), np.zeros(n), 0.0, 0.0, rows)
    xd = x.double().numpy()
    lo, hi = neighbours(xd, _names(written.dtype))
    gap = hi - lo
    p = np.divide(xd - lo, gap, out=np.zeros_like(gap), where=gap > 0)
    w = written.double().numpy()
    is_hi = (w == hi) & (gap > 0)
    freq = is_hi.mean(axis=0)
    nearest = x.to(written.dtype).double().numpy()
    if (w == nearest).all():
        verdict = "nearest" if (gap > 0).any() else "unrounded"
        return Law(verdict, p, freq, 0.0, 0.0, rows)
    in_support = ((w == lo) | (w == hi)).all()
    sigma = np.sqrt(rows * p * (1 - p))
    dev = np.abs(is_hi.sum(axis=0) - rows * p)
    z = np.divide(dev, sigma, out=np.zeros_like(dev), where=sigma > 0)
    band = (dev <= Z * sigma + 1).all()
    var = ((hi - xd) * (xd - lo)).sum() * rows
    mean_z = abs((w - xd).sum()) / np.sqrt(var) if var > 0 else 0.0
    ok = in_support and band and mean_z <= Z
    return Law("stochastic" if ok else "other", p, freq, float(z.max()), float(mean_z), rows)


def same_law(a, b):
    """Whether two stochastic writes (laws ``a``, ``b``, of values x_a, x_b that two
    implementations computed apart by float32 rounding) agree column by column: the expected
    frequencies differ by |p_a - p_b|, so |f_a - f_b| - |p_a - p_b| must stay within
    Z √(p̄(1 - p̄)(1/R_a + 1/R_b)).  Returns the largest deviation in those standard errors
    (<= Z: the same law)."""
    pbar = (a.p + b.p) / 2
    se = np.sqrt(pbar * (1 - pbar) * (1.0 / a.rows + 1.0 / b.rows))
    dev = np.abs(a.freq - b.freq) - np.abs(a.p - b.p)
    z = np.divide(dev, se, out=np.zeros_like(dev), where=se > 0)
    return float(np.clip(z, 0, None).max())
