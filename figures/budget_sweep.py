"""The machinery of the budget scan (``budget_scan.py``): the lr-grid rule chained over
budgets, a scheduler that runs every training run of the scan on ``jobs`` processes, and the
95 % intervals of the effects.

**Grid rule.** A grid point is an integer exponent k, its lr ``centre * factor**k``. The first
budget's grid is ``first_points`` points around the registry's grid centre; budget i > 0 gets
``points`` points around budget i-1's best lr. A finished grid whose best point sits on an
edge is widened by one point beyond that edge, then looked at again, at most ``max_widen``
times (:func:`next_point`). Ties go to the smaller lr; a diverged run scores inf, so a grid
that diverged everywhere widens downwards. A grid point's score is the mean final validation
loss over the tuning seeds (inf if any diverged).

**Schedule.** The runs of one curve form a chain (budget i's grid needs budget i-1's best), so
the scheduler keeps ``jobs`` runs in flight: first the sweep points (they are on the chain;
larger budgets first), then the reported seeds at each finished budget's best lr (largest
first, to pack the tail). Every run is seeded, so the results do not depend on ``jobs`` or on
the order.
"""
import concurrent.futures as cf
import heapq
import math

import numpy as np

from . import fixed_sums


# ------------------------------------------------------------------ the lr-grid rule
def initial_points(n):
    """The exponents of an ``n``-point grid centred on 0: -(n//2) .. n//2 (``n`` odd)."""
    if n < 1 or n % 2 == 0:
        raise ValueError(f"a centred grid needs an odd number of points, got {n}")
    return list(range(-(n // 2), n // 2 + 1))


def best_point(scores):
    """The exponent with the lowest score (the smaller lr on a tie)."""
    return min(sorted(scores), key=lambda k: scores[k])


def next_point(scores, widened, max_widen):
    """The exponent to add to a finished grid ``{k: score}``: one beyond the edge holding the
    best score, or None when the best is inside or ``max_widen`` points were added already."""
    if widened >= max_widen:
        return None
    ks, best = sorted(scores), best_point(scores)
    if best == ks[0]:
        return ks[0] - 1
    if best == ks[-1]:
        return ks[-1] + 1
    return None


class Search:
    """One curve's lr grid at one budget, filled in as its runs finish."""

    def __init__(self, center, n_points, factor, max_widen, n_seeds):
        self.center, self.factor, self.max_widen, self.n_seeds = center, factor, max_widen, n_seeds
        self.scores, self.parts, self.widened, self.pending = {}, {}, 0, 0
        self.todo = initial_points(n_points)

    def lr(self, k):
        return self.center * self.factor ** k

    def take(self):
        """The exponents to run now (each once per tuning seed)."""
        out, self.todo = self.todo, []
        self.pending += len(out) * self.n_seeds
        return out

    def record(self, k, score):
        """One tuning seed's score of point ``k``. When the grid's last run is in, widen it if
        its best is on an edge. Returns True once the search is finished."""
        self.parts.setdefault(k, []).append(score)
        self.pending -= 1
        if len(self.parts[k]) == self.n_seeds:
            vals = self.parts[k]
            self.scores[k] = fixed_sums.mean(vals) if all(map(math.isfinite, vals)) else math.inf
        if self.pending:
            return False
        k = next_point(self.scores, self.widened, self.max_widen)
        if k is None:
            return True
        self.widened += 1
        self.todo = [k]
        return False

    def result(self):
        ks = sorted(self.scores)
        best = best_point(self.scores)
        return dict(center=self.center, factor=self.factor, lr=self.lr(best),
                    grid=[self.lr(k) for k in ks], exponents=ks,
                    val=[self.scores[k] for k in ks], widened=self.widened,
                    edge=best in (ks[0], ks[-1]))


# ------------------------------------------------------------------ the scheduler
class Serial:
    """An executor that runs each task when it is submitted (``jobs`` = 1, and the tests)."""

    def submit(self, fn, *args):
        future = cf.Future()
        future.set_result(fn(*args))
        return future

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def scan(executor, jobs, centers, steps, task, score, tuning_seeds, seeds, first_points,
         points, factor, max_widen, log=None):
    """Sweep every curve at every budget and run its reported seeds at each best lr.

    ``centers``: {label: first budget's grid centre}; ``steps``: the budgets (optimizer steps);
    ``task(label, lr, seed, steps, tuning)`` -> (fn, args) to submit; ``score(rows, steps)`` ->
    the final validation loss (inf if diverged); ``log(label, i, sweep)`` is told of each
    finished grid. Returns ``(sweeps, runs)``:
    ``sweeps[label][i]`` the grid record of budget i (its seeds included) and
    ``runs[label][i]`` the rows of each reported seed at budget i."""
    sweeps = {label: [None] * len(steps) for label in centers}
    runs = {label: [[None] * len(seeds) for _ in steps] for label in centers}
    searches, ready, inflight, order = {}, [], {}, iter(range(1 << 62))

    def push(kind, label, i, key, lr, seed):
        prio = (0 if kind == "tune" else 1, -steps[i], next(order))
        heapq.heappush(ready, (prio, (kind, label, i, key, lr, seed)))

    def start(label, i, center):
        searches[label] = Search(center, first_points if i == 0 else points, factor, max_widen,
                                 len(tuning_seeds))
        queue(label, i)

    def queue(label, i):
        s = searches[label]
        for k in s.take():
            for seed in tuning_seeds:
                push("tune", label, i, k, s.lr(k), seed)

    for label, center in centers.items():
        start(label, 0, center)
    while ready or inflight:
        while ready and len(inflight) < jobs:
            _, job = heapq.heappop(ready)
            kind, label, i, _, lr, seed = job
            fn, args = task(label, lr, seed, steps[i], kind == "tune")
            inflight[executor.submit(fn, *args)] = job
        done, _ = cf.wait(inflight, return_when=cf.FIRST_COMPLETED)
        for future in done:
            kind, label, i, key, lr, seed = inflight.pop(future)
            rows = future.result()
            if kind == "report":
                runs[label][i][key] = rows
                continue
            s = searches[label]
            if not s.record(key, score(rows, steps[i])):
                queue(label, i)
                continue
            sweeps[label][i] = dict(s.result(), seeds=list(tuning_seeds), steps=steps[i])
            best = sweeps[label][i]["lr"]
            if log:
                log(label, i, sweeps[label][i])
            for j, rseed in enumerate(seeds):
                push("report", label, i, j, best, rseed)
            if i + 1 < len(steps):
                start(label, i + 1, best)
    return sweeps, runs


# ------------------------------------------------------------------ intervals of the effects
def paired_ci(a, b, level=0.95):
    """Mean of the per-seed differences d = a - b with the paired t interval
    mean(d) -+ t_{(1+level)/2, n-1} sd(d) / sqrt(n) (seed s is the same initial weights and
    batches for both settings). nan bounds with fewer than two pairs."""
    from scipy.stats import t

    d = np.asarray(a, float) - np.asarray(b, float)
    n = len(d)
    out = dict(diff=fixed_sums.mean(d), n=n, df=n - 1, method="paired t")
    if n < 2 or not np.all(np.isfinite(d)):
        return dict(out, lo=math.nan, hi=math.nan, se=math.nan, t_crit=math.nan)
    se = fixed_sums.sd(d) / math.sqrt(n)
    crit = float(t.ppf((1 + level) / 2, n - 1))
    return dict(out, lo=out["diff"] - crit * se, hi=out["diff"] + crit * se, se=se,
                t_crit=crit)


def welch_ci(a, b, level=0.95):
    """mean(a) - mean(b) with Welch's interval (unpaired; Welch-Satterthwaite df)."""
    from scipy.stats import t

    from .common import welch_df

    a, b = np.asarray(a, float), np.asarray(b, float)
    diff = fixed_sums.mean(a) - fixed_sums.mean(b)
    df = welch_df(a, b)
    if not math.isfinite(df) or not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return dict(diff=diff, lo=math.nan, hi=math.nan, se=math.nan, df=df, t_crit=math.nan,
                    method="Welch")
    se = math.sqrt(fixed_sums.var(a) / len(a) + fixed_sums.var(b) / len(b))
    crit = float(t.ppf((1 + level) / 2, df))
    return dict(diff=diff, lo=diff - crit * se, hi=diff + crit * se, se=se, df=df,
                t_crit=crit, method="Welch")


def classify(lo, hi):
    """'positive' when the interval lies above 0, 'negative' below, else 'within noise'
    ('undetermined' without an interval)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "undetermined"
    return "positive" if lo > 0 else "negative" if hi < 0 else "within noise"
