"""Figure 6: cost. Left: optimizer step time vs parameter count, MARS (each variant) vs
torch's AdamW, on one square matrix (the MARS path) of n parameters. Right: MKOR's O(d^2)
factor update vs K-FAC's O(d^3) inverse / eigendecomposition vs layer width d, log-log, with
least-squares slopes -- timed by :mod:`figures.bench.factor_update` (reused, not copied).

Timings are medians over interleaved repeats; absolute numbers are only comparable within one
run (shared CPUs are noisy), the ratios and slopes are the result.
"""

import numpy as np
import torch

from torch_impl import MARS

from ..bench import factor_update as bench
from ..bench.timing import interleaved
from .. import common as C

NAME = "cost"
BUDGET = {
    "tiny": dict(widths=(16, 32), params=(64, 256), repeats=2, seeds=1),
    "quick": dict(widths=(128, 256, 512, 1024), params=(128, 256, 512, 1024), repeats=5,
                  seeds=1),
    "full": dict(widths=(256, 512, 1024, 2048, 4096), params=(256, 512, 1024, 2048, 4096),
                 repeats=9, seeds=1),
}


def steppers(device):
    """The timed optimizers. MARS-Shampoo's Newton-Schulz runs in the official bf16 on a GPU
    and in float32 on a CPU, where a CPU without bf16 matrix units emulates a bf16 matmul,
    many times slower than float32: the figure would time that emulation (measured:
    figures/README.md), not the optimizer."""
    ns = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return {
        "AdamW (torch)": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        "MARS-AdamW": lambda ps: MARS(ps, lr=1e-3, mars_type="mars-adamw"),
        "MARS-Lion": lambda ps: MARS(ps, lr=1e-4, mars_type="mars-lion"),
        f"MARS-Shampoo ({str(ns)[6:]} NS)": lambda ps: MARS(ps, lr=1e-3,
                                                            mars_type="mars-shampoo",
                                                            ns_dtype=ns),
    }


def step_times(side, repeats, device):
    """Median seconds of one optimizer step on a side x side matrix, per optimizer."""
    g = torch.Generator().manual_seed(side)
    opts = {}
    for name, make in steppers(device).items():
        p = torch.nn.Parameter(torch.randn(side, side, generator=g).to(device))
        p.grad = torch.randn(side, side, generator=g).to(device)
        opts[name] = make([p])
    # the first (warm-up) step allocates the state
    return interleaved({name: opt.step for name, opt in opts.items()}, repeats,
                       torch.device(device), warmup=1)


def run(ctx):
    import matplotlib.pyplot as plt

    b = BUDGET[ctx.mode]
    device = torch.device(ctx.device)
    sides = list(b["params"])
    steps = {s: step_times(s, b["repeats"], ctx.device) for s in sides}
    factors = bench.time_sizes(list(b["widths"]), b["repeats"], device)
    rows = []
    for s in sides:
        for name, sec in steps[s].items():
            rows.append(dict(figure=NAME, optimizer=name, lr="", hparams="{}", seed=0,
                             step=s * s, wall_s="", tokens=0, metric="step_seconds_vs_params",
                             value=sec))
    methods = list(next(iter(factors.values())))
    for d in b["widths"]:
        for name in methods:
            rows.append(dict(figure=NAME, optimizer=name, lr="", hparams="{}", seed=0, step=d,
                             wall_s="", tokens=0, metric="factor_seconds_vs_width",
                             value=factors[d][name]))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    n = np.array([s * s for s in sides], dtype=float)
    step_slopes, factor_slopes = {}, {}
    for name in steps[sides[0]]:
        t = np.array([steps[s][name] for s in sides])
        step_slopes[name] = bench.slope(list(n), list(t))
        axes[0].loglog(n, t * 1e3, "o-", label=f"{name} (slope {step_slopes[name]:.2f})")
    axes[0].set_xlabel("parameters (one square matrix)")
    axes[0].set_ylabel("optimizer step (ms)")
    axes[0].set_title("step time vs parameter count", fontsize=9)
    widths = list(b["widths"])
    for name in methods:
        t = [factors[d][name] for d in widths]
        factor_slopes[name] = bench.slope(widths, t)
        axes[1].loglog(widths, np.array(t) * 1e3, "o-",
                       label=f"{name} (slope {factor_slopes[name]:.2f})")
    axes[1].set_xlabel("layer width d")
    axes[1].set_ylabel("time per factor (ms)")
    axes[1].set_title("MKOR factor update vs K-FAC inverse", fontsize=9)
    from matplotlib.ticker import NullFormatter
    for ax in axes:
        ax.legend(fontsize=7)
        ax.xaxis.set_minor_formatter(NullFormatter())
    fig.suptitle(f"Cost on {ctx.device}, {torch.get_num_threads()} thread(s), float32, "
                 f"median of {b['repeats']}", fontsize=9)
    big, d_max = sides[-1], widths[-1]
    notes = [
        f"step time at {big * big:,} params: " + ", ".join(
            f"{k} {v * 1e3:.2f} ms ({v / steps[big]['AdamW (torch)']:.1f}x AdamW)"
            for k, v in steps[big].items()),
        "log-log slopes of step time vs params: " + ", ".join(
            f"{k} {v:.2f}" for k, v in step_slopes.items()),
        f"factor cost at d={d_max}: " + ", ".join(
            f"{k} {factors[d_max][k] * 1e3:.2f} ms" for k in methods)
        + f"; K-FAC inverse / MKOR update = "
        f"{factors[d_max]['kfac_inverse'] / factors[d_max]['mkor_paper']:.1f}x",
        "log-log slopes vs d: " + ", ".join(f"{k} {v:.2f}" for k, v in factor_slopes.items()),
    ]
    C.write_outputs(ctx, NAME, rows, fig, dict(
        budget=b, step_seconds=steps, factor_seconds=factors, step_slopes=step_slopes,
        factor_slopes=factor_slopes, notes=notes, task_title="Cost"))
    return "; ".join(notes[1:2] + notes[3:]), None
