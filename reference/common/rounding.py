"""Stochastic rounding (LP1), the oracle: float64 in, the values of a narrower floating type
out, given the uniforms.  NumPy has no bfloat16, so a type is described by its precision p
(significand bits, the implicit one included) and its smallest normal exponent: every value of
the type in the binade [2^e, 2^(e+1)) is a multiple of ulp = 2^(max(e, e_min) - (p - 1)).

    lo = floor(x / ulp) * ulp,   hi = lo + ulp            (the neighbours: lo <= x <= hi)
    SR(x) = hi  if u < (x - lo) / (hi - lo)  else lo      (u ~ U[0, 1);  x = lo: SR(x) = x)

so E[SR(x)] = lo + (x - lo) = x and Var[SR(x)] = (hi - x)(x - lo).  Every step here is exact in
float64 for the three types (their values and spacings are float64 values), so the oracle
states the rule without rounding error of its own.  Values beyond the type's largest finite one
are outside the rule (the port rounds them to nearest there, which keeps an overflow visible).
"""
import numpy as np

__all__ = ["FORMATS", "neighbours", "stochastic_round", "largest_finite"]

# name: (p, e_min, e_max)
FORMATS = {"bfloat16": (8, -126, 127), "float16": (11, -14, 15), "float32": (24, -126, 127)}


def largest_finite(name):
    p, _, e_max = FORMATS[name]
    return (2.0 - 2.0 ** (1 - p)) * 2.0 ** e_max


def _ulp(x, name):
    """The spacing of the type's values in the binade of |x| (the subnormal spacing below its
    smallest normal); x = 0 lies in the subnormal range."""
    p, e_min, _ = FORMATS[name]
    mag = np.abs(x)
    e = np.floor(np.log2(np.where(mag > 0, mag, 1.0)))
    e = np.where(mag > 0, np.maximum(e, e_min), e_min)
    # log2 of a float64 just below a power of two can come out as that power: correct it
    e = np.where((mag > 0) & (2.0 ** e > mag), np.maximum(e - 1, e_min), e)
    return 2.0 ** (e - (p - 1))


def neighbours(x, name):
    """(lo, hi): the adjacent values of the type around x (lo = hi = x when x is one)."""
    x = np.asarray(x, dtype=np.float64)
    if np.any(np.abs(x) > largest_finite(name)) or not np.all(np.isfinite(x)):
        raise ValueError(f"x: outside the finite range of {name} (LP1 covers |x| <= its "
                         "largest finite value)")
    ulp = _ulp(x, name)
    lo = np.floor(x / ulp) * ulp
    hi = np.where(lo == x, x, lo + ulp)
    return lo, hi


def stochastic_round(x, u, name):
    """SR(x) (LP1) with the given uniforms u (same shape as x), as float64 values of ``name``."""
    lo, hi = neighbours(x, name)
    u = np.asarray(u, dtype=np.float64)
    gap = hi - lo
    p_up = np.divide(np.asarray(x) - lo, gap, out=np.zeros_like(gap), where=gap > 0)
    return np.where(u < p_up, hi, lo)
