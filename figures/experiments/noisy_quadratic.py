"""Figure 1: noisy quadratic -- suboptimality vs step, controlled condition number and noise.

Linear regression y = W* x + sigma eps with inputs x ~ N(0, Sigma), Sigma's eigenvalues
log-spaced from 1 down to 1/kappa in a random basis, a linear model W (d_out x d_in, no bias:
one matrix, so Muon, MARS-Shampoo, MKOR and K-FAC all apply to it) and mini-batches of B
samples. The loss 0.5 E||W x - y||^2 is a quadratic whose suboptimality is exact:
f(W) - f* = 0.5 tr((W - W*) Sigma (W - W*)^T). No weight decay anywhere (it would move the
optimum); lr tuned on the final suboptimality.
"""
import math

import torch

from .. import common as C

NAME = "noisy_quadratic"
BUDGET = {  # steps, eval_every, d_in, d_out, batch, kappa, sigma, seeds
    "tiny": dict(steps=6, eval_every=3, d_in=8, d_out=4, batch=8, kappa=100.0, sigma=0.5, seeds=1),
    "quick": dict(steps=300, eval_every=10, d_in=32, d_out=8, batch=8, kappa=100.0, sigma=0.5,
                  seeds=2),
    "full": dict(steps=2000, eval_every=20, d_in=64, d_out=16, batch=8, kappa=1000.0,
                 sigma=0.5, seeds=5),
}
_NO_WD = (("weight_decay", 0.0),)
SPECS = [
    C.Spec("SGD", "SGD"),
    C.Spec("AdamW", "AdamW", _NO_WD),
    C.Spec("MARS-AdamW γ=0", "MARS-AdamW", _NO_WD + (("gamma", 0.0),)),
    C.Spec("MARS-AdamW γ=0.025", "MARS-AdamW", _NO_WD + (("gamma", 0.025),)),
    C.Spec("MARS-AdamW γ=0.1", "MARS-AdamW", _NO_WD + (("gamma", 0.1),)),
    C.Spec("Lion", "Lion"),
    C.Spec("MARS-Lion", "MARS-Lion", _NO_WD),
    C.Spec("Muon", "Muon"),
    C.Spec("MARS-Shampoo", "MARS-Shampoo", _NO_WD),
    C.Spec("MKOR", "MKOR"),
    C.Spec("K-FAC", "K-FAC"),
]


class Problem:
    def __init__(self, d_in, d_out, kappa, sigma, seed=1234):
        g = torch.Generator().manual_seed(seed)
        q, _ = torch.linalg.qr(torch.randn(d_in, d_in, generator=g, dtype=torch.float64))
        lam = torch.logspace(0, -math.log10(kappa), d_in, dtype=torch.float64)
        self.sqrt_sigma = (q * lam.sqrt()) @ q.T
        self.sigma = (q * lam) @ q.T
        self.w_star = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
        self.noise = sigma

    def batch(self, n, gen):
        x = torch.randn(n, self.sqrt_sigma.shape[0], generator=gen, dtype=torch.float64)
        x = x @ self.sqrt_sigma
        y = x @ self.w_star.T + self.noise * torch.randn(n, self.w_star.shape[0], generator=gen,
                                                         dtype=torch.float64)
        return x.float(), y.float()

    def suboptimality(self, w):
        e = w.detach().double().cpu() - self.w_star
        return 0.5 * float(torch.trace(e @ self.sigma @ e.T))


def run(ctx):
    import matplotlib.pyplot as plt

    b = BUDGET[ctx.mode]
    prob = Problem(b["d_in"], b["d_out"], b["kappa"], b["sigma"])
    ctx.budget_steps = b["steps"]

    def model_fn():
        return torch.nn.Linear(b["d_in"], b["d_out"], bias=False)

    def run_fn(spec, lr, seed):
        return C.train(
            ctx, model_fn, spec, lr, seed, b["steps"],
            batch_fn=lambda gen: prob.batch(b["batch"], gen),
            loss_fn=lambda out, y: 0.5 * (out - y).square().sum(1).mean(),
            evaluate=lambda m: {"suboptimality": prob.suboptimality(m.weight)},
            eval_every=b["eval_every"], warmup=0.0, desc=f"{NAME} {spec.label}")

    seeds = ctx.seed_list({m: BUDGET[m]["seeds"] for m in C.MODES})
    curves = C.run_curves(ctx, NAME, NAME, SPECS, run_fn, seeds, key="suboptimality")
    rows = C.all_curve_rows(NAME, curves, ["suboptimality"])
    rows += C.sweep_rows(NAME, NAME, ctx, SPECS)
    summary = C.summary_rows(NAME, curves, "AdamW", key="suboptimality")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (label, c) in enumerate(curves.items()):
        steps, mean, std = C.mean_curve(c["runs"], "suboptimality")
        C.band(ax, steps, mean, std, f"{label} (lr {C.fmt_lr(c['lr'])})",
               ls="-" if i < 10 else "--")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("f(W) - f*")
    ax.set_title(f"Noisy quadratic: d={b['d_in']}x{b['d_out']}, κ={b['kappa']:g}, "
                 f"σ={b['sigma']}, batch {b['batch']}, {len(seeds)} seed(s)", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    line = "noisy quadratic, final f - f*: " + C.describe(summary)
    meta = C.write_outputs(ctx, NAME, rows, fig, dict(
        budget=b, seeds=seeds, summary=summary, task_title="Noisy quadratic (f - f*)",
        metric="suboptimality"))
    return line, meta
