"""MKOR's factor recursion in 16 bits measured against the float64 oracle (LP5): the driver
the tests (``theory_tests/low_precision/test_factor_precision.py``) and the benchmark
(``figures/bench/factor_precision.py``) share.

The port's code path: one factor's state as MKOR keeps it, updated by
:func:`torch_impl.mkor.layer_state.update_layer_factors` (the float32 update, the stabiliser,
the write in ``factor_dtype`` with MKOR's seeds), step after step on a stream of rank-1
vectors. The oracle (:mod:`reference.mkor.factor_precision`) forms the factor L_t
explicitly in float64, applying the stabiliser where the run under measurement applied it.
Per step: e_t, epsilon_t, the bound B_t, whether the stabiliser fired (and whether the exact
inverse would have fired: a disagreement), and the write's signed rounding error in ulps.

Streams that match what a layer sees (K3, K6): ``"activations"``, the right factor's a_bar =
[mean of a batch of 32 rows of ReLU(x W^T + b) | 1] (a persistent mean direction, norm^2 ~ d/6);
``"gradients"``, the left factor's g_bar: small zero-mean vectors (norm ~ 0.3); ``"large"``,
vectors of norm ~ 3 sqrt(d) (the regime where one write's error dominates). Or vectors recorded
from a real run (:func:`mlp_run_vectors`).
"""
import numpy as np
import torch

from reference.mkor import factor_precision as oracle
from torch_impl.kronecker.factor_storage import factor_seed
from torch_impl.mkor.config import COLUMNS, FactorRule
from torch_impl.mkor.factors import factor_update, needs_stabilising
from torch_impl.mkor.layer_state import update_layer_factors

__all__ = ["layer_vectors", "mlp_run_vectors", "run_recursion", "summary", "MODES"]

# (factor_dtype, factor_rounding) of each measured mode
MODES = {"float64": (torch.float64, "nearest"), "float32": (torch.float32, "nearest"),
         "bf16-nearest": (torch.bfloat16, "nearest"),
         "bf16-stochastic": (torch.bfloat16, "stochastic")}
# the write's entrywise relative error bound w of each (LP5): half an ulp, one ulp
UNIT = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "bf16-nearest": 2.0 ** -8,
        "bf16-stochastic": 2.0 ** -7}
FLOAT32_UNIT = 2.0 ** -21  # the float32 update's own arithmetic, per write (8 units)


def layer_vectors(kind, d, steps, seed=0):
    """A seeded (steps, d) stream of rank-1 vectors (module docstring)."""
    g = np.random.default_rng(seed)
    if kind == "activations":
        W = g.standard_normal((d - 1, d - 1)) / np.sqrt(d - 1)
        b = 0.1 * g.standard_normal(d - 1)
        rows = [np.maximum(g.standard_normal((32, d - 1)) @ W.T + b, 0).mean(0)
                for _ in range(steps)]
        return np.concatenate([np.array(rows), np.ones((steps, 1))], axis=1)
    if kind == "gradients":
        return 0.3 * g.standard_normal((steps, d)) / np.sqrt(d)
    if kind == "large":  # |v|^2 ~ 9 d: the factor's spectrum spans ~d, kappa_t in the hundreds
        return 3.0 * g.standard_normal((steps, d))
    raise ValueError(f"kind must be 'activations', 'gradients' or 'large', got {kind!r}")


def mlp_run_vectors(width, steps, seed=0):
    """(a_bar of the hidden layer's input side, g_bar of its output side) for ``steps``
    factor updates of MKOR (float32, inv_freq 1) training a width-``width`` ReLU MLP on a
    synthetic regression: what MKOR itself handed its hidden Linear(width, width)."""
    from torch_impl import MKOR  # the driver of a real run only
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, 4))
    mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9), inv_freq=1)
    teacher = torch.nn.Linear(16, 4)
    a_side, g_side = [], []
    for _ in range(steps):
        x = torch.randn(64, 16)
        loss = torch.nn.functional.mse_loss(model(x), teacher(x).detach())
        loss.backward()
        a_bar, g_bar = mkor.pending_vectors()["2"]
        a_side.append(a_bar.double().numpy())
        g_side.append(g_bar.double().numpy())
        mkor.step()
        mkor.zero_grad()
    return np.array(a_side), np.array(g_side)


def _state(d, dtype):
    zero = torch.zeros((), dtype=torch.int64)
    false = torch.zeros((), dtype=torch.bool)
    return {"R_inv": torch.eye(d, dtype=dtype), "updates_a": zero.clone(),
            "updates_g": zero.clone(), "reset_a": false.clone(), "reset_g": false.clone(),
            "non_finite": zero.clone(), "overflow": zero.clone(), "no_rows": zero.clone(),
            "fired": zero.clone()}


def run_recursion(vectors, mode, *, variant="paper", stat_decay=0.95, zeta=0.9,
                  threshold=2.0, rounding_seed=0, layer_index=0, spectral=True):
    """The port's factor recursion on ``vectors`` in ``mode`` (a key of :data:`MODES`)
    against the explicit float64 factor. Returns a dict of per-step arrays: ``e`` (NaN
    unless ``spectral``: an SVD per step), ``eps``, ``bound``, ``fired``, ``disagree``, ``kappa``,
    and ``write_ulps``: the mean over the factor's entries of (stored - computed) /
    ulp(computed) x sign(computed), the write's bias toward or away from zero."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # d x d matrices of a few dozen: threads only add overhead
    try:
        return _run(vectors, mode, variant, stat_decay, zeta, threshold, rounding_seed,
                    layer_index, spectral)
    finally:
        torch.set_num_threads(threads)


def _run(vectors, mode, variant, stat_decay, zeta, threshold, rounding_seed, layer_index,
         spectral):
    dtype, rounding = MODES[mode]
    column = COLUMNS[variant]
    rule = FactorRule(variant, stat_decay, zeta, threshold, "max_entry",
                      column["stabilizer_timing"], column["stabilizer_reset"], "per_factor",
                      column["first_update"], dtype)
    d = vectors.shape[1]
    s = _state(d, dtype)
    L = np.eye(d)
    bound = 0.0
    unit = UNIT[mode] + FLOAT32_UNIT
    rows = {k: [] for k in ("e", "eps", "bound", "fired", "disagree", "kappa", "write_ulps")}
    options = dict(variant=variant, stat_decay=stat_decay, zeta=zeta, threshold=threshold,
                   stabilizer_timing=rule.stabilizer_timing,
                   stabilizer_reset=rule.stabilizer_reset, first_update=rule.first_update)
    for t, v in enumerate(vectors):
        vec = torch.as_tensor(v, dtype=rule.compute_dtype)
        first, flag = bool(s["updates_a"] == 0), bool(s["reset_a"])
        computed, _ = factor_update(s["R_inv"].to(rule.compute_dtype), vec, first=first,
                                    reset_flag=flag, **options)
        fired_before = int(s["fired"])
        seeds = None if rounding == "nearest" else {
            "R_inv": factor_seed(rounding_seed, layer_index, "R_inv", t)}
        update_layer_factors(s, vec, vec, None, rule, seeds=seeds)
        fired = int(s["fired"]) > fired_before
        # the oracle follows the run's stabiliser (the exact inverse's own decision beside)
        spectrum = oracle.factor_spectrum(L)
        w_L, U_L = spectrum
        exact_J = (U_L / w_L) @ U_L.T
        if rule.stabilizer_timing == "before_sm":
            exact_fires = bool(needs_stabilising(torch.from_numpy(exact_J), threshold))
            reset, update = ("blend" if rule.stabilizer_reset == "blend" else "identity"), True
            reset = reset if fired else None
        else:  # deferred: a flagged factor is reset instead of updated
            exact_fires = flag
            reset = rule.stabilizer_reset if flag else None
            update = not flag
        if first and rule.first_update == "identity":
            reset, update = "identity", False
        contraction = 1.0
        if reset == "identity":
            contraction = 0.0
        elif reset == "blend":
            contraction = oracle.blend_contraction(L, zeta, spectrum)
        step = dict(variant=variant, stat_decay=stat_decay, zeta=zeta)
        L = oracle.explicit_factor_step(L, v, reset=reset, update=False, **step)
        if variant == "released" and update:  # K10 blends the inverse at every update
            contraction *= oracle.blend_contraction(L, oracle.RELEASED_BLEND)
        L = oracle.explicit_factor_step(L, v, update=update, **step)
        J_hat = s["R_inv"].double().numpy()
        spectrum = oracle.factor_spectrum(L)
        kappa = oracle.write_error_scale(J_hat, L, spectrum)
        bound = oracle.error_bound_step(bound, contraction, unit, kappa)
        ulp = _ulp(computed, dtype)
        signed = (s["R_inv"].double() - computed.double()) / ulp * torch.sign(computed.double())
        rows["e"].append(oracle.inverse_error(J_hat, L) if spectral else np.nan)
        rows["eps"].append(oracle.energy_error(J_hat, L, spectrum))
        rows["bound"].append(bound)
        rows["fired"].append(fired)
        rows["disagree"].append(fired != exact_fires and rule.stabilizer_timing == "before_sm")
        rows["kappa"].append(kappa)
        rows["write_ulps"].append(float(signed[computed != 0].mean()))
    return {k: np.array(v) for k, v in rows.items()}


def _ulp(x, dtype):
    """The spacing of ``dtype`` at each entry of the float32 ``x`` (as float64)."""
    narrow = x.to(dtype)
    up = torch.nextafter(narrow, torch.full_like(narrow, float("inf"))).double()
    down = torch.nextafter(narrow, torch.full_like(narrow, float("-inf"))).double()
    return torch.maximum(up - narrow.double(), narrow.double() - down)


def summary(run):
    """Percentiles of epsilon and e, the stabiliser's firings and disagreements, and the
    bound's margin, for a table row."""
    eps, e = run["eps"], run["e"]
    n = len(run["fired"])
    return {"eps_p50": float(np.median(eps)), "eps_p90": float(np.percentile(eps, 90)),
            "eps_max": float(eps.max()), "e_p50": float(np.median(e)),
            "e_max": float(np.max(e)), "fired": int(run["fired"].sum()),
            "disagree": int(run["disagree"].sum()),
            "eps_over_bound_max": float(np.max(run["eps"] / run["bound"])),
            "bound_p50": float(np.median(run["bound"])),
            "first_quarter_eps": float(np.mean(run["eps"][n // 4: n // 2])),
            "last_quarter_eps": float(np.mean(run["eps"][3 * n // 4:])),
            "write_ulps_mean": float(np.mean(run["write_ulps"]))}
