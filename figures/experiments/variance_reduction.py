"""Figure 2: variance reduction -- E||m_t - grad F(x_t)||^2 vs step, gamma sweeps, exact vs
approximate MARS correction.

A stochastic least-squares problem (NumPy float64, its own small simulation): rows
a ~ N(0, Sigma) (condition number kappa), y = a.x* + sigma eps; the mini-batch gradient
g(x, xi) = A_xi^T (A_xi x - y_xi) / B, the population gradient grad F(x) = Sigma (x - x*).
The estimator is the paper's, from ``reference.mars.mars``: c_t = corrected_gradient(g_t,
g_prev, gamma, beta1) with g_prev = g(x_{t-1}, xi_t) (exact, M1: the new batch at the old
point) or g_{t-1} (approx, M2), then m_t = momentum(m_{t-1}, c_t, beta1). The iterate moves
along the estimator, x_{t+1} = x_t - eta m_t, so each (gamma, mode) has its own trajectory;
the error is averaged over R independent replicas (vectorised) per seed. The clip (M3) is
left out so that the estimator's own variance is what is plotted.
"""
import numpy as np

from reference.mars.mars_equations import corrected_gradient, momentum

from .. import common as C
from .. import fixed_sums

NAME = "variance_reduction"
BUDGET = {
    "tiny": dict(steps=5, replicas=4, d=6, batch=4, kappa=10.0, sigma=0.5, lr=0.05, seeds=1),
    "quick": dict(steps=300, replicas=128, d=20, batch=8, kappa=100.0, sigma=0.5, lr=0.05,
                  seeds=2),
    "full": dict(steps=1000, replicas=1024, d=50, batch=8, kappa=100.0, sigma=0.5, lr=0.05,
                 seeds=5),
}
GAMMAS = (0.0, 0.025, 0.05, 0.1, 0.5, 1.0)
BETA1 = 0.95  # MARS's default beta1


def simulate(b, gamma, exact, seed):
    """Mean over replicas of ||m_t - grad F(x_t)||^2, t = 1..steps (one seed)."""
    rng = np.random.default_rng(seed)
    d, R, B = b["d"], b["replicas"], b["batch"]
    q, _ = np.linalg.qr(np.random.default_rng(7).standard_normal((d, d)))
    lam = np.logspace(0, -np.log10(b["kappa"]), d)
    sqrt_sigma = (q * np.sqrt(lam)) @ q.T
    sigma_mat = (q * lam) @ q.T
    x_star = np.random.default_rng(8).standard_normal(d)
    x = np.zeros((R, d))
    x_prev, g_last, m = x.copy(), np.zeros((R, d)), np.zeros((R, d))
    err = np.empty(b["steps"])
    for t in range(b["steps"]):
        A = rng.standard_normal((R, B, d)) @ sqrt_sigma
        y = A @ x_star + b["sigma"] * rng.standard_normal((R, B))

        def grad(z):
            return np.einsum("rbd,rb->rd", A, np.einsum("rbd,rd->rb", A, z) - y) / B

        g = grad(x)
        if exact:
            g_prev = grad(x_prev) if t > 0 else np.zeros_like(g)
        else:
            g_prev = g_last
        m = momentum(m, corrected_gradient(g, g_prev, gamma, BETA1), BETA1)
        full = (x - x_star) @ sigma_mat
        err[t] = np.mean(np.sum((m - full) ** 2, axis=1))
        x_prev, g_last = x, g
        x = x - b["lr"] * m
    return err


def run(ctx):
    import matplotlib.pyplot as plt

    b = BUDGET[ctx.mode]
    seeds = ctx.seed_list({m: BUDGET[m]["seeds"] for m in C.MODES})
    rows, curves = [], {}
    for exact in (True, False):
        for gamma in GAMMAS:
            label = f"{'exact' if exact else 'approx'} γ={gamma}"
            runs = [simulate(b, gamma, exact, seed) for seed in seeds]
            curves[label] = np.array(runs)
            hp = C.json.dumps(dict(gamma=gamma, beta1=BETA1, exact=exact))  # rest: NAME.json
            for seed, err in zip(seeds, runs):
                rows += [dict(figure=NAME, optimizer=label, lr=b["lr"], hparams=hp, seed=seed,
                              step=t + 1, wall_s="", tokens=0, metric="estimator_error",
                              value=f"{e:.6g}") for t, e in enumerate(err)]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8), sharey=True)
    steps = np.arange(1, b["steps"] + 1)
    for ax, mode in zip(axes, ("exact", "approx")):
        for gamma in GAMMAS:
            runs = curves[f"{mode} γ={gamma}"]
            C.band(ax, steps, runs.mean(0), runs.std(0), f"γ={gamma}")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(f"{mode} (M{'1' if mode == 'exact' else '2'}), β1={BETA1}", fontsize=9)
    axes[0].set_ylabel("E‖m_t − ∇F(x_t)‖²")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"Variance reduction on stochastic least squares (d={b['d']}, κ={b['kappa']:g}, "
                 f"batch {b['batch']}, {b['replicas']} replicas x {len(seeds)} seed(s))",
                 fontsize=9)
    half = b["steps"] // 2
    # a sum in a fixed order: NumPy's mean of this slice may change its last bit with the
    # memory alignment, and the JSON is compared bit for bit (figures/fixed_sums.py)
    tail = {k: fixed_sums.mean(v[:, half:]) for k, v in curves.items()}
    notes = [f"{mode}: mean error over the second half, relative to γ=0: " + ", ".join(
        f"γ={g} {tail[f'{mode} γ={g}'] / tail[f'{mode} γ=0.0']:.2f}" for g in GAMMAS)
        for mode in ("exact", "approx")]
    C.write_outputs(ctx, NAME, rows, fig, dict(
        budget=b, seeds=seeds, gammas=GAMMAS, tail_error=tail, notes=notes,
        task_title="Variance reduction (estimator error)"))
    return "; ".join(notes), None
