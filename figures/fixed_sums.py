"""Means and standard deviations whose result does not depend on the order of summation.

The figures' JSON statistics (a tail mean, a seed mean and sd, an effect) are compared bit for
bit with the committed ones in the environment that made them (``figures/repro.py``). A NumPy
reduction does not promise that: it may sum a slice in another order depending on its
memory alignment, and ``variance_reduction``'s tail mean came out one unit in the last place
apart in the committing environment itself. ``math.fsum`` returns the correctly rounded sum
of its arguments, so the order it is given them in cannot change a bit; what follows from it
(one division, one square root) is correctly rounded too.
"""
import math

import numpy as np


def _floats(values):
    """The values as a flat list of Python floats (a NumPy array of any shape, or an
    iterable of numbers)."""
    return np.asarray(values, dtype=float).ravel().tolist()


def _sum(xs):
    """The correctly rounded sum; with an infinite or nan value, what any order gives (inf,
    -inf or nan: ``math.fsum`` refuses inf + -inf)."""
    if all(map(math.isfinite, xs)):
        return math.fsum(xs)
    return sum(xs)


def mean(values):
    """The mean, from the correctly rounded sum (ValueError on no values)."""
    xs = _floats(values)
    if not xs:
        raise ValueError("mean of no values")
    return _sum(xs) / len(xs)


def nanmean(values):
    """The mean of the values that are not nan (NumPy's ``nanmean``); nan when every one is."""
    xs = [x for x in _floats(values) if not math.isnan(x)]
    return _sum(xs) / len(xs) if xs else math.nan


def var(values, ddof=1):
    """The variance about :func:`mean` with ``len - ddof`` in the denominator (NumPy's
    ``var(ddof=...)``), both sums correctly rounded; ValueError when ``len <= ddof``."""
    xs = _floats(values)
    if len(xs) <= ddof:
        raise ValueError(f"variance of {len(xs)} value(s) with ddof={ddof}")
    m = _sum(xs) / len(xs)
    return _sum([(x - m) ** 2 for x in xs]) / (len(xs) - ddof)


def sd(values, ddof=1):
    """The square root of :func:`var` (NumPy's ``std(ddof=...)``)."""
    return math.sqrt(var(values, ddof))
