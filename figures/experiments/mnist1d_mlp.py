"""Figure 3: an MLP on mnist1d (the package's offline generator) -- train and validation loss
vs step and vs wall-clock.

SGD (momentum 0.9), AdamW, MARS-AdamW / -Lion / -Shampoo, MKOR (paper and released
variants), MKOR-H and K-FAC (both on the SGD backbone), each with its own tuned lr, and MKOR
once more at the backbone's (SGD's) tuned lr: second-order methods often run hotter than
their backbone and lose part of their edge once both are tuned.

``classification_figure`` is shared with the digits CNN (figure 4).
"""
import torch
from torch.nn import functional as F

from .. import common as C
from .. import data, models

NAME = "mnist1d_mlp"
BUDGET = {
    "tiny": dict(steps=4, eval_every=2, batch=32, width=16, seeds=1),
    "quick": dict(steps=400, eval_every=20, batch=128, width=256, seeds=2),
    "full": dict(steps=4000, eval_every=100, batch=128, width=512, seeds=5),
}
SPECS = [
    C.Spec("SGD", "SGD"),
    C.Spec("AdamW", "AdamW"),
    C.Spec("MARS-AdamW", "MARS-AdamW"),
    C.Spec("MARS-Lion", "MARS-Lion"),
    C.Spec("MARS-Shampoo", "MARS-Shampoo"),
    C.Spec("MKOR", "MKOR"),
    C.Spec("MKOR-released", "MKOR-released"),
    C.Spec("MKOR-H", "MKOR-H"),
    C.Spec("K-FAC", "K-FAC"),
    C.Spec("MKOR @ SGD's lr", "MKOR", lr_from="SGD"),
]


def classification_figure(ctx, name, title, tensors, model_fn, specs, budget):
    """Train every spec on (x_train, y_train, x_val, y_val); write NAME.{csv,png,json}."""
    import matplotlib.pyplot as plt

    b = budget[ctx.mode]
    ctx.budget_steps = b["steps"]
    xtr, ytr, xva, yva = (t.to(ctx.device) for t in tensors)
    probe = torch.arange(min(len(ytr), 1000), device=ctx.device)  # fixed train subset

    @torch.no_grad()
    def evaluate(model):
        tr = F.cross_entropy(model(xtr[probe]), ytr[probe]).item()
        logits = model(xva)
        return dict(train_loss=tr, val_loss=F.cross_entropy(logits, yva).item(),
                    val_acc=(logits.argmax(1) == yva).float().mean().item())

    def batch_fn(gen):
        idx = torch.randint(0, len(ytr), (b["batch"],), generator=gen).to(ctx.device)
        return xtr[idx], ytr[idx]

    def run_fn(spec, lr, seed):
        return C.train(ctx, model_fn, spec, lr, seed, b["steps"], batch_fn, F.cross_entropy,
                       evaluate, b["eval_every"], desc=f"{name} {spec.label}")

    seeds = ctx.seed_list({m: budget[m]["seeds"] for m in C.MODES})
    curves = C.run_curves(ctx, name, name, specs, run_fn, seeds)
    rows = C.all_curve_rows(name, curves, ["train_loss", "val_loss", "val_acc"])
    rows += C.sweep_rows(name, name, ctx, specs)
    ref = "AdamW" if "AdamW" in curves else "SGD"
    summary = C.summary_rows(name, curves, ref)

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for i, (label, c) in enumerate(curves.items()):
        ls = "-" if i < 10 else "--"
        s, m, sd = C.mean_curve(c["runs"], "train_loss")
        C.band(axes[0], s, m, sd, None, ls=ls)
        s, m, sd = C.mean_curve(c["runs"], "val_loss")
        C.band(axes[1], s, m, sd, f"{label} (lr {C.fmt_lr(c['lr'])})", ls=ls)
        _, w, _ = C.mean_curve(c["runs"], "wall_s")
        C.band(axes[2], w, m, sd, None, ls=ls)
    for ax, yl, xl in zip(axes, ("train loss", "validation loss", "validation loss"),
                          ("step", "step", "training wall-clock (s)")):
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.set_yscale("log")
    from matplotlib.ticker import NullFormatter
    start = max(c["runs"][0][0]["val_loss"] for c in curves.values())
    for ax in axes:  # a diverging curve would otherwise squash the others
        ax.set_ylim(top=1.2 * start)
        ax.yaxis.set_minor_formatter(NullFormatter())
    axes[1].legend(fontsize=6)
    fig.suptitle(f"{title}: batch {b['batch']}, {b['steps']} steps, cosine lr, "
                 f"{len(seeds)} seed(s), mean ± sd", fontsize=9)
    fig.tight_layout()
    notes = [f"{k}: switched to the backbone at step(s) {c['switch']}"
             for k, c in curves.items() if k.startswith("MKOR-H")]
    acc = {k: sum(r[-1]["val_acc"] for r in c["runs"]) / len(c["runs"])
           for k, c in curves.items()}
    notes.append("final validation accuracy: " + ", ".join(f"{k} {v:.3f}" for k, v in acc.items()))
    C.write_outputs(ctx, name, rows, fig, dict(budget=b, seeds=seeds, summary=summary,
                                               notes=notes, task_title=title))
    return f"{title}, final val loss: " + C.describe(summary), summary


def run(ctx):
    x_tr, y_tr, x_va, y_va = data.mnist1d()
    b = BUDGET[ctx.mode]
    return classification_figure(
        ctx, NAME, "MLP on mnist1d", (x_tr, y_tr, x_va, y_va),
        lambda: models.mlp(x_tr.shape[1], b["width"], 10), SPECS, BUDGET)
