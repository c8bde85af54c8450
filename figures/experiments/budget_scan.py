"""Figure 9: a budget scan of the char-GPT. The question: does MARS-AdamW's gain over AdamW on
the Shakespeare char-GPT (figure 5) hold, grow or vanish as the training budget grows, and
which ingredient carries it, the variance reduction (gamma) or MARS's betas?

**Curves** (the labels and keywords of figure 5): AdamW; MARS-AdamW with the official betas
(0.95, 0.99) and gamma = 0.025; the same at gamma = 0 (no variance reduction); gamma = 0.025 at
AdamW's betas (0.9, 0.95); MARS-M (float32 Newton-Schulz, the registry's setting for CPUs
without bf16 matrix units, where the authors' bf16 would be many times slower).

**Budgets.** Final validation loss after B training tokens, B over an 8x range (``--full``:
1,024 to 8,192 steps of 16 x 64 tokens, 1.05M to 8.39M tokens). The model is fixed; the lr
schedule scales with the run (``common.train``: linear warm-up over 10 % of the run's steps,
then cosine to 10 % of the peak at its last step).

**Tuning.** Every curve is lr-tuned at every budget, on tuning seed 100 (``--full``; disjoint
from the reported seeds 0, 1, 2), by the rule of ``budget_sweep.py``: a log grid of factor 2,
at the first budget 5 points around the registry's centre, at budget i > 0 3 points around
budget i-1's best, widened by one point while the best sits on an edge (at most 3 times). Why
factor 2 and 3 points: successive budgets differ by 2x in tokens, and the best lr of a fixed
model is expected to move by less than 2x per doubling, so the 4x window around the last best
should hold the new one; where it does not, the widening follows it (the JSON's ``widened``
counts say how often). Factor 2 resolves the best lr to within sqrt(2) either way for a
unimodal loss-vs-lr curve; sqrt(2) spacing would need 5 points for the same window, 5/3 of the
sweep cost. Every grid point is a CSV row (metric ``tuning_val_loss``, tokens = its budget,
step -1) and in the JSON.
This figure always sweeps (``--tune`` and the tuned-lr JSONs play no part in it).

**Effects** (second panel), per budget, each a difference of final validation losses
L(first) - L(second) over the reported seeds, signed so that a positive value favours MARS
(or the variance-reduced / official setting): MARS-AdamW vs AdamW, L(AdamW) - L(MARS-AdamW);
variance reduction at the official betas, L(gamma=0) - L(gamma=0.025); the betas at
gamma=0.025, L(AdamW's betas) - L(official); MARS-M vs AdamW, L(AdamW) - L(MARS-M); MARS-AdamW
at gamma=0 vs AdamW, L(AdamW) - L(gamma=0), what is left of the first effect without the
variance reduction (per seed, the first effect is exactly this one plus the second). The 95 %
interval is the paired t interval mean(d) -+ t_{0.975, n-1} sd(d)/sqrt(n) of the per-seed
differences d (seed s gives both settings the same initial weights and the same batches);
Welch's unpaired interval is in the JSON too. An effect is positive (negative) at a budget when
its interval lies above (below) 0, else within noise.

**Size of the full scan** (``python -m figures --full --only budget_scan --jobs 2``). Width 64,
depth 2, 2 heads, context 64 (0.115M parameters), batch 16: 1,024 tokens per step. In units
U of the first budget's run (1.05M tokens), one curve costs sweeps 5 x 1 + 3 x (2 + 4 + 8) =
47 U, about 7.5 U of widening (assumed: one point at every other budget) and reported runs
3 x (1 + 2 + 4 + 8) = 45 U: ~100 U; the evaluations (256 windows, 9 per reported run, 2 per
sweep run) add under 1 %. Five curves: ~500 U = 524M tokens; every grid widened the most
(3 points) would add 225 U. The measured throughput, the time this predicts and the measured
run are in figures/README.md. Quick mode is a miniature (width 32, depth 1, context 32,
batch 8; two budgets, 64 and 256 steps: a 4x range, not 8x; 3 points at the first budget, at
most 2 widenings; 3 reported seeds); it checks that the scan builds, its budgets are too
short to answer the question.

**Redrawing** (``python -m figures.experiments.budget_scan --redraw DIR/budget_scan.json``). The effects
are functions of the finals alone, so a change to ``EFFECTS`` needs no retraining: this
recomputes the effects, their verdict notes, the PNG and the folder's ``summary.md`` from a
saved JSON, and records the redraw in it; the CSV, sweeps and finals stay as trained.
"""
import argparse
import concurrent.futures
import functools
import json
import multiprocessing
import pathlib
import time

import numpy as np
import torch
from torch.nn import functional as F

from .. import budget_sweep as S
from .. import common as C
from .. import data, models
from ..catalogue import FIGURES
from ..summary import write_summary
from .shakespeare_gpt import _ADAMW_BETAS, _OFFICIAL, _mars

NAME = "budget_scan"
_MODEL = dict(width=64, depth=2, heads=2, block=64, batch=16)
BUDGET = {
    "tiny": dict(steps=(2, 4), width=16, depth=1, heads=2, block=16, batch=2, val_windows=4,
                 evals=1, seeds=2, tune_seeds=1, first_points=3, points=3, max_widen=1),
    "quick": dict(steps=(64, 256), width=32, depth=1, heads=2, block=32, batch=8,
                  val_windows=64, evals=4, seeds=3, tune_seeds=1, first_points=3, points=3,
                  max_widen=2),
    "full": dict(steps=(1024, 2048, 4096, 8192), **_MODEL, val_windows=256, evals=8, seeds=3,
                 tune_seeds=1, first_points=5, points=3, max_widen=3),
}
FACTOR = 2.0  # lr grid spacing
WARMUP = 0.1  # fraction of each run's steps (figure 5's)
TUNING_SEED = 100

ADAMW, MARS = C.Spec("AdamW", "AdamW"), _mars(0.025, _OFFICIAL)
MARS_G0, MARS_ADAMW_BETAS = _mars(0.0, _OFFICIAL), _mars(0.025, _ADAMW_BETAS)
MARS_M = C.Spec("MARS-M", "MARS-M")
CURVES = [ADAMW, MARS, MARS_G0, MARS_ADAMW_BETAS, MARS_M]  # not SPECS: no --jobs lr workers
# (name, what a positive value favours, first, second): effect = L(first) - L(second)
EFFECTS = [
    ("MARS-AdamW vs AdamW: L(AdamW) − L(MARS-AdamW)", "MARS-AdamW", ADAMW.label, MARS.label),
    ("variance reduction at official betas: L(γ=0) − L(γ=0.025)", "γ=0.025", MARS_G0.label,
     MARS.label),
    ("betas at γ=0.025: L(0.9,0.95) − L(0.95,0.99)", "official betas", MARS_ADAMW_BETAS.label,
     MARS.label),
    ("MARS-M vs AdamW: L(AdamW) − L(MARS-M)", "MARS-M", ADAMW.label, MARS_M.label),
    # per seed, the first effect is this one plus the variance reduction's, exactly: it says
    # how much of MARS-AdamW's lead remains without the variance reduction
    ("MARS-AdamW γ=0 vs AdamW: L(AdamW) − L(γ=0)", "γ=0 at official betas", ADAMW.label,
     MARS_G0.label),
]


# ------------------------------------------------------------------ one training run
@functools.lru_cache(maxsize=4)
def _task_data(block, val_windows):
    train_ids, val_ids, vocab = data.shakespeare()
    val = data.windows(val_ids, val_windows, block, torch.Generator().manual_seed(1234))
    return train_ids, val, len(vocab)


def train_run(b, spec, lr, seed, steps, eval_every, device):
    """The rows of one run (a top-level function: the ``--jobs`` workers run it)."""
    train_ids, (val_x, val_y), vocab = _task_data(b["block"], b["val_windows"])
    val_x, val_y = val_x.to(device), val_y.to(device)

    def loss_fn(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    @torch.no_grad()
    def evaluate(model):
        return dict(val_loss=loss_fn(model(val_x), val_y).item())

    rows, _ = C.train(C.Context(device=device, progress=False),
                      lambda: models.GPT(vocab, b["block"], b["width"], b["depth"], b["heads"]),
                      spec, lr, seed, steps,
                      lambda gen: data.windows(train_ids, b["batch"], b["block"], gen),
                      loss_fn, evaluate, eval_every, warmup=WARMUP,
                      tokens_per_step=b["batch"] * b["block"])
    return rows


def _init_worker(threads):
    torch.set_num_threads(threads)


def _executor(jobs):
    """``jobs`` spawned processes, each with this process's torch thread count."""
    if jobs <= 1:
        return S.Serial()
    return concurrent.futures.ProcessPoolExecutor(
        jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
        initargs=(torch.get_num_threads(),))


def fmt_tokens(n):
    return f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n / 1e3:.3g}k" if n >= 1e3 else str(n)


def tag(label, tokens):
    """A curve at one budget: its name in the CSV's optimizer column and the summary."""
    return f"{label} @ {fmt_tokens(tokens)} tokens"


def csv_rows(specs, sweeps, runs, seeds, tokens):
    """Every evaluation of every reported run (metric ``val_loss``) and every grid point of
    every sweep (metric ``tuning_val_loss``, step -1, tokens = the budget)."""
    rows = []
    for label, spec in specs.items():
        for i, tok in enumerate(tokens):
            sw, name = sweeps[label][i], tag(label, tok)
            for seed, r in zip(seeds, runs[label][i]):
                rows += C.curve_rows(NAME, C.Spec(name, spec.base, spec.overrides), sw["lr"],
                                     seed, r, ["val_loss"])
            rows += [dict(figure=NAME, optimizer=name, lr=lr, hparams=C.hparams_json(spec),
                          seed=";".join(map(str, sw["seeds"])), step=-1, wall_s="", tokens=tok,
                          metric="tuning_val_loss", value=v)
                     for lr, v in zip(sw["grid"], sw["val"])]
    return rows


# ------------------------------------------------------------------ the effects
def effect_table(finals, tokens):
    """Per effect and budget: the paired interval (and Welch's) and its classification.
    ``finals[label][i]``: final validation losses of the reported seeds at budget i."""
    out = []
    for name, favours, a, b in EFFECTS:
        for i, tok in enumerate(tokens):
            paired = S.paired_ci(finals[a][i], finals[b][i])
            out.append(dict(effect=name, favours=favours, first=a, second=b, tokens=tok,
                            **{k: paired[k] for k in ("diff", "lo", "hi", "se", "df", "t_crit",
                                                      "n", "method")},
                            welch=S.welch_ci(finals[a][i], finals[b][i]),
                            verdict=S.classify(paired["lo"], paired["hi"])))
    return out


def verdict_lines(table):
    """One line per effect: at which budgets it is positive, negative, within noise."""
    lines = []
    for name, favours, _, _ in EFFECTS:
        rows = [r for r in table if r["effect"] == name]
        parts = []
        for verdict in ("positive", "negative", "within noise", "undetermined"):
            at = [fmt_tokens(r["tokens"]) for r in rows if r["verdict"] == verdict]
            if at:
                parts.append(f"{verdict} at {', '.join(at)} tokens")
        nums = "; ".join(f"{fmt_tokens(r['tokens'])}: {r['diff']:+.4f} [{r['lo']:+.4f}, "
                         f"{r['hi']:+.4f}]" for r in rows)
        lines.append(f"{name} (positive favours {favours}): {'; '.join(parts)} "
                     f"(paired 95 % t intervals, nats: {nums})")
    return lines


# ------------------------------------------------------------------ the figure
def run(ctx):
    if ctx.sweep_only:  # the scan tunes inside its own run: nothing to sweep separately
        raise C.SweepFinished([])
    b = BUDGET[ctx.mode]
    steps, per_step = list(b["steps"]), b["batch"] * b["block"]
    tokens = [n * per_step for n in steps]
    ctx.budget_steps = steps[-1]
    seeds = ctx.seed_list({m: BUDGET[m]["seeds"] for m in C.MODES})
    tuning = [TUNING_SEED + i for i in range(b["tune_seeds"])]
    specs = {s.label: s for s in CURVES}
    jobs = ctx.jobs

    def task(label, lr, seed, n, tuning_run):
        every = n if tuning_run else max(1, n // b["evals"])
        return train_run, (b, specs[label], lr, seed, n, every, ctx.device)

    def log(label, i, sweep):
        if ctx.progress:
            print(f"  [{NAME} {time.perf_counter() - start:.0f} s] {tag(label, tokens[i])}: "
                  f"lr {C.fmt_lr(sweep['lr'])} of "
                  f"{', '.join(map(C.fmt_lr, sweep['grid']))}", flush=True)

    start = time.perf_counter()
    with _executor(jobs) as pool:
        sweeps, runs = S.scan(pool, jobs, {k: s.grid_center() for k, s in specs.items()}, steps,
                              task, C.final_score, tuning, seeds, b["first_points"],
                              b["points"], FACTOR, b["max_widen"], log)
    wall = time.perf_counter() - start
    finals = {k: [[C.final_score(rows, n) for rows in runs[k][i]] for i, n in enumerate(steps)]
              for k in specs}
    table = effect_table(finals, tokens)

    rows = csv_rows(specs, sweeps, runs, seeds, tokens)
    summary = []
    for i, (n, tok) in enumerate(zip(steps, tokens)):  # summary_rows reads ctx.budget_steps
        ctx.budget_steps = n
        curves = {tag(k, tok): dict(
            lr=sweeps[k][i]["lr"], runs=runs[k][i],
            source=f"swept at this budget ({len(sweeps[k][i]['grid'])} points"
                   f"{', best on the edge' if sweeps[k][i]['edge'] else ''})") for k in specs}
        for r in C.summary_rows(NAME, curves, tag(ADAMW.label, tok)):
            summary.append(dict(r, tokens=tok, reference="AdamW at the same budget"))
    ctx.budget_steps = steps[-1]

    n_par = models.n_params(models.GPT(len(data.shakespeare()[2]), b["block"], b["width"],
                                       b["depth"], b["heads"]))
    trained = sum(r[-1]["tokens"] for k in specs for i in range(len(steps)) for r in runs[k][i])
    trained += sum(len(sw["grid"]) * len(sw["seeds"]) * tok
                   for k in specs for sw, tok in zip(sweeps[k], tokens))
    listed = ", ".join(f"{n:,} steps ({fmt_tokens(t)} tokens)" for n, t in zip(steps, tokens))
    notes = [f"model: {n_par:,} parameters (width {b['width']}, depth {b['depth']}, context "
             f"{b['block']}), batch {b['batch']} x {b['block']} = {per_step:,} tokens per step; "
             f"budgets {listed}",
             f"lr per curve and budget: grid of factor {FACTOR:g}, {b['first_points']} points "
             f"around the registry centre at the first budget, {b['points']} around the "
             f"previous budget's best after, widened by one point while the best is on an edge "
             f"(at most {b['max_widen']}x); tuning seeds {tuning}, reported seeds {seeds}"]
    for k in specs:
        lrs = ", ".join(f"{fmt_tokens(t)} {C.fmt_lr(sw['lr'])}{' (edge)' if sw['edge'] else ''}"
                        for sw, t in zip(sweeps[k], tokens))
        notes.append(f"tuned lr of {k}: {lrs}")
    notes += verdict_lines(table)
    notes.append(f"scan: {fmt_tokens(trained)} training tokens in {wall:.0f} s with {jobs} "
                 f"process(es), {torch.get_num_threads()} torch thread(s) each")
    fig = draw(specs, sweeps, finals, table, tokens, n_par, b, seeds)
    C.write_outputs(ctx, NAME, rows, fig, dict(
        budget=b, budgets=[dict(steps=n, tokens=t) for n, t in zip(steps, tokens)], seeds=seeds,
        tuning_seeds=tuning, grid_rule=dict(factor=FACTOR, first_points=b["first_points"],
                                            points=b["points"], max_widen=b["max_widen"],
                                            first_centers={k: s.grid_center()
                                                           for k, s in specs.items()}),
        statistics="effect = L(first) - L(second), final validation loss, over the reported "
                   "seeds; 95 % paired t interval of the per-seed differences (Welch's "
                   "unpaired interval under 'welch'); verdict: positive / negative when the "
                   "paired interval excludes 0, else within noise",
        sweeps=sweeps, finals=finals, effects=table, summary=summary, notes=notes, params=n_par,
        wall_s=wall, jobs=jobs, trained_tokens=trained,
        task_title="Budget scan of the char-GPT (final validation loss vs training tokens)"))
    short = "; ".join(line.split(" (paired")[0] for line in verdict_lines(table))
    return f"budget scan over {', '.join(map(fmt_tokens, tokens))} tokens: {short}", summary


def draw(specs, sweeps, finals, table, tokens, n_par, b, seeds):
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_eff, ax_lr) = plt.subplots(1, 3, figsize=(15, 4.2))
    for j, k in enumerate(specs):
        vals = [np.asarray(f, float) for f in finals[k]]
        mean = [v.mean() for v in vals]
        sd = [v.std(ddof=1) if len(v) > 1 else 0.0 for v in vals]
        ax_loss.errorbar(tokens, mean, yerr=sd, marker="o", ms=3, capsize=2, label=k)
        x = [tok * 2 ** (0.08 * (j - 2)) for tok in tokens]  # side by side
        line, = ax_lr.plot(x, [sw["lr"] for sw in sweeps[k]], marker="o", ms=4, label=k)
        for sw, xi in zip(sweeps[k], x):
            ax_lr.scatter([xi] * len(sw["grid"]), sw["grid"], s=6, color=line.get_color(),
                          alpha=0.4)
    for j, (name, _, _, _) in enumerate(EFFECTS):
        rows = [r for r in table if r["effect"] == name]
        x = [r["tokens"] * 2 ** (0.08 * (j - (len(EFFECTS) - 1) / 2)) for r in rows]
        y = np.array([r["diff"] for r in rows])
        err = np.array([[r["diff"] - r["lo"] for r in rows], [r["hi"] - r["diff"] for r in rows]])
        ax_eff.errorbar(x, y, yerr=np.nan_to_num(err), marker="o", ms=3, capsize=2, label=name)
    ax_eff.axhline(0, color="k", lw=0.7)
    titles = ("final validation loss (mean ± sd over seeds)",
              "effects, 95 % paired t intervals (> 0 favours MARS / γ / official betas)",
              "tuned lr (line) and the swept grid (dots)")
    ylabels = ("validation loss (nats/char)", "Δ validation loss (nats/char)", "learning rate")
    for ax, title, yl in zip((ax_loss, ax_eff, ax_lr), titles, ylabels):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("training tokens")
        ax.set_ylabel(yl)
        ax.set_title(title, fontsize=8)
        ax.legend(fontsize=6)
    ax_lr.set_yscale("log")
    fig.suptitle(f"char-GPT budget scan ({n_par / 1e6:.3f}M params, context {b['block']}, "
                 f"batch {b['batch']}; every curve lr-tuned at every budget; {len(seeds)} "
                 f"reported seeds)", fontsize=9)
    return fig


# ------------------------------------------------------------------ redrawing a saved scan
_VERDICT_MARK = " (paired 95 % t intervals, nats: "  # in every verdict line, in no other note


def redraw(path):
    """Recompute effects, verdict notes, PNG and summary.md from the saved JSON at ``path``."""
    path = pathlib.Path(path)
    meta = json.loads(path.read_text())
    if meta.get("figure") != NAME:
        raise ValueError(f"{path} is not a {NAME} JSON (its figure is {meta.get('figure')!r})")
    tokens = [x["tokens"] for x in meta["budgets"]]
    table = effect_table(meta["finals"], tokens)
    notes = meta["notes"]
    at = next((i for i, n in enumerate(notes) if _VERDICT_MARK in n), len(notes))
    kept = [n for n in notes if _VERDICT_MARK not in n]
    meta["notes"] = kept[:at] + verdict_lines(table) + kept[at:]
    meta["effects"] = table
    meta["redrawn"] = dict(
        date=C.stamp(), command=f"python -m figures.experiments.budget_scan --redraw {path}",
        what="effects, their verdict notes and the PNG recomputed from this JSON's finals; "
             "CSV, sweeps and finals as trained")
    labels = list(meta["sweeps"])  # draw() needs only the curves' labels, in order
    C.save_png(draw(labels, meta["sweeps"], meta["finals"], table, tokens, meta["params"],
                    meta["budget"], meta["seeds"]), path.with_suffix(".png"))
    path.write_text(json.dumps(meta, indent=1, default=str) + "\n")
    summary = path.parent / "summary.md"
    old = summary.read_text().splitlines() if summary.exists() else []
    lr_text = next((line for line in old if line.startswith("**Learning rates.**")), None)
    write_summary(path.parent, FIGURES, None, [], lr_text=lr_text)  # no lr was swept: keep its text
    return meta


if __name__ == "__main__":
    cli = argparse.ArgumentParser(prog="python -m figures.experiments.budget_scan", description=redraw.__doc__)
    cli.add_argument("--redraw", required=True, metavar="JSON", help="a saved budget_scan.json")
    redraw(cli.parse_args().redraw)
