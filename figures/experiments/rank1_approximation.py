r"""Figure 8: MKOR's rank-1 approximation of the Kronecker factors, measured during training.

MKOR replaces K-FAC's factors A = E[a a^T] and G = E[g g^T] of a layer by the rank-1
outer products of the batch means, \bar a \bar a^T and \bar g \bar g^T (spec MKOR.md K6),
and the paper says this costs negligible error (ResNet-50, BERT). Here both models are
trained with MKOR (the figures' registry MKOR: variant "paper", inv_freq 10) and, at several
steps, on that step's training batch, every layer MKOR preconditions is measured with this
module's own hooks (independent of the library's capture):

* rows, as the code builds them: Linear -- one row per token, the input a_i with a 1
  appended for the bias, the output gradient scaled to N g_i (N rows; K3); Conv2d -- the
  unfolded patches (B L rows, 1 appended for a bias) and the per-position output gradients
  scaled to B g_{b,l} (K4). With F = (1/N) sum_i r_i r_i^T and \bar r = (1/N) sum_i r_i,
  \bar r is exactly MKOR's \bar a / \bar g, and F is K-FAC's A / G (for Conv2d, K-FAC's
  G = L F_G: the KFC convention sums positions, a scale that cancels in the error below);
* **rank-1 error** e = ||F - \bar r \bar r^T||_F / ||F||_F, in [0, 1]: F - \bar r \bar r^T is
  the rows' covariance, so e = 0 iff all rows are equal and e -> 1 when the mean is small
  against the spread;
* **direction**: with the layer's gradient \hat G = [dW | db] of that batch and a damping
  rule delta_X = lambda tr(F_X) / d_X taken from the *full* factor and used for both,
  P_full = (F_G + delta_G I)^{-1} \hat G (F_A + delta_A I)^{-1} and
  P_rank1 = (\bar g \bar g^T + delta_G I)^{-1} \hat G (\bar a \bar a^T + delta_A I)^{-1};
  reported: cos(P_rank1, P_full), and as baselines cos(\hat G, P_full) (no preconditioning)
  and cos(P_MKOR, P_full) with P_MKOR = L^{-1} \hat G R^{-1} from MKOR's own stored inverse
  factors at that step (the direction MKOR actually took, before its norm rescale).
  lambda in {0.01, 0.1, 1}; the headline uses lambda = 0.1. Cosines are of the matrices
  flattened (Frobenius inner product).

Models: the BERT MLM of figure 7 (same config and data, MKOR on LAMB at that figure's tuned
lr) and a ``transformers.ResNetForImageClassification`` from a tiny config on scikit-learn's
digits upsampled to 32x32 and repeated to 3 channels (MKOR on SGD with momentum, a fixed lr:
this figure measures a trajectory, it is not a race).
"""
import math
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from . import bert_mlm
from .. import common as C
from .. import data, fixed_sums
from ..rank1_metrics import LAMBDAS, Probe, grad_matrix, layer_metrics

NAME = "rank1_approximation"
BUDGET = {
    "tiny": dict(bert_steps=2, resnet=dict(steps=2, batch=8, size=16, hidden=(4, 8)),
                 points=2, seeds=2),
    "quick": dict(bert_steps=40, resnet=dict(steps=40, batch=32, size=32, hidden=(16, 32)),
                  points=4, seeds=2),
    "full": dict(bert_steps=250, resnet=dict(steps=250, batch=64, size=32, hidden=(16, 32)),
                 points=6, seeds=3),
}
HEADLINE = 0.1
RESNET_LR = 0.05  # SGD lr of the ResNet trajectory (fixed, see the module docstring)
BERT_LABEL = "MKOR (LAMB)"  # figure 7's curve whose tuned lr the BERT trajectory uses
BERT_LR = 1e-2  # if figure 7 has no tuned value
QUANTITIES = ("err_A", "err_G", "share_A", "share_G") + tuple(f"{q}@{lam:g}" for lam in LAMBDAS
                                        for q in ("cos_rank1_full", "cos_grad_full",
                                                  "cos_mkor_full"))


# ------------------------------------------------------------------ the measured quantities
def bert_group(name, module):
    for key, group in ((".query", "attention q/k/v"), (".key", "attention q/k/v"),
                       (".value", "attention q/k/v"), ("attention.output.dense",
                                                       "attention output"),
                       ("intermediate.dense", "FFN in"), ("output.dense", "FFN out"),
                       ("transform.dense", "MLM head transform")):
        if name.endswith(key):
            return group
    return "other linear"


def resnet_group(name, module):
    if isinstance(module, nn.Conv2d):
        k = "x".join(map(str, module.kernel_size))
        role = ("stem" if "embedder" in name else "shortcut" if "shortcut" in name
                else "block")
        return f"conv {k} ({role})"
    return "classifier (linear)"


def resnet_data(size):
    """Digits upsampled to size x size, 3 channels, scaled to [-1, 1]."""
    x, y, xv, yv = data.digits()

    def prep(t):
        t = F.interpolate(t, size=(size, size), mode="bilinear", align_corners=False)
        return t.repeat(1, 3, 1, 1) * 2 - 1
    return prep(x), y, prep(xv), yv


def resnet_model(hidden):
    from transformers import ResNetConfig, ResNetForImageClassification
    from transformers.utils import logging

    logging.set_verbosity_error()
    cfg = ResNetConfig(num_channels=3, embedding_size=hidden[0], hidden_sizes=list(hidden),
                       depths=[1] * len(hidden), layer_type="basic", hidden_act="relu",
                       num_labels=10, downsample_in_first_stage=False)
    return ResNetForImageClassification(cfg)


def trajectory(task, model_fn, spec, lr, seed, steps, batch_fn, loss_fn, evaluate, points,
               group_fn):
    """Train ``model_fn()`` with ``spec`` (an MKOR spec) for ``steps`` steps; at the steps in
    ``points`` measure every preconditioned layer. Returns (records, evals): records are
    dicts (step, layer, group, quantities...), evals (step, wall_s, metrics)."""
    torch.manual_seed(seed)
    model = model_fn()
    opt = C.build(spec, model, lr)
    mkor = opt.wrapper
    probe = Probe(model, mkor.preconditioned_modules)
    gen = torch.Generator().manual_seed(10_000 + seed)
    records, evals, wall = [], [], 0.0
    try:
        for t in range(1, steps + 1):
            start = time.perf_counter()
            opt.set_lr_factor(C.cosine(t, steps, int(0.1 * steps)))
            x, y = batch_fn(gen)
            probe.active, probe.stats = t in points, {}
            loss = loss_fn(model(x), y)
            if not torch.isfinite(loss):
                break
            loss.backward()
            grads = ({n: grad_matrix(m) for n, m in probe.modules.items()
                      if m.weight.grad is not None} if probe.active else {})
            opt.step(loss.detach())
            wall += time.perf_counter() - start
            if probe.active:
                factors = {} if mkor.switched else mkor.inverse_factors()
                for name, stats in probe.stats.items():
                    if name not in grads:
                        continue
                    rec = layer_metrics(stats, grads[name], factors.get(name))
                    records.append(dict(step=t, layer=name,
                                        group=group_fn(name, probe.modules[name]), **rec))
                evals.append(dict(step=t, wall_s=wall, train_loss=loss.detach().item(),
                                  **evaluate(model)))
            probe.active = False
            opt.zero_grad()
    finally:
        probe.remove()
        mkor.remove()
    return records, evals


def measure_points(steps, n):
    return sorted({int(round(v)) for v in np.linspace(1, steps, n)})


# ------------------------------------------------------------------ summary
def summarise(records):
    """{group: {quantity: dict(mean, min, max, first, last, layers)}} over seeds and layers
    (first / last: the mean at the first / last measured step)."""
    out = {}
    for group in sorted({r["group"] for r in records}):
        rs = [r for r in records if r["group"] == group]
        steps = sorted({r["step"] for r in rs})
        entry = dict(layers=len({r["layer"] for r in rs}))
        for q in QUANTITIES:
            vals = np.array([r[q] for r in rs], float)
            if np.all(np.isnan(vals)):
                continue
            at = lambda s: fixed_sums.nanmean([r[q] for r in rs if r["step"] == s])  # noqa
            entry[q] = dict(mean=fixed_sums.nanmean(vals), min=float(np.nanmin(vals)),
                            max=float(np.nanmax(vals)), first=at(steps[0]), last=at(steps[-1]))
        out[group] = entry
    return out


def verdict(task, groups):
    """Plain-language lines on whether the rank-1 approximation is negligible here."""
    lam = f"@{HEADLINE:g}"
    lines = []
    errs_A = [g["err_A"]["mean"] for g in groups.values()]
    errs_G = [g["err_G"]["mean"] for g in groups.values()]
    cos_r1 = [g[f"cos_rank1_full{lam}"]["mean"] for g in groups.values()]
    cos_g = [g[f"cos_grad_full{lam}"]["mean"] for g in groups.values()]

    def kind(e):
        return "small (< 0.1)" if e < 0.1 else "moderate (0.1-0.5)" if e < 0.5 else "large (> 0.5)"
    lines.append(f"{task}: rank-1 error of A (activations) {min(errs_A):.3f}-{max(errs_A):.3f} "
                 f"over layer types ({kind(max(errs_A))} at worst); of G (gradients) "
                 f"{min(errs_G):.3f}-{max(errs_G):.3f} ({kind(max(errs_G))} at worst)")
    better = sum(r > g for r, g in zip(cos_r1, cos_g))
    lines.append(f"{task}: cos(rank-1 preconditioned, full K-FAC preconditioned) at lambda="
                 f"{HEADLINE:g}: {min(cos_r1):.3f}-{max(cos_r1):.3f}; the raw gradient's "
                 f"cosine with the full one: {min(cos_g):.3f}-{max(cos_g):.3f}; the rank-1 "
                 f"factors are closer to the full-factor direction than no preconditioning "
                 f"in {better} of {len(cos_r1)} layer types")
    vanished = [name for name, g in groups.items() if g["share_G"]["max"] < 1e-8]
    if vanished:
        lines.append(f"{task}: g_bar vanishes (||g_bar||^2 / tr(G) < 1e-8 at every "
                     f"measurement) for {', '.join(vanished)}: these convolutions feed a "
                     "BatchNorm in train mode, whose input gradient sums to zero over the "
                     "batch and positions per channel, so MKOR's g_bar (K4) is 0 and its "
                     "left factor L never sees the gradient statistics (only the right "
                     "factor from a_bar preconditions these layers)")
    negligible = max(errs_A) < 0.1 and max(errs_G) < 0.1
    lines.append(f"{task}: the paper's 'negligible error' claim "
                 + ("holds here (every layer type's mean relative Frobenius error < 0.1)"
                    if negligible else
                    "does NOT hold here as a statement about the factors (mean relative "
                    f"Frobenius error up to {max(errs_A + errs_G):.2f}; the rank-1 product "
                    "drops the rows' covariance, which is most of G)"))
    return lines


# ------------------------------------------------------------------ the figure
def run(ctx):
    import matplotlib.pyplot as plt

    b = BUDGET[ctx.mode]
    seeds = ctx.seed_list({m: BUDGET[m]["seeds"] for m in C.MODES})
    rows, tasks, evals_all = [], {}, {}

    # BERT MLM: figure 7's model and data, MKOR on LAMB at figure 7's tuned lr
    bb = dict(bert_mlm.BUDGET[ctx.mode])
    train_ids, val_ids, chars, special, config = bert_mlm.setup(bb)
    val_x, val_y = bert_mlm.mlm_batch(val_ids, bb["val_windows"], bb["block"], len(chars),
                                      special, torch.Generator().manual_seed(1234))
    bert_spec = next(s for s in bert_mlm.specs(bb["steps"]) if s.label == BERT_LABEL)
    entry, mode = ctx.tuned_entry(bert_mlm.NAME, BERT_LABEL)
    bert_lr, bert_src = ((entry["lr"], f"{bert_mlm.NAME}'s tuned lr ({mode} budget)") if entry
                         else (BERT_LR, "fixed (figure 7 not tuned)"))

    @torch.no_grad()
    def bert_eval(model):
        model.eval()
        loss = bert_mlm.mlm_loss(model(val_x), val_y).item()
        model.train()
        return dict(val_loss=loss)

    # ResNet on digits: MKOR on SGD (momentum 0.9)
    rb = b["resnet"]
    rx, ry, rxv, ryv = resnet_data(rb["size"])
    resnet_spec = C.Spec("MKOR (SGD)", "MKOR")

    @torch.no_grad()
    def resnet_eval(model):
        model.eval()
        logits = model(rxv).logits
        model.train()
        return dict(val_loss=F.cross_entropy(logits, ryv).item(),
                    val_acc=float((logits.argmax(1) == ryv).float().mean()))

    def resnet_batch(gen):
        idx = torch.randint(0, len(ry), (rb["batch"],), generator=gen)
        return rx[idx], ry[idx]

    setups = {
        "BERT MLM": dict(
            model_fn=lambda: bert_mlm.bert_model(config), spec=bert_spec, lr=bert_lr,
            lr_source=bert_src, steps=b["bert_steps"],
            batch_fn=lambda gen: bert_mlm.mlm_batch(train_ids, bb["batch"], bb["block"],
                                                    len(chars), special, gen),
            loss_fn=bert_mlm.mlm_loss, evaluate=bert_eval, group_fn=bert_group,
            tokens=bb["batch"] * bb["block"]),
        "ResNet digits": dict(
            model_fn=lambda: resnet_model(rb["hidden"]), spec=resnet_spec, lr=RESNET_LR,
            lr_source="fixed", steps=rb["steps"], batch_fn=resnet_batch,
            loss_fn=lambda out, y: F.cross_entropy(out.logits, y), evaluate=resnet_eval,
            group_fn=resnet_group, tokens=0),
    }
    for task, s in setups.items():
        points = measure_points(s["steps"], b["points"])
        records = []
        for seed in seeds:
            recs, evals = trajectory(task, s["model_fn"], s["spec"], s["lr"], seed, s["steps"],
                                     s["batch_fn"], s["loss_fn"], s["evaluate"], points,
                                     s["group_fn"])
            records += [dict(r, seed=seed) for r in recs]
            evals_all.setdefault(task, []).append(evals)
            hp = C.hparams_json(s["spec"])
            base = dict(figure=NAME, optimizer=s["spec"].label, lr=s["lr"], hparams=hp,
                        seed=seed)
            for e in evals:
                common = dict(base, step=e["step"], wall_s=e["wall_s"],
                              tokens=e["step"] * s["tokens"])
                for m in ("train_loss", "val_loss", "val_acc"):
                    if m in e:
                        rows.append(dict(common, metric=f"{m}|{task}", value=e[m]))
                for r in recs:
                    if r["step"] == e["step"]:
                        for q in QUANTITIES:
                            rows.append(dict(common, metric=f"{q}|{task}|{r['layer']}",
                                             value=r[q]))
        tasks[task] = dict(records=records, groups=summarise(records), points=points,
                           lr=s["lr"], lr_source=s["lr_source"], optimizer=s["spec"].label,
                           steps=s["steps"])

    fig, axes = plt.subplots(len(tasks), 3, figsize=(15, 4 * len(tasks)), squeeze=False)
    lam = f"@{HEADLINE:g}"
    for row, (task, t) in enumerate(tasks.items()):
        for gi, group in enumerate(t["groups"]):
            color = f"C{gi}"
            rs = [r for r in t["records"] if r["group"] == group]
            steps = sorted({r["step"] for r in rs})
            mean = lambda q: [np.nanmean([r[q] for r in rs if r["step"] == s])  # noqa: E731
                              for s in steps]
            axes[row, 0].plot(steps, mean("err_A"), "o-", color=color, label=group)
            axes[row, 1].plot(steps, mean("err_G"), "o-", color=color, label=group)
            axes[row, 2].plot(steps, mean(f"cos_rank1_full{lam}"), "o-", color=color,
                              label=f"{group}: rank-1")
            axes[row, 2].plot(steps, mean(f"cos_grad_full{lam}"), "x--", color=color, lw=0.8)
            axes[row, 2].plot(steps, mean(f"cos_mkor_full{lam}"), "s:", color=color, lw=0.8)
        titles = (r"$\|E[aa^T]-\bar a\bar a^T\|_F/\|E[aa^T]\|_F$",
                  r"$\|E[gg^T]-\bar g\bar g^T\|_F/\|E[gg^T]\|_F$",
                  f"cos with full-factor K-FAC direction (λ={HEADLINE:g}); "
                  "o rank-1, x raw grad, s MKOR")
        for col, title in enumerate(titles):
            ax = axes[row, col]
            ax.set_title(f"{task}: {title}", fontsize=8)
            ax.set_xlabel("step")
            low = -0.05
            if col == 2:
                cos = [r[k] for r in t["records"] for k in QUANTITIES
                       if k.startswith("cos_") and k.endswith(lam) and not math.isnan(r[k])]
                low = min([0.0] + cos) - 0.05
            ax.set_ylim(low, 1.05)
            ax.legend(fontsize=6)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.suptitle(f"rank-1 approximation of the Kronecker factors during MKOR training "
                 f"({len(seeds)} seed(s), mean over the layers of each type)", fontsize=9)

    notes, summary_json = [], {}
    for task, t in tasks.items():
        notes.append(f"{task}: MKOR trajectory {t['optimizer']} at lr {C.fmt_lr(t['lr'])} "
                     f"({t['lr_source']}), {t['steps']} steps, measured at steps "
                     f"{t['points']}; final validation "
                     + ", ".join(f"{k} {fixed_sums.mean([e[-1][k] for e in evals_all[task]]):.4g}"
                                 for k in ("val_loss", "val_acc")
                                 if k in evals_all[task][0][-1]))
        for group, g in t["groups"].items():
            q = lambda k: g[k]["mean"] if k in g else math.nan  # noqa: E731
            notes.append(f"{task} / {group} ({g['layers']} layer(s)): err_A {q('err_A'):.3f} "
                         f"[{g['err_A']['min']:.3f}-{g['err_A']['max']:.3f}], err_G "
                         f"{q('err_G'):.3f} [{g['err_G']['min']:.3f}-{g['err_G']['max']:.3f}]; "
                         f"cos to full K-FAC (λ={HEADLINE:g}): rank-1 "
                         f"{q('cos_rank1_full' + lam):.3f}, raw grad "
                         f"{q('cos_grad_full' + lam):.3f}, MKOR {q('cos_mkor_full' + lam):.3f}")
        notes += verdict(task, t["groups"])
        summary_json[task] = dict({k: v for k, v in t.items() if k != "records"})
    C.write_outputs(ctx, NAME, rows, fig, dict(
        budget=b, seeds=seeds, summary=[], rank1=summary_json, notes=notes,
        lambdas=list(LAMBDAS), headline_lambda=HEADLINE,
        definitions=dict(
            share="||r̄||² / tr(F): the part of F's trace carried by the mean",
            err="||F - r̄ r̄ᵀ||_F / ||F||_F, F = mean_i r_i r_iᵀ, r̄ = mean_i r_i over the "
                "step's rows (Linear: tokens, [a|1] and N g; Conv2d: unfolded patches and "
                "B g per position)",
            damping="delta_X = lambda tr(F_X)/d_X from the full factor, used for both",
            cos_rank1_full="cos((ḡḡᵀ+δ_G I)⁻¹ Ĝ (āāᵀ+δ_A I)⁻¹, (F_G+δ_G I)⁻¹ Ĝ (F_A+δ_A I)⁻¹)",
            cos_grad_full="cos(Ĝ, (F_G+δ_G I)⁻¹ Ĝ (F_A+δ_A I)⁻¹)",
            cos_mkor_full="cos(L⁻¹ Ĝ R⁻¹ from MKOR's stored inverse factors after that "
                          "step's update, (F_G+δ_G I)⁻¹ Ĝ (F_A+δ_A I)⁻¹)"),
        task_title="Rank-1 approximation of the Kronecker factors (MKOR K6), measured"))
    short = "; ".join(
        f"{task}: err_A ≤ {max(g['err_A']['mean'] for g in t['groups'].values()):.2f}, "
        f"err_G ≤ {max(g['err_G']['mean'] for g in t['groups'].values()):.2f}, cos(rank-1, "
        f"full) ≥ {min(g['cos_rank1_full' + lam]['mean'] for g in t['groups'].values()):.2f}"
        for task, t in tasks.items())
    return f"rank-1 approximation: {short}", summary_json
