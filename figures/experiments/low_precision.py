r"""Figure 12: is convergence kept when MARS-AdamW stores its state in fewer bits? (issue 47
item 6).

**The question.** Final validation loss of MARS-AdamW with its state (``exp_avg``,
``exp_avg_sq``, ``last_grad``) stored in float32, in bf16 rounded to nearest
(``state_dtype=torch.bfloat16``), in bf16 rounded stochastically (``state_rounding=
"stochastic"``, LP1 with the LP2 streams) and as 8-bit block-wise codes
(``state_quantization="blockwise8"``, LP4; the tensors smaller than a block, which MARS
refuses to quantize, go in a second group with float32 state), on two tasks: the budget
scan's char-GPT (figure 9's model and data) and BERT masked-LM (figure 7's task, a smaller
BERT). Each variant's difference from float32's final loss is compared with the seed noise.

**Why β₂ = 0.999 and long runs.** Round-to-nearest loses an update smaller than half an ulp
of the stored value: bf16 keeps 8 significant bits, so half an ulp is 2⁻⁹ ≈ 0.2 % of v
(up to 0.4 % near the bottom of a binade). The second moment moves by
(1 − β₂)(g² − v) per step; at β₂ = 0.999 that is 0.1 % of v times (g²/v − 1), so v rises only
on a step whose g² is about three times v, and never falls (a fall needs v − g² > 2v). From
v = 0 the bias-corrected estimate keeps pace until 1 − β₂ᵗ nears a third (t ≈ 400 steps),
after which v is frozen below its target or ratcheted up by the largest gradients, and cannot
follow the gradients as they shrink. At MARS's default β₂ = 0.99 the same threshold is ten
times easier to cross, so runs of a few hundred steps would show nothing: the figure uses β₂ =
0.999 (AdamW's and LAMB's default, the setting users run) and runs of thousands of steps in
``--full``. The first moment (β₁ = 0.95: 5 % of m per step) and MARS's AdamW fallback on the
1-D tensors (``betas_1d`` (0.9, 0.95)) move far more than an ulp per step and are a control.
Stochastic rounding keeps E[v] on the float32 recursion (LP1 is unbiased), and the 8-bit
codes store v with a per-block scale, so neither has a threshold below which v stops.

**Statistics.** Seed s gives every variant the same initial weights and batches, so each
variant's effect is the per-seed difference d = L(variant) − L(float32) of final validation
losses (positive: the variant ends worse), with the paired 95 % t interval mean(d) ∓
t_{0.975, n−1} sd(d)/√n (``budget_sweep.paired_ci``, scipy's t quantile, as the budget scan);
Welch's unpaired interval is in the JSON too. The seed noise it is read against: float32's own
final losses, sd and SE = sd/√n over the seeds. A variant is *within noise* when its paired
interval contains 0 (``budget_sweep.classify``), and the JSON says also whether |mean d| is
under float32's seed sd.

**Learning rates** are not tuned per variant (the question is what the storage does to the run
a float32 lr was chosen for): the char-GPT takes the budget scan's tuned MARS-AdamW lr
(0.012 at its quick budget, 256 steps, and at 4.19M tokens in ``--full``); BERT takes 0.01.

**Budgets.** Quick mode is a miniature that checks the figure builds and reproduces (runs too
short for v to stall: its differences are noise); ``--full`` runs 5 seeds at the budget
scan's full model (0.115M parameters) for 2,048 steps of 1,024 tokens and a 2-layer BERT for
1,000 steps. A variant whose option the installed library lacks is not built; the JSON's
``not_built`` names it and the option.
"""
import concurrent.futures
import functools
import inspect
import math
import time

import numpy as np
import torch
from torch.nn import functional as F

from torch_impl import MARS

from .. import budget_sweep as S
from .. import common as C
from .. import data, fixed_sums, models
from . import bert_mlm as BM
from . import budget_scan as BS

NAME = "low_precision"
BETAS = (0.95, 0.999)
GPT, BERT = "char-GPT", "BERT MLM"
BUDGET = {
    "tiny": dict(seeds=2, tasks={
        GPT: dict(steps=4, width=16, depth=1, heads=2, block=16, batch=2, val_windows=4, evals=2,
                  lr=0.012),
        BERT: dict(steps=4, width=16, depth=1, heads=2, block=16, batch=2, val_windows=4,
                   evals=2, lr=0.01)}),
    "quick": dict(seeds=2, tasks={
        GPT: dict(steps=120, width=32, depth=1, heads=2, block=32, batch=8, val_windows=64,
                  evals=4, lr=0.012),
        BERT: dict(steps=80, width=32, depth=1, heads=2, block=32, batch=8, val_windows=32,
                   evals=4, lr=0.01)}),
    "full": dict(seeds=5, tasks={
        GPT: dict(steps=2048, width=64, depth=2, heads=2, block=64, batch=16, val_windows=256,
                  evals=8, lr=0.012),
        BERT: dict(steps=1000, width=64, depth=2, heads=2, block=32, batch=16, val_windows=128,
                   evals=10, lr=0.01)}),
}
WARMUP = 0.1  # of each run's steps (the budget scan's)


def _mars(label, *options):
    return C.Spec(label, "MARS-AdamW", (("betas", BETAS),) + options)


BF16 = ("state_dtype", "bfloat16")
REFERENCE = "float32 state"
VARIANTS = [
    _mars(REFERENCE),
    _mars("bf16 nearest", BF16),
    _mars("bf16 stochastic", BF16, ("state_rounding", "stochastic")),
    _mars("8-bit block-wise", ("state_quantization", "blockwise8")),
]


def missing_options(spec):
    """The spec's keywords that the installed ``MARS`` does not take."""
    params = inspect.signature(MARS.__init__).parameters
    return [key for key, _ in spec.overrides if key not in params]


def tag(task, label):
    """A curve of one task: its name in the CSV's optimizer column and the summary."""
    return f"{task}: {label}"


# ------------------------------------------------------------------ one training run
@functools.lru_cache(maxsize=2)
def _bert_setup(items):
    b = dict(items)
    train_ids, val_ids, chars, special, config = BM.setup(b)
    val = BM.mlm_batch(val_ids, b["val_windows"], b["block"], len(chars), special,
                       torch.Generator().manual_seed(1234))
    return train_ids, val, chars, special, config


def _next_char_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _task(task, b):
    """(model_fn, batch_fn, loss_fn, validation (x, y), tokens per step) of a task."""
    if task == GPT:
        train_ids, val, vocab = BS._task_data(b["block"], b["val_windows"])
        return (lambda: models.GPT(vocab, b["block"], b["width"], b["depth"], b["heads"]),
                lambda gen: data.windows(train_ids, b["batch"], b["block"], gen),
                _next_char_loss, val, b["batch"] * b["block"])
    train_ids, val, chars, special, config = _bert_setup(tuple(sorted(b.items())))
    return (lambda: BM.bert_model(config),
            lambda gen: BM.mlm_batch(train_ids, b["batch"], b["block"], len(chars), special, gen),
            BM.mlm_loss, val, b["batch"] * b["block"])


def one_run(task, b, spec, seed, device):
    """The rows of one seed of one variant (a top-level function: the ``--jobs`` processes
    run it)."""
    model_fn, batch_fn, loss_fn, (val_x, val_y), per_step = _task(task, b)
    val_x, val_y = val_x.to(device), val_y.to(device)

    @torch.no_grad()
    def evaluate(model):
        model.eval()
        loss = loss_fn(model(val_x), val_y).item()
        model.train()
        return dict(val_loss=loss if math.isfinite(loss) else math.inf)

    rows, _ = C.train(C.Context(device=device, progress=False), model_fn, spec, b["lr"], seed,
                      b["steps"], batch_fn, loss_fn, evaluate, max(1, b["steps"] // b["evals"]),
                      warmup=WARMUP, tokens_per_step=per_step)
    return rows


def _finished(jobs, budget, ctx):
    """(index, rows) of each run of ``jobs`` as it finishes: in this process one after the
    other, or on ``ctx.jobs`` spawned processes (each run is seeded: the same rows)."""
    if ctx.jobs <= 1:
        for i, (task, spec, seed) in enumerate(jobs):
            yield i, one_run(task, budget["tasks"][task], spec, seed, ctx.device)
        return
    with BS._executor(ctx.jobs) as pool:
        futures = {pool.submit(one_run, task, budget["tasks"][task], spec, seed, ctx.device): i
                   for i, (task, spec, seed) in enumerate(jobs)}
        for future in concurrent.futures.as_completed(futures):
            yield futures[future], future.result()


# ------------------------------------------------------------------ the statistics
def effect_table(finals, seeds):
    """Per task and variant: d = L(variant) − L(float32) per seed, its paired 95 % t interval
    (and Welch's), the verdict, and float32's seed noise (sd, SE). ``finals[task][label]``:
    final validation losses in the order of ``seeds``."""
    out = []
    for task, by_label in finals.items():
        ref = by_label[REFERENCE]
        sd = fixed_sums.sd(ref) if len(ref) > 1 and all(map(math.isfinite, ref)) else math.nan
        for label, vals in by_label.items():
            if label == REFERENCE:
                continue
            paired = S.paired_ci(vals, ref)
            verdict = {"positive": "worse", "negative": "better"}.get(
                S.classify(paired["lo"], paired["hi"]), S.classify(paired["lo"], paired["hi"]))
            out.append(dict(task=task, variant=label, reference=REFERENCE, seeds=list(seeds),
                            **{k: paired[k] for k in ("diff", "lo", "hi", "se", "df", "t_crit",
                                                      "n", "method")},
                            welch=S.welch_ci(vals, ref), verdict=verdict,
                            reference_sd=sd, reference_se=sd / math.sqrt(len(ref)),
                            within_seed_sd=bool(abs(paired["diff"]) < sd)))
    return out


def verdict_lines(table):
    """One line per task and variant: the difference, its interval and the seed noise."""
    return [f"{r['task']}: {r['variant']} − float32 = {r['diff']:+.4f} ± {r['se']:.4f} (SE), "
            f"95 % paired t [{r['lo']:+.4f}, {r['hi']:+.4f}]: {r['verdict']}; float32's seed "
            f"sd {r['reference_sd']:.4f} (SE {r['reference_se']:.4f}), |d| "
            f"{'<' if r['within_seed_sd'] else '≥'} sd" for r in table]


# ------------------------------------------------------------------ the figure
def draw(curves, finals, table, budget, seeds):
    import matplotlib.pyplot as plt

    tasks = list(curves)
    fig, axes = plt.subplots(len(tasks), 2, figsize=(12, 4.2 * len(tasks)), squeeze=False)
    for row, task in zip(axes, tasks):
        ax_curve, ax_eff = row
        for label, runs in curves[task].items():
            s, m, sd = C.mean_curve(runs, "val_loss")
            C.band(ax_curve, s, m, sd, label)
        ax_curve.set_xlabel("step")
        ax_curve.set_ylabel("validation loss (nats/char)")
        ax_curve.set_title(f"{task}: {budget['tasks'][task]['steps']} steps, lr "
                           f"{budget['tasks'][task]['lr']:g}, β = {BETAS}; mean ± sd over "
                           f"{len(seeds)} seeds", fontsize=8)
        finite = [v for runs in curves[task].values()
                  for v in C.mean_curve(runs, "val_loss")[1] if math.isfinite(v)]
        if finite:
            ax_curve.set_ylim(min(finite) - 0.05, min(finite) + 1.0)
        ax_curve.legend(fontsize=7)
        rows = [r for r in table if r["task"] == task]
        y = np.arange(len(rows))
        for i, r in enumerate(rows):
            ax_eff.errorbar([r["diff"]], [i], xerr=[[r["diff"] - r["lo"]], [r["hi"] - r["diff"]]]
                            if math.isfinite(r["lo"]) else None, fmt="o", capsize=3,
                            color=f"C{i + 1}")
            ax_eff.scatter(np.asarray(finals[task][r["variant"]]) -
                           np.asarray(finals[task][REFERENCE]), [i] * len(seeds), s=8,
                           color=f"C{i + 1}", alpha=0.5)
        sd = rows[0]["reference_sd"] if rows else math.nan
        if math.isfinite(sd):
            ax_eff.axvspan(-sd, sd, color="gray", alpha=0.15, label="± float32's seed sd")
            se = rows[0]["reference_se"]
            ax_eff.axvspan(-se, se, color="gray", alpha=0.25, label="± its SE")
        ax_eff.axvline(0, color="k", lw=0.7)
        ax_eff.set_yticks(y, [r["variant"] for r in rows], fontsize=7)
        ax_eff.set_xlabel("L(variant) − L(float32), final validation loss (> 0: worse)")
        ax_eff.set_title("per seed (dots), mean with its 95 % paired t interval", fontsize=8)
        ax_eff.legend(fontsize=7)
    fig.suptitle("MARS-AdamW with its state in float32, bf16 (nearest / stochastic rounding) "
                 "and 8-bit block-wise codes", fontsize=9)
    fig.tight_layout()
    return fig


def run(ctx):
    if ctx.sweep_only:  # nothing is tuned here
        raise C.SweepFinished([])
    budget = BUDGET[ctx.mode]
    seeds = ctx.seed_list({m: BUDGET[m]["seeds"] for m in C.MODES})
    variants = [v for v in VARIANTS if not missing_options(v)]
    not_built = {v.label: missing_options(v) for v in VARIANTS if missing_options(v)}
    jobs = [(task, spec, seed) for task in budget["tasks"] for spec in variants for seed in seeds]
    start, done = time.perf_counter(), [None] * len(jobs)
    for k, (i, rows) in enumerate(_finished(jobs, budget, ctx), 1):
        done[i] = rows
        if ctx.progress:  # a --full run takes hours on a busy CPU: say how far it is
            task, spec, seed = jobs[i]
            print(f"  [{NAME} {time.perf_counter() - start:.0f} s] run {k} of {len(jobs)}: "
                  f"{tag(task, spec.label)} seed {seed}, final validation loss "
                  f"{rows[-1]['val_loss']:.4f}", flush=True)
    curves = {task: {} for task in budget["tasks"]}
    for (task, spec, _), rows in zip(jobs, done):
        curves[task].setdefault(spec.label, []).append(rows)
    finals = {task: {label: [C.final_score(r, budget["tasks"][task]["steps"]) for r in runs]
                     for label, runs in by.items()} for task, by in curves.items()}
    table = effect_table(finals, seeds)

    rows, summary = [], []
    specs = {v.label: v for v in variants}
    for task, by in curves.items():
        b = budget["tasks"][task]
        for label, runs in by.items():
            spec = C.Spec(tag(task, label), "MARS-AdamW", specs[label].overrides)
            for seed, r in zip(seeds, runs):
                rows += C.curve_rows(NAME, spec, b["lr"], seed, r, ["val_loss"])
        ctx.budget_steps = b["steps"]
        tagged = {tag(task, k): dict(lr=b["lr"], runs=runs, source="fixed: the float32 lr")
                  for k, runs in by.items()}
        for r in C.summary_rows(task, tagged, tag(task, REFERENCE)):
            summary.append(dict(r, reference="float32 state on the same task"))
    notes = [f"{task}: {b['steps']} steps of {b['batch']} x {b['block']} tokens, width "
             f"{b['width']}, depth {b['depth']}, lr {b['lr']:g} (cosine, {WARMUP:.0%} warm-up), "
             f"MARS-AdamW betas {BETAS}" for task, b in budget["tasks"].items()]
    notes += verdict_lines(table)
    if not_built:
        notes.append("not built (the installed MARS lacks the option): " + "; ".join(
            f"{k} ({', '.join(v)})" for k, v in not_built.items()))
    C.write_outputs(ctx, NAME, rows, draw(curves, finals, table, budget, seeds), dict(
        budget=budget, seeds=seeds, betas=list(BETAS), summary=summary, notes=notes,
        finals=finals, effects=table, not_built=not_built,
        statistics="d = L(variant) - L(float32 state), final validation loss, per seed (same "
                   "initial weights and batches); 95 % paired t interval; verdict: worse / "
                   "better when it excludes 0, else within noise; reference_sd / reference_se: "
                   "float32's final losses over the seeds",
        task_title="Low-precision optimizer state: MARS-AdamW's final loss against float32"))
    short = "; ".join(f"{r['task']} {r['variant']} {r['diff']:+.4f} ({r['verdict']})"
                      for r in table)
    return f"low-precision state, difference from float32: {short}" + (
        f"; not built: {', '.join(not_built)}" if not_built else ""), summary
