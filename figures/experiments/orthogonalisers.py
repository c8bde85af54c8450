r"""Figure 10: what an orthogonaliser's accuracy buys MARS-M (issue 32, item 3).

Four orthogonalisers, the options of ``MARSM`` (``ns_coefficients`` x ``orthogonalizer``):
the authors' quintic Newton-Schulz, Polar Express's per-step quintics, and each through the
Gram matrix (``torch_impl.common.matrix_functions.gram_newton_schulz``; a nearly square matrix,
aspect ratio <= 1.5, runs the standard iteration).

(a) **Accuracy against cost, on the char-GPT's own matrices.** The matrices are the ones
MARS-M orthogonalises: the momentum buffers M_t of every block's 2-D Linear weight (qkv,
proj, fc, out; MARS-M on them, AdamW on the rest, as figure 5) after the last step of panel
(b)'s run with the default option (authors' Newton-Schulz, bf16), one set per seed. Each
option and step count k = 1..``max_ns_steps`` orthogonalises them as MARS-M calls it (M16:
``cast_first=True``, eps 1e-7, in bfloat16 -- the default -- and in float32, dashed), and is
scored by the relative Frobenius distance to the exact polar factor,
||O - U V^T||_F / ||U V^T||_F, with U V^T = ``orthogonalize_svd`` of M in float64; plotted:
the mean over the matrices and seeds against the flops of orthogonalising all of one step's
matrices once. **Flops convention:** 2 x the multiply-adds counted by
``torch_impl.common.matrix_functions.gram_flops`` (its standard count for Newton-Schulz and for
a Gram option on a matrix where the Gram form does not pay, its Gram count otherwise) times
n^3, n = min(rows, cols), summed over the matrices; the normalisation and the casts are not
counted. The SVD is the exact reference (distance 0) and is not on the flops axis: its cost
is not a count of matrix products (the notes quote Golub and Van Loan's R-SVD estimate,
6 m n^2 + 20 n^3 flops for U, s, V of an m x n matrix, m >= n, plus 2 m n^2 for U V^T, for
scale only).

(b) **The loss at a fixed budget.** The char-GPT (figure 5's model and data) trained with
MARS-M under each option at ns_steps = 5 in bf16 (the authors' dtype; the other figures run
MARS-M's Newton-Schulz in float32, figures/registry.py), the same lr (figure 5's tuned MARS-M
lr, the one tuned for its default option), the same seeds, initialisations and batches,
the same schedule (figure 5's: 10 % warm-up, cosine to 0.1). Validation loss against step;
the JSON's ``summary`` has each option's final validation loss, mean ± sd over the seeds.
(c) the loss gap to the default option, paired seed by seed; (d) each option's final gap
against its panel-(a) distance at 5 steps.
"""
import json
import math

import numpy as np
import torch
from torch.nn import functional as F

from torch_impl.common.matrix_functions import (gram_flops, gram_newton_schulz, gram_pays,
                                                newton_schulz, orthogonalize_svd)

from .. import common as C
from .. import data, fixed_sums, models

NAME = "orthogonalisers"
BUDGET = {
    "tiny": dict(steps=3, eval_every=3, batch=2, block=16, width=16, depth=1, heads=2,
                 val_windows=4, seeds=2, max_ns_steps=8),
    "quick": dict(steps=60, eval_every=20, batch=8, block=64, width=128, depth=2, heads=4,
                  val_windows=64, seeds=3, max_ns_steps=8),
    "full": dict(steps=300, eval_every=25, batch=16, block=64, width=128, depth=4, heads=4,
                 val_windows=256, seeds=5, max_ns_steps=10),
}
# (label, ns_coefficients, orthogonalizer); the first is MARS-M's default, the reference
OPTIONS = (("authors NS", "authors", "newton_schulz"),
           ("Polar Express NS", "polar_express", "newton_schulz"),
           ("authors Gram-NS", "authors", "gram_newton_schulz"),
           ("Polar Express Gram-NS", "polar_express", "gram_newton_schulz"))
DTYPES = ("bfloat16", "float32")
NS_STEPS = 5  # panel (b): MARS-M's default
NS_EPS = 1e-7  # MARS-M's (M16)
WARMUP = 0.1  # figure 5's schedule: 10 % linear warm-up, then cosine to 0.1
LR_TASK, LR_LABEL = "shakespeare_gpt", "MARS-M"  # the lr: figure 5's tuned MARS-M
Y_TOP = 2.0  # panel (a): a distance above this (a diverged iteration) is drawn at the top
COLORS = dict(zip((o[0] for o in OPTIONS), ("C0", "C1", "C2", "C3")))


def spec(option):
    """The figures' MARS-M (registry defaults: wd 1e-2, momentum 0.95, gamma 0.025, the head
    on AdamW) with this option's orthogonaliser, 5 steps, bf16."""
    label, coefficients, orthogonalizer = next(o for o in OPTIONS if o[0] == option)
    return C.Spec(f"MARS-M, {label}", "MARS-M",
                  (("ns_dtype", "bfloat16"), ("ns_steps", NS_STEPS),
                   ("ns_coefficients", coefficients), ("orthogonalizer", orthogonalizer)))


# ------------------------------------------------------------------ panel (a)
def orthogonalise(M, steps, dtype, coefficients, orthogonalizer):
    """O of M (one matrix or a batch) as MARS-M computes it (M16), returned in float64."""
    fn = gram_newton_schulz if orthogonalizer == "gram_newton_schulz" else newton_schulz
    return fn(M, steps=steps, eps=NS_EPS, dtype=getattr(torch, dtype),
              coefficients=coefficients, cast_first=True).double()


def option_flops(shapes, steps, orthogonalizer):
    """Flops (2 x multiply-adds, ``gram_flops`` x n^3) of one orthogonalisation of every
    matrix of ``shapes``, the normalisation not counted."""
    total = 0.0
    for rows, cols in shapes:
        standard, gram = gram_flops(rows, cols, steps)
        use_gram = orthogonalizer == "gram_newton_schulz" and gram_pays(rows, cols, steps)
        total += 2 * (gram if use_gram else standard) * min(rows, cols) ** 3
    return total


def svd_flops(shapes):
    """Golub and Van Loan's R-SVD count for U, s, V (6 m n^2 + 20 n^3, m >= n) plus the
    product U V^T (2 m n^2), summed: for scale only (see the module docstring)."""
    return float(sum(6 * max(s) * min(s) ** 2 + 20 * min(s) ** 3 + 2 * max(s) * min(s) ** 2
                     for s in shapes))


def distances(matrices, max_steps):
    """{(option, dtype, steps): {shape: [relative distance of each matrix]}} for a list of
    float32 matrices (same-shape matrices orthogonalised as one batch, as MARS-M does)."""
    by_shape = {}
    for M in matrices:
        by_shape.setdefault(tuple(M.shape), []).append(M.detach().float().cpu())
    exact = {s: orthogonalize_svd(torch.stack(ms).double()) for s, ms in by_shape.items()}
    out = {}
    for label, coefficients, orthogonalizer in OPTIONS:
        for dtype in DTYPES:
            for k in range(1, max_steps + 1):
                entry = out.setdefault((label, dtype, k), {})
                for s, ms in by_shape.items():
                    O = orthogonalise(torch.stack(ms), k, dtype, coefficients, orthogonalizer)
                    P = exact[s]
                    d = (torch.linalg.matrix_norm(O - P) / torch.linalg.matrix_norm(P))
                    entry[s] = [float(v) for v in d]
    return out


def shape_name(shape):
    return f"{shape[0]}x{shape[1]}"


# ------------------------------------------------------------------ the figure
def run(ctx):
    import matplotlib.pyplot as plt

    b = BUDGET[ctx.mode]
    ctx.budget_steps = b["steps"]
    seeds = ctx.seed_list({m: BUDGET[m]["seeds"] for m in C.MODES})
    train_ids, val_ids, vocab = data.shakespeare()
    val_x, val_y = data.windows(val_ids, b["val_windows"], b["block"],
                                torch.Generator().manual_seed(1234))
    val_x, val_y = val_x.to(ctx.device), val_y.to(ctx.device)

    def model_fn():
        return models.GPT(len(vocab), b["block"], b["width"], b["depth"], b["heads"])

    def loss_fn(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    @torch.no_grad()
    def evaluate(model):
        return dict(val_loss=loss_fn(model(val_x), val_y).item())

    entry, mode = ctx.tuned_entry(LR_TASK, LR_LABEL)
    lr, lr_source = ((entry["lr"], f"{LR_TASK}'s tuned {LR_LABEL} lr ({mode} budget)")
                     if entry else (C.CENTER["MARS-M"], "UNTUNED grid centre"))

    # (b) the runs; the default option's final momentum buffers feed (a)
    curves, momenta = {}, {}
    for label, _, _ in OPTIONS:
        s = spec(label)
        runs = []
        for seed in seeds:
            rows, opt = C.train(ctx, model_fn, s, lr, seed, b["steps"],
                                lambda gen: data.windows(train_ids, b["batch"], b["block"], gen),
                                loss_fn, evaluate, b["eval_every"], warmup=WARMUP,
                                tokens_per_step=b["batch"] * b["block"],
                                desc=f"{NAME} {s.label}")
            runs.append(rows)
            if label == OPTIONS[0][0]:
                marsm = opt.optimizers[0]
                momenta[seed] = [marsm.state[p]["momentum_buffer"].detach().cpu().float()
                                 for g in marsm.param_groups if g["rule"] == "mars_m"
                                 for p in g["params"] if "momentum_buffer" in marsm.state[p]]
        curves[s.label] = dict(spec=s, lr=lr, source=lr_source, runs=runs, seeds=seeds,
                               switch=[None] * len(seeds))
    rows = C.all_curve_rows(NAME, curves, ["val_loss"])
    summary = C.summary_rows(NAME, curves, spec(OPTIONS[0][0]).label)

    # (a) accuracy against flops on those matrices
    shapes = [tuple(M.shape) for M in momenta[seeds[0]]]
    per_seed = {seed: distances(ms, b["max_ns_steps"]) for seed, ms in momenta.items()}
    table = []
    for label, coefficients, orthogonalizer in OPTIONS:
        for dtype in DTYPES:
            hp = json.dumps(dict(ns_coefficients=coefficients, orthogonalizer=orthogonalizer,
                                 ns_dtype=dtype, cast_first=True, eps=NS_EPS), sort_keys=True)
            for k in range(1, b["max_ns_steps"] + 1):
                flops = option_flops(shapes, k, orthogonalizer)
                seed_means = []
                for seed in seeds:
                    d = per_seed[seed][label, dtype, k]
                    mean = fixed_sums.mean([v for vs in d.values() for v in vs])
                    seed_means.append(mean)
                    base = dict(figure=NAME, optimizer=label, lr=lr, hparams=hp, seed=seed,
                                step=k, wall_s="", tokens=0)
                    # one metric per step count: each point's tolerance is its own seed
                    # spread (figures/repro.py), not that of the curve's last (k = max)
                    rows.append(dict(base, metric=f"polar_distance|{dtype}|ns_steps={k}",
                                     value=mean))
                    rows.append(dict(base, metric=f"flops|{dtype}", value=flops))
                by_shape = {shape_name(s): fixed_sums.mean([v for seed in seeds
                                                            for v in per_seed[seed][label, dtype,
                                                                                    k][s]])
                            for s in per_seed[seeds[0]][label, dtype, k]}
                table.append(dict(option=label, dtype=dtype, ns_steps=k, flops=flops,
                                  distance=fixed_sums.mean(seed_means),
                                  distance_sd=fixed_sums.sd(seed_means)
                                  if len(seed_means) > 1 else 0.0,
                                  by_shape=by_shape))

    def cell(option, dtype, k):
        return next(t for t in table if (t["option"], t["dtype"], t["ns_steps"])
                    == (option, dtype, k))

    # (b) each option's loss minus the reference's, seed by seed (same seeds, same batches)
    ref = summary[0]
    ref_runs = curves[ref["optimizer"]]["runs"]
    paired, gaps = [], {}
    for r in summary:
        runs = curves[r["optimizer"]]["runs"]
        st = sorted(set.intersection(*(set(x["step"] for x in rs) for rs in runs + ref_runs)))
        at = lambda rs, s: next(x["val_loss"] for x in rs if x["step"] == s)  # noqa: E731
        diff = np.array([[at(a, s) - at(o, s) for s in st] for a, o in zip(runs, ref_runs)])
        gaps[r["optimizer"]] = (np.array(st), diff)
        final = diff[:, -1] if st and st[-1] == b["steps"] else np.array([math.inf])
        sd = fixed_sums.sd(final) if len(final) > 1 else math.nan
        paired.append(dict(optimizer=r["optimizer"], reference=ref["optimizer"],
                           diff=fixed_sums.mean(final), sd=sd, n=len(final),
                           t=fixed_sums.mean(final) / (sd / math.sqrt(len(final)))
                           if sd and sd > 0 else math.nan))

    # ------------------------------------------------------------------ drawing
    fig, axes = plt.subplots(1, 4, figsize=(21, 4.4))
    ax = axes[0]
    for label, _, _ in OPTIONS:
        for dtype, style in zip(DTYPES, ("o-", "x--")):
            ts = [cell(label, dtype, k) for k in range(1, b["max_ns_steps"] + 1)]
            ys = [min(t["distance"], Y_TOP) for t in ts]  # a diverged one: at the top
            ax.plot([t["flops"] / 1e9 for t in ts], ys, style,
                    color=COLORS[label], ms=4, lw=1.2 if dtype == "bfloat16" else 0.8,
                    label=f"{label} ({'bf16' if dtype == 'bfloat16' else 'fp32'})")
            for t, y in zip(ts, ys):
                text = str(t["ns_steps"]) if dtype == "bfloat16" else ""
                if t["distance"] > Y_TOP or not math.isfinite(t["distance"]):
                    text = f"{t['ns_steps']}: {t['distance']:.2g} ↑"
                if text:
                    ax.annotate(text, (t["flops"] / 1e9, y), fontsize=6, xytext=(2, 2),
                                textcoords="offset points", color=COLORS[label])
    ax.set_yscale("log")
    ax.set_ylim(top=Y_TOP * 1.5)
    ax.set_xlabel("GFLOP per optimizer step (all matrices once; 2 × multiply-adds)")
    ax.set_ylabel("‖O − UVᵀ‖_F / ‖UVᵀ‖_F (mean over matrices, seeds)")
    ax.set_title("(a) distance to the exact polar factor (SVD); numbers: NS steps",
                 fontsize=9)
    ax.legend(fontsize=6)

    ax = axes[1]
    for label, _, _ in OPTIONS:
        c = curves[spec(label).label]
        st, m, sd = C.mean_curve(c["runs"], "val_loss")
        C.band(ax, st, m, sd, label, color=COLORS[label])
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/char)")
    lo = min(np.min(C.mean_curve(c["runs"], "val_loss")[1]) for c in curves.values())
    ax.set_ylim(lo - 0.05, lo + 0.6)
    ax.set_title(f"(b) MARS-M, ns_steps={NS_STEPS}, bf16, lr {C.fmt_lr(lr)} "
                 f"({len(seeds)} seeds, mean ± sd)", fontsize=9)
    ax.legend(fontsize=7)

    ax = axes[2]
    for label, _, _ in OPTIONS:
        st, diff = gaps[spec(label).label]
        C.band(ax, st, diff.mean(0), diff.std(0), label, color=COLORS[label])
    ax.axhline(0, color="grey", lw=0.6)
    ax.set_xlabel("step")
    ax.set_ylabel(f"val loss − {OPTIONS[0][0]}'s, same seed (nats/char)")
    ax.set_title("(c) the same, paired with the default option seed by seed (mean ± sd)",
                 fontsize=9)
    ax.legend(fontsize=7)

    ax = axes[3]
    for pr, (label, _, _) in zip(paired, OPTIONS):
        t = cell(label, "bfloat16", NS_STEPS)
        ax.errorbar([t["distance"]], [pr["diff"]], yerr=[0 if pr is paired[0] else pr["sd"]],
                    xerr=[t["distance_sd"]], fmt="o", color=COLORS[label], capsize=3,
                    label=label)
    ax.axhline(0, color="grey", lw=0.6)
    ax.set_xlabel(f"distance to the polar factor at {NS_STEPS} steps (bf16)")
    ax.set_ylabel(f"final val loss − {OPTIONS[0][0]}'s (step {b['steps']}, paired)")
    ax.set_title("(d) what accuracy buys: final loss gap vs accuracy", fontsize=9)
    ax.legend(fontsize=7)
    n_par = models.n_params(model_fn())
    fig.suptitle(f"Orthogonalisers for MARS-M on the char-GPT ({n_par / 1e6:.2f}M params, "
                 f"width {b['width']}, depth {b['depth']}; {b['steps']} steps of "
                 f"{b['batch'] * b['block']} tokens; (a) on the {len(shapes)} block matrices' "
                 f"MARS-M momentum after the last step, per seed)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))

    # ------------------------------------------------------------------ notes and JSON
    notes = [f"matrices of (a): MARS-M's momentum buffers after step {b['steps']} of the "
             f"'{OPTIONS[0][0]}' run, per seed: "
             + ", ".join(f"{shapes.count(s)} x {shape_name(s)}" for s in dict.fromkeys(shapes))
             + f"; an SVD of them all would take ≈ {svd_flops(shapes):.3g} flops (Golub-Van "
             "Loan R-SVD + U Vᵀ, not matrix products: for scale only)"]
    for label, _, orthogonalizer in OPTIONS:
        t = cell(label, "bfloat16", NS_STEPS)
        t32 = cell(label, "float32", NS_STEPS)
        r = next(r for r in summary if r["optimizer"] == spec(label).label)
        pr = next(p for p in paired if p["optimizer"] == r["optimizer"])
        vs = ("the reference" if r is ref else
              f"{pr['diff']:+.4f} ± {pr['sd']:.4f} vs {OPTIONS[0][0]}, paired over the seeds, "
              f"t = {pr['t']:.2f}")
        notes.append(f"{label}: at {NS_STEPS} steps distance {t['distance']:.3g} (bf16) / "
                     f"{t32['distance']:.3g} (fp32), {t['flops']:.3g} flops per step; final "
                     f"val loss {r['final']:.4f} ± {r['sd']:.4f} ({vs})")
    best = {label: min((cell(label, "bfloat16", k) for k in range(1, b["max_ns_steps"] + 1)),
                       key=lambda t: t["distance"]) for label, _, _ in OPTIONS}
    notes.append("smallest bf16 distance over 1.." + str(b["max_ns_steps"]) + " steps: "
                 + ", ".join(f"{k} {t['distance']:.3g} at {t['ns_steps']} steps"
                             for k, t in best.items()))
    diverged = [t for t in table if not t["distance"] <= 1.0]
    if diverged:
        notes.append("distance above 1 (the iteration diverged on some matrices): "
                     + ", ".join(f"{t['option']} {t['dtype']} at {t['ns_steps']} steps "
                                 f"({t['distance']:.3g}; worst shape "
                                 f"{max(t['by_shape'], key=t['by_shape'].get)})"
                                 for t in diverged))
    C.write_outputs(ctx, NAME, rows, fig, dict(
        budget=b, seeds=seeds, summary=summary, paired=paired, accuracy=table, shapes=[list(s) for s in shapes],
        lr=lr, lr_source=lr_source, ns_steps=NS_STEPS, params=n_par,
        options=[dict(label=o[0], ns_coefficients=o[1], orthogonalizer=o[2]) for o in OPTIONS],
        definitions=dict(
            distance="||O - U V^T||_F / ||U V^T||_F, U V^T = orthogonalize_svd(M) in float64, "
                     "O as MARS-M computes it (cast_first=True, eps 1e-7) in the dtype named",
            flops="2 x gram_flops(rows, cols, steps) x min(rows, cols)^3 (the standard count "
                  "where the Gram form does not pay), summed over the matrices; "
                  "normalisation and casts not counted"),
        notes=notes, task_title="Orthogonalisers for MARS-M: accuracy, flops and loss "
                                "(char-GPT, validation loss, nats/char)"))
    short = ", ".join(f"{label} d5={cell(label, 'bfloat16', NS_STEPS)['distance']:.3g} "
                      f"loss {r['final']:.4f}" for r, (label, _, _) in zip(summary, OPTIONS))
    return f"orthogonalisers: {short}", summary
