"""Our MARS against HeavyBall 3.2.1's ``heavyball.AdamW(mars=True)`` through the convention map
``theory_tests/support/heavyball_conventions.py::from_heavyball_adamw`` (every difference named
there and in ``paper_notes/peers_low_precision.md``).

The model and the lockstep are the other peers' (``_lockstep``: a Conv1d, a Linear, biases and
a 0-D scale, both optimizers fed the gradient at the peer's iterate), here over 20 steps of a
changing lr.  The difference must stay within the shared rounding bound plus the two terms
``_heavyball_bounds`` derives (its eps form, its float-typed EMA weights).  HeavyBall runs
eager (``utils.compile_mode = None``: by default it compiles every fused function, 17 s for
the first step here; the compiled kernels are its code generation, not its arithmetic).
"""
import inspect
import warnings

import pytest
import torch

from theory_tests.peers._heavyball_bounds import ema_weight_bound, eps_form_bound
from theory_tests.peers._lockstep import assert_within, lockstep, rounding_bound
from theory_tests.support.heavyball_conventions import (HEAVYBALL_ADAMW_DEFAULTS, USE_DEFAULT,
                                                        from_heavyball_adamw,
                                                        heavyball_coefficient, load_heavyball)

heavyball = load_heavyball()
STEPS = 20
WD = 0.04
# the peer's default gamma (0.0025) and one where the correction is large (k = 0.1)
CONFIGS = {
    "defaults": dict(lr=1e-2, weight_decay=WD, mars=True),
    "gamma_0.1_warmup": dict(lr=1e-2, weight_decay=WD, mars=True, mars_gamma=0.1,
                             betas=(0.5, 0.95), warmup_steps=4),
    "loop": dict(lr=1e-2, weight_decay=WD, mars=True, mars_gamma=0.05, multi_tensor=False),
}
UNIT = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}


@pytest.fixture(autouse=True)
def eager_heavyball(monkeypatch):
    monkeypatch.setattr(heavyball.utils, "compile_mode", None)


def _v_hat(opt, p):
    """The peer's stored (debiased) second moment of ``p``."""
    return opt.state_(p)[opt._find_val_name("exp_avg_sq")]


def _run(dtype, kw, gamma_override=None, target_scale=30.0):
    kw = dict(kw, storage_dtype=str(dtype).split(".")[1])

    def ours(named):
        mapping = from_heavyball_adamw(named, **kw)
        if gamma_override is not None:
            for group in mapping.param_groups:
                group["gamma"] = gamma_override
        return mapping

    with warnings.catch_warnings():
        # the lockstep's lr schedule is HeavyBall's "experimental" changed-lr path, warned once
        warnings.filterwarnings("ignore", message="Learning rate changed between steps")
        return lockstep(lambda ps: heavyball.AdamW(ps, **kw), ours, dtype, steps=STEPS,
                        target_scale=target_scale, peer_v=_v_hat)


def _bounds(history, dtype, kw):
    betas = kw.get("betas", HEAVYBALL_ADAMW_DEFAULTS["betas"])
    eps = kw.get("eps", HEAVYBALL_ADAMW_DEFAULTS["eps"])
    return (rounding_bound(history, dtype, WD), eps_form_bound(history, eps, WD),
            ema_weight_bound(history, betas, WD, UNIT[dtype], dtype != torch.float64))


def test_the_installed_heavyball_and_its_defaults_are_the_maps():
    signature = inspect.signature(heavyball.AdamW.__init__)
    installed = {k: (USE_DEFAULT if v.default is heavyball.chainable.use_default else v.default)
                 for k, v in signature.parameters.items()
                 if k not in ("self", "params", "kwargs")}
    assert installed == HEAVYBALL_ADAMW_DEFAULTS


def test_its_correction_swaps_gamma_and_beta1():
    """Where: ``chainable.mars`` passes (gamma, beta1) to ``mars_correction(g, old_g, beta1,
    gamma)``.  What: c = g + k (g - g_prev) with k = γβ₁/(1 - γ), read from the gradient
    tensor HeavyBall overwrites with c (float64, so k is recovered to 1e-12)."""
    assert list(inspect.signature(heavyball.utils.mars_correction).parameters) == [
        "g", "old_g", "beta1", "gamma"]
    call = 'mars_correction(update, mars_old_grad, group["mars_gamma"], utils.get_beta1(group))'
    assert call in inspect.getsource(heavyball.chainable.mars.get_fn())
    gamma, beta1 = 0.1, 0.8
    p = torch.nn.Parameter(torch.zeros(6, dtype=torch.float64))
    opt = heavyball.AdamW([p], lr=1e-3, betas=(beta1, 0.99), mars=True, mars_gamma=gamma,
                          storage_dtype="float64")
    g1 = torch.linspace(-2.0, 3.0, 6, dtype=torch.float64)
    g2 = torch.linspace(5.0, -1.5, 6, dtype=torch.float64)
    seen = []
    for g in (g1, g2):
        p.grad = g.clone()
        held = p.grad
        opt.step()
        seen.append(held)  # now c: the peer wrote it into the gradient tensor
        assert p.grad is None
    k = heavyball_coefficient(gamma, beta1)
    assert k == pytest.approx(gamma * beta1 / (1 - gamma))
    torch.testing.assert_close(seen[0], (1 + k) * g1, rtol=1e-12, atol=0)  # g_prev = 0
    torch.testing.assert_close((seen[1] - g2) / (g2 - g1), torch.full_like(g1, k), rtol=1e-12,
                               atol=0)
    paper = gamma * beta1 / (1 - beta1)
    assert abs(paper / k - 4.5) < 1e-12  # (1 - γ)/(1 - β₁) = 0.9/0.2: not a rounding apart


def test_it_does_not_clip_c():
    """A gradient of norm 60: c₁ = (1 + k) g₁ as it is (ours would divide it by its norm)."""
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    opt = heavyball.AdamW([p], mars=True, mars_gamma=0.2, storage_dtype="float64")
    g = torch.tensor([30.0, -30.0, 30.0, -30.0], dtype=torch.float64)
    p.grad = g.clone()
    held = p.grad
    opt.step()
    torch.testing.assert_close(held, (1 + heavyball_coefficient(0.2, 0.9)) * g)


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_ours_takes_heavyballs_steps(dtype, config):
    """20 steps, every tensor kind, within rounding + the eps form + the peer's EMA weights."""
    kw = CONFIGS[config]
    history = _run(dtype, kw)
    worst, _ = assert_within(history, *_bounds(history, dtype, kw))
    moved = max((r["peer"] - r["before"]).abs().max().item() for r in history[-1])
    assert moved > 1e-4
    assert worst < (1e-8 if dtype == torch.float64 else 1e-6)  # measured 1.4e-9, 3.0e-8


def test_without_its_eps_form_the_map_is_rounding_exact():
    """eps = 1e-30 on both sides: max(s, ε) = s = s + ε in float64, so only rounding is left."""
    kw = dict(CONFIGS["gamma_0.1_warmup"], eps=1e-30)
    history = _run(torch.float64, kw)
    worst, _ = assert_within(history, rounding_bound(history, torch.float64, WD))
    assert worst < 1e-15


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_the_papers_coefficient_is_not_heavyballs(dtype):
    """The control: our gamma = HeavyBall's mars_gamma (a = γβ₁/(1 - β₁), the paper's) leaves
    the bounds at the first step with a g_prev, by far."""
    kw = CONFIGS["gamma_0.1_warmup"]
    history = _run(dtype, kw, gamma_override=kw["mars_gamma"])
    bounds = _bounds(history, dtype, kw)
    with pytest.raises(AssertionError, match="step 2"):
        assert_within(history, *bounds)
    excess = max((r["ours"] - r["peer"]).abs().max().item() / sum(b[1][r["name"]] for b in bounds)
                 for r in history[1])
    assert excess > 100


def test_the_refusals_raise():
    named = list(torch.nn.Linear(3, 2).named_parameters())
    for kw, match in ((dict(caution=True), "caution"),
                      (dict(cautious_weight_decay=True), "cautious_weight_decay"),
                      (dict(gradient_clipping="l2_clip_"), "gradient_clipping"),
                      (dict(palm=True), "palm"),
                      (dict(ecc="bf16+8"), "ecc"),
                      (dict(storage_dtype="float16"), "float16"),
                      (dict(storage_dtype="float64"), "storage_dtype"),
                      (dict(mars=True, mars_gamma=0.9, betas=(0.1, 0.99)), "outside"),
                      (dict(foreach=True), "no counterpart")):
        with pytest.raises(ValueError, match=match):
            from_heavyball_adamw(named, **kw)
    half = [(n, p.detach().bfloat16().requires_grad_()) for n, p in named]
    with pytest.raises(ValueError, match="promote"):
        from_heavyball_adamw(half, mars=True)


def test_a_tensor_that_misses_a_step_is_refused():
    named = list(torch.nn.Linear(3, 2).named_parameters())
    mapping = from_heavyball_adamw(named, mars=True)
    ours = mapping.build()
    for _, p in named:
        p.grad = torch.ones_like(p)
    mapping.step(ours)
    named[1][1].grad = None
    with pytest.raises(ValueError, match="bias: no gradient at the group's step 2"):
        mapping.step(ours)


def test_an_element_that_never_has_a_gradient_stays_finite_in_both():
    """Why our eps is the peer's and not 0 (which would make the two denominators equal
    wherever √v̂ ≥ ε): where v̂ = 0 the peer divides 0 by max(0, ε) and ours 0 by 0 + ε; with
    eps = 0 ours would be 0/0.  (ε = 1e-30 here, so that the other elements agree to rounding.)"""
    p = torch.nn.Parameter(torch.tensor([0.5, -0.25, 1.0, 2.0], dtype=torch.float64))
    q = torch.nn.Parameter(p.detach().clone())
    kw = dict(lr=1e-2, mars=True, mars_gamma=0.1, weight_decay=WD, eps=1e-30,
              storage_dtype="float64")
    peer = heavyball.AdamW([p], **kw)
    mapping = from_heavyball_adamw([("p", q)], **kw)
    ours = mapping.build()
    for t in range(3):
        g = torch.tensor([1.0 + t, 0.0, -2.0, 0.5 * t], dtype=torch.float64)
        p.grad, q.grad = g.clone(), g.clone()
        peer.step()
        mapping.step(ours)
    assert torch.isfinite(q).all()
    torch.testing.assert_close(q, p, rtol=0, atol=1e-15)
