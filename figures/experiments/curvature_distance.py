r"""Figure 11: how far each Kronecker method is from the exact Gauss–Newton block, and what
that costs in training (issue 46 item 7).

**Panel 1, distances.** On four tiny float64 networks (helper A's test networks,
``theory_tests/support/curvature_nets.py``), per preconditioned layer, each method's distance
to the layer's exact GGN block (brute force, ``theory_tests/support/curvature.py``, KC1):
K-FAC in each flavour (empirical / mc / type-2 × expand / reduce, KC2–KC5), MKOR rank 1, 2,
4, 8 (KC7) and the best Kronecker product there is (KC9). What is drawn is the *scaled*
distance min_c ‖GGN − c G⊗A‖_F / ‖GGN‖_F, which ignores a method's overall scale (MKOR's
rescale absorbs it); K-FAC's raw distance (c = 1) is in the CSV and JSON
(:mod:`figures.curvature_methods` says why and how). The networks:

* a deep linear net shared over 3 tokens with per-token MSE targets (the expand setting,
  where K-FAC type-2 expand is exact: the anchor);
* an MLP (tanh, cross-entropy, 16 samples);
* one transformer block (softmax attention q, k, v, o, a tanh MLP, a per-token head;
  cross-entropy per token, 4 sequences of 4 tokens);
* a conv net, two linear 2×2 convolutions, the positions summed, a linear head (MSE: the
  reduce setting, where K-FAC type-2 reduce is exact on the layers after which nothing mixes
  positions).

**Panel 2, training.** The digits CNN of figure 4 (narrower, shorter: a type-2 step runs ten
extra backward passes), MKOR rank 1 and rank 4 against K-FAC's flavours, over seeds: the
final validation loss at a fixed budget. Each runs at figure 4's tuned lr of its family (MKOR,
K-FAC), not re-tuned per flavour or rank: the question is what the statistic changes at the
step size the default was tuned for. A curve whose option the installed library does not have
yet (``KFAC(fisher_type=...)``, ``MKOR(rank=...)``: issue 46 items 2 and 6) is not built, and
the JSON's ``not_built`` says so.
"""
import inspect

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from theory_tests.support import curvature_nets as nets
from torch_impl import KFAC, MKOR

from .. import common as C
from .. import curvature_methods as M
from .. import data, fixed_sums, models
from . import digits_cnn

NAME = "curvature_distance"
# Panel 1's networks: (title, builder, keyword arguments, loss kind); the same in every mode
# but tiny (a few milliseconds of brute force each: nothing to save at larger budgets).
NETS = {
    "deep linear (tokens, MSE)": (nets.deep_linear, dict(kind="mse", N=4, S=3, dims=(3, 4, 3, 2)),
                                  "mse"),
    "MLP (tanh, CE)": (nets.mlp, dict(activation="tanh", kind="ce", N=16, dims=(6, 8, 4)), "ce"),
    "transformer block (CE)": (nets.transformer_block,
                               dict(kind="ce", N=4, S=4, d=4, hidden=6, classes=3), "ce"),
    "conv net (summed, MSE)": (nets.conv_net, dict(kind="mse", N=8, channels=(2, 3, 2), size=5,
                                                   out=2), "mse"),
}
TINY_NETS = {  # every layer keeps >= 8 rows (rank 8)
    "deep linear (tokens, MSE)": (nets.deep_linear, dict(kind="mse", N=4, S=2, dims=(2, 3, 2)),
                                  "mse"),
    "MLP (tanh, CE)": (nets.mlp, dict(activation="tanh", kind="ce", N=8, dims=(3, 4, 3)), "ce"),
    "transformer block (CE)": (nets.transformer_block,
                               dict(kind="ce", N=2, S=4, d=3, hidden=4, classes=3), "ce"),
    "conv net (summed, MSE)": (nets.conv_net, dict(kind="mse", N=8, channels=(1, 2, 1), size=4,
                                                   out=2), "mse"),
}
RANKS = (1, 2, 4, 8)
MC_SEED = 0  # panel 1's one seeded draw of the mc columns
BUDGET = {
    "tiny": dict(steps=4, eval_every=2, batch=16, channels=(4, 8), seeds=1),
    "quick": dict(steps=100, eval_every=10, batch=32, channels=(8, 16), seeds=2),
    "full": dict(steps=1000, eval_every=50, batch=64, channels=(16, 32), seeds=5),
}
RANK_K = 4  # panel 2's rank-k MKOR
# Panel 2's curves (not ``SPECS``: nothing here is swept; each takes figure 4's tuned lr of
# its family, ``LR_FROM``). The first K-FAC curve is today's K-FAC: the summary's reference.
CURVES = [
    C.Spec("MKOR rank 1", "MKOR"),
    C.Spec(f"MKOR rank {RANK_K}", "MKOR", (("rank", RANK_K),)),
    C.Spec("K-FAC empirical expand", "K-FAC"),
    C.Spec("K-FAC mc expand", "K-FAC", (("fisher_type", "mc"),)),
    C.Spec("K-FAC type-2 expand", "K-FAC", (("fisher_type", "type-2"),)),
    C.Spec("K-FAC empirical reduce", "K-FAC", (("kfac_approx", "reduce"),)),
]
LR_FROM = {"MKOR": "MKOR", "K-FAC": "K-FAC"}  # family -> figure 4's curve label
REFERENCE = "K-FAC empirical expand"
CE_LOSS = nn.CrossEntropyLoss()  # the columns' loss (KFAC.curvature_backward takes a module)


# ------------------------------------------------------------------ panel 1
def distances(table):
    """{net: records of :func:`figures.curvature_methods.layer_distances`} on ``table``'s
    networks (loss reduction "mean")."""
    out = {}
    for title, (builder, kwargs, kind) in table.items():
        net = builder(**kwargs)
        loss = nets.make_loss(kind, "mean")
        with torch.no_grad():
            targets = nets.make_targets(kind, net.model(net.inputs))
        kinds = {n: type(m).__name__ for n, m in M.preconditioned_layers(net.model)}
        out[title] = [dict(r, kind=kinds[r["layer"]]) for r in M.layer_distances(
            net.model, loss, net.inputs, targets, ranks=RANKS, mc_seed=MC_SEED)]
    return out


def distance_rows(found):
    """CSV rows of panel 1: metric ``scaled_distance|NET|LAYER`` (and ``raw_distance``,
    ``scale`` = c*), optimizer = the method, seed = the mc draw's, step 0, lr empty."""
    rows = []
    for title, records in found.items():
        for r in records:
            base = dict(figure=NAME, optimizer=r["method"], lr="", hparams="{}", seed=MC_SEED,
                        step=0, wall_s="", tokens=0)
            for key, metric in (("scaled", "scaled_distance"), ("raw", "raw_distance"),
                                ("scale", "scale")):
                if r[key] is not None:
                    rows.append(dict(base, metric=f"{metric}|{title}|{r['layer']}",
                                     value=r[key]))
    return rows


def distance_json(found):
    """{net: {layer: {method: dict(scaled, raw, scale, vanished)}}}."""
    out = {}
    for title, records in found.items():
        for r in records:
            out.setdefault(title, {}).setdefault(r["layer"], {})[r["method"]] = {
                k: r[k] for k in ("scaled", "raw", "scale", "vanished", "kind")}
    return out


def distance_notes(found):
    """Plain lines: per net, the exact flavours, each method's mean scaled distance over the
    layers, and the cancelled statistics."""
    lines = []
    for title, records in found.items():
        methods = list(dict.fromkeys(r["method"] for r in records))
        mean = {m: fixed_sums.mean([r["scaled"] for r in records if r["method"] == m])
                for m in methods}
        exact = sorted({f"{r['method']} on {r['layer']} ({r['kind']})" for r in records
                        if r["family"] == "K-FAC" and r["raw"] is not None and r["raw"] < 1e-12})
        lines.append(f"{title}: mean scaled distance over its "
                     f"{len({r['layer'] for r in records})} layers: "
                     + ", ".join(f"{m} {mean[m]:.3f}" for m in methods))
        lines.append(f"{title}: K-FAC flavours exact (raw distance < 1e-12): "
                     + ("; ".join(exact) if exact else "none"))
        gone = sorted({f"{r['method']} on {r['layer']} ({r['kind']})" for r in records
                       if r["vanished"]})
        if gone:
            lines.append(f"{title}: G cancels to rounding noise (recorded as distance 1): "
                         + "; ".join(gone))
    return lines


# ------------------------------------------------------------------ panel 2
def missing_options(spec):
    """The spec's keywords that the installed optimizer's constructor does not take."""
    cls = KFAC if spec.base == "K-FAC" else MKOR
    params = inspect.signature(cls.__init__).parameters
    return [key for key, _ in spec.overrides if key not in params]


def curvature_columns(stepper, output, targets):
    """``train``'s hook: K-FAC's mc / type-2 columns between the loss and its backward (a
    no-op for MKOR and for the empirical flavour, and on steps without a factor update)."""
    kfac = stepper.wrapper
    if isinstance(kfac, KFAC) and getattr(kfac, "fisher_type", "empirical") != "empirical":
        kfac.curvature_backward(output, targets, CE_LOSS)


def train_curves(ctx, b, seeds):
    """Panel 2: {label: curve} as ``common.run_curves`` returns them (for
    ``common.summary_rows``), and the labels not built (with the options they lack)."""
    xtr, ytr, xva, yva = data.digits()
    probe = torch.arange(min(len(ytr), 1000))

    @torch.no_grad()
    def evaluate(model):
        logits = model(xva)
        return dict(train_loss=F.cross_entropy(model(xtr[probe]), ytr[probe]).item(),
                    val_loss=F.cross_entropy(logits, yva).item(),
                    val_acc=(logits.argmax(1) == yva).float().mean().item())

    def batch_fn(gen):
        idx = torch.randint(0, len(ytr), (b["batch"],), generator=gen)
        return xtr[idx], ytr[idx]

    curves, not_built = {}, {}
    for spec in CURVES:
        missing = missing_options(spec)
        if missing:
            not_built[spec.label] = missing
            continue
        entry, mode = ctx.tuned_entry(digits_cnn.NAME, LR_FROM[spec.base])
        lr, source = ((entry["lr"], f"{digits_cnn.NAME}'s {LR_FROM[spec.base]} ({mode} budget)")
                      if entry else (spec.grid_center(), "UNTUNED grid centre"))
        runs = [C.train(ctx, lambda: models.digits_cnn(b["channels"]), spec, lr, seed,
                        b["steps"], batch_fn, F.cross_entropy, evaluate, b["eval_every"],
                        desc=f"{NAME} {spec.label}", before_backward=curvature_columns)[0]
                for seed in seeds]
        curves[spec.label] = dict(spec=spec, lr=lr, source=source, runs=runs, seeds=seeds,
                                  switch=[None] * len(seeds))
    return curves, not_built


# ------------------------------------------------------------------ the figure
def draw(found, curves, b, seeds):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(found), figsize=(5 * len(found), 10))
    for ax, (title, records) in zip(axes[0], found.items()):
        layers = list(dict.fromkeys(r["layer"] for r in records))
        methods = list(dict.fromkeys(r["method"] for r in records))
        grid = np.array([[next(r["scaled"] for r in records
                               if r["method"] == m and r["layer"] == layer)
                          for layer in layers] for m in methods])
        ax.imshow(np.log10(np.maximum(grid, 1e-16)), vmin=-3, vmax=0, cmap="viridis",
                  aspect="auto")
        for i in range(len(methods)):
            for j in range(len(layers)):
                ax.text(j, i, f"{grid[i, j]:.2f}" if grid[i, j] >= 0.005 else "0",
                        ha="center", va="center", fontsize=6,
                        color="white" if grid[i, j] < 0.1 else "black")
        kinds = {r["layer"]: r["kind"] for r in records}
        ax.set_xticks(range(len(layers)), [f"{n} {kinds[n]}" for n in layers], fontsize=6,
                      rotation=45)
        ax.set_yticks(range(len(methods)), methods, fontsize=6)
        ax.set_title(f"{title}\nmin_c ‖GGN − c G⊗A‖/‖GGN‖ per layer", fontsize=8)
    ax = axes[1, 0]
    for i, (title, records) in enumerate(found.items()):
        mean = lambda m: fixed_sums.mean([r["scaled"] for r in records  # noqa: E731
                                          if r["method"] == m])
        ax.plot(RANKS, [mean(f"MKOR rank {k}") for k in RANKS], "o-", color=f"C{i}",
                label=title)
        ax.axhline(mean("K-FAC empirical expand"), color=f"C{i}", ls="--", lw=0.8)
        ax.axhline(mean("best Kronecker"), color=f"C{i}", ls=":", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("MKOR rank k")
    ax.set_ylabel("scaled distance, mean over layers")
    ax.set_title("MKOR rank k (o); K-FAC empirical expand (--); best Kronecker (:)", fontsize=8)
    ax.legend(fontsize=6)
    for label, c in curves.items():
        s, m, sd = C.mean_curve(c["runs"], "val_loss")
        C.band(axes[1, 1], s, m, sd, f"{label} (lr {C.fmt_lr(c['lr'])})")
        _, w, _ = C.mean_curve(c["runs"], "wall_s")
        C.band(axes[1, 2], w, m, sd, None)
    for ax, xl in ((axes[1, 1], "step"), (axes[1, 2], "training wall-clock (s)")):
        ax.set_xlabel(xl)
        ax.set_ylabel("validation loss (digits CNN)")
        ax.set_yscale("log")
    axes[1, 1].legend(fontsize=6)
    finals = {label: [rows[-1]["val_loss"] for rows in c["runs"]] for label, c in curves.items()}
    ax = axes[1, 3] if len(found) > 3 else axes[1, -1]
    ax.barh(range(len(finals)), [fixed_sums.mean(v) for v in finals.values()],
            xerr=[float(np.std(v)) for v in finals.values()])
    ax.set_yticks(range(len(finals)), list(finals), fontsize=6)
    ax.set_xlabel(f"final validation loss ({b['steps']} steps, {len(seeds)} seed(s))")
    fig.suptitle("Kronecker methods against the exact GGN block (top) and in training "
                 "(bottom)", fontsize=10)
    fig.tight_layout()
    return fig


def run(ctx):
    b = BUDGET[ctx.mode]
    ctx.budget_steps = b["steps"]
    seeds = ctx.seed_list({m: BUDGET[m]["seeds"] for m in C.MODES})
    found = distances(TINY_NETS if ctx.mode == "tiny" else NETS)
    curves, not_built = train_curves(ctx, b, seeds)
    rows = distance_rows(found)
    rows += C.all_curve_rows(NAME, curves, ["train_loss", "val_loss", "val_acc"])
    reference = REFERENCE if REFERENCE in curves else next(iter(curves))
    summary = C.summary_rows(NAME, curves, reference)
    notes = distance_notes(found)
    notes.append(f"training: the digits CNN (channels {b['channels']}), batch {b['batch']}, "
                 f"{b['steps']} steps; each curve at figure 4's tuned lr of its family")
    if not_built:
        notes.append("not built (the installed library lacks the option): " + "; ".join(
            f"{k} ({', '.join(v)})" for k, v in not_built.items()))
    sources = dict(kfac=f"{M.KFAC_FACTORS.__module__}.{M.KFAC_FACTORS.__name__}",
                   group_means=f"{M.GROUP_MEANS.__module__}.{M.GROUP_MEANS.__name__}")
    notes.append(f"K-FAC factors from {sources['kfac']}; MKOR rank-k group means from "
                 f"{sources['group_means']}")
    C.write_outputs(ctx, NAME, rows, draw(found, curves, b, seeds), dict(
        budget=b, seeds=seeds, summary=summary, notes=notes, distances=distance_json(found),
        ranks=list(RANKS), mc_seed=MC_SEED, sources=sources, not_built=not_built,
        task_title="Kronecker methods against the exact GGN block, and in training"))
    best = {t: max(r["scaled"] for r in rs if r["method"] == "best Kronecker")
            for t, rs in found.items()}
    line = ", ".join(f"{t}: best Kronecker ≤ {v:.2f}" for t, v in best.items())
    return (f"curvature distances ({line}); final val loss: " + C.describe(summary)
            + (f"; not built: {', '.join(not_built)}" if not_built else "")), summary
