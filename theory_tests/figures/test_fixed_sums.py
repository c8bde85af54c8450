"""The figures' statistics are summed in no particular order and still come out the same to
the last bit (``figures/fixed_sums.py``, issue 45 item 6): NumPy's mean of a slice may round
its last bit differently with the slice's memory alignment, and the JSON holding such a mean
is compared bit for bit in the environment that made it."""
import json
import math
import random
import statistics

import numpy as np
import pytest

from figures import common as C
from figures import fixed_sums
from figures.experiments import variance_reduction

# Three values whose sum depends on the order: left to right, 1e16 + 1 rounds back to 1e16
# and the 1 is lost; the exact sum is 1. NumPy sums so few values left to right.
CANCEL = [1e16, 1.0, -1e16]


def test_the_sum_is_the_same_in_every_order():
    """Values over thirty orders of magnitude, shuffled: every order gives the same mean and
    sd, bit for bit, where a left-to-right sum does not (the data make the check able to
    fail)."""
    rng = random.Random(0)
    xs = [rng.uniform(-1, 1) * 10.0 ** rng.randint(-15, 15) for _ in range(200)]
    orders = [xs[:], xs[::-1]] + [rng.sample(xs, len(xs)) for _ in range(5)]
    assert len({sum(o) for o in orders}) > 1  # plain summation depends on the order here
    assert len({fixed_sums.mean(o) for o in orders}) == 1
    assert len({fixed_sums.sd(o) for o in orders}) == 1
    assert float(np.mean(CANCEL)) == 0.0 and fixed_sums.mean(CANCEL) == 1 / 3


def test_mean_sd_and_var_are_numpys_to_rounding():
    """The same statistics as NumPy and ``statistics`` (exact fractions), within rounding;
    a 2-D array counts every value; non-finite values give what any order gives."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((4, 25)) * 3 + 7
    assert fixed_sums.mean(a) == pytest.approx(statistics.fmean(a.ravel()), rel=1e-15)
    assert fixed_sums.sd(a) == pytest.approx(statistics.stdev(a.ravel()), rel=1e-14)
    assert fixed_sums.sd(a, ddof=0) == pytest.approx(float(a.std()), rel=1e-14)
    assert fixed_sums.var(a[0]) == pytest.approx(float(a[0].var(ddof=1)), rel=1e-14)
    assert fixed_sums.mean([math.inf, 1.0]) == math.inf
    assert math.isnan(fixed_sums.mean([math.inf, -math.inf]))
    assert fixed_sums.nanmean([math.nan, 1.0, 3.0]) == 2.0
    assert math.isnan(fixed_sums.nanmean([math.nan]))
    with pytest.raises(ValueError, match="no values"):
        fixed_sums.mean([])
    with pytest.raises(ValueError, match="1 value"):
        fixed_sums.sd([1.0])


def test_variance_reductions_tail_mean_is_order_fixed(tmp_path, monkeypatch):
    """The JSON's ``tail_error`` (the mean over the second half of the steps) is the correctly
    rounded mean: with a simulation whose tail is ``CANCEL``, 1/3, where NumPy's mean of the
    slice gives 0."""
    monkeypatch.setattr(variance_reduction, "simulate",
                        lambda b, gamma, exact, seed: np.array([1.0, 1.0] + CANCEL))
    ctx = C.Context(mode="tiny", out=tmp_path, progress=False, command="test")
    variance_reduction.run(ctx)
    tail = json.loads((tmp_path / "variance_reduction.json").read_text())["tail_error"]
    assert set(tail.values()) == {1 / 3}, tail


def test_the_summary_tables_mean_and_sd_are_order_fixed():
    """A curve's final value over seeds, ``CANCEL``: its mean is 1/3 and its sd the correctly
    rounded one, whatever order the seeds come in."""
    def curve(finals):
        runs = [[dict(step=0, val_loss=2.0), dict(step=10, val_loss=f)] for f in finals]
        return dict(lr=0.1, source="test", runs=runs)

    rows = C.summary_rows("t", {"A": curve(CANCEL), "B": curve(CANCEL[::-1])}, "A")
    assert [r["final"] for r in rows] == [1 / 3, 1 / 3]
    assert rows[0]["sd"] == rows[1]["sd"] == fixed_sums.sd(CANCEL)
