"""Optimizer-level properties of ``torch_impl.MARS`` (MARS.md section 7, MT1-MT18).

Gradients are fed by hand (``p.grad = g``) unless a property is about closures, so the iterates
never feed back into the gradients and every difference is the optimizer's.  float64 throughout.
Tolerance conventions: "ulp-level" means a handful of float64 roundings (2.2e-16 each) of the
quantity compared; each assertion states the factor and why.
"""
import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from theory_tests.support.mars_property_helpers import assert_ulp_close, recovered_c, F64, MARS_TYPES, clone_params, feed, make_params, random_grads, \
    snapshot, steps
from reference.mars.mars_equations import correction_coefficient
from torch_impl import MARS
from torch_impl.mars import mars_equations
from torch_impl.common.tensor_ops import FOREACH, SINGLE

seeds = st.integers(0, 2**32 - 1)
shape2d = st.tuples(st.integers(1, 4), st.integers(1, 4))
unit = st.floats(0.0, 0.95)


# ------------------------------------------------------------------ MT1, MT2, MT17: reductions

@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@given(lr=st.floats(1e-4, 1e-1), b1=unit, b2=st.floats(0.0, 0.999), eps=st.floats(1e-10, 1e-3),
       wd=st.floats(0.0, 0.5), shapes=st.lists(shape2d, min_size=1, max_size=3),
       clip=st.booleans(), seed=seeds)
def test_mt1_gamma_zero_is_adamw(foreach, lr, b1, b2, eps, wd, shapes, clip, seed):
    """gamma = 0 on 2-D params: torch AdamW step for step, fed g / max(1, ||g||)."""
    rng = np.random.default_rng(seed)
    ours = make_params(shapes, seed)
    theirs = clone_params(ours)
    mars = MARS(ours, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, gamma=0.0, foreach=foreach)
    adamw = torch.optim.AdamW(theirs, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd,
                              foreach=False)
    travelled = 0.0
    for _ in range(5):
        low, high = (1.0, 50.0) if clip else (0.05, 1.0)
        grads = random_grads(rng, shapes, rng.uniform(low, high, len(shapes)))
        before = snapshot(theirs)
        feed(mars, ours, grads)
        feed(adamw, theirs, [g / torch.linalg.vector_norm(g).clamp(min=1.0) for g in grads])
        travelled += max((p - q).abs().max().item() for p, q in zip(theirs, before))
        for p, q in zip(ours, theirs):
            # the two write the same bias-corrected quotient in different orders
            assert_ulp_close(p, q, travelled)
            for key in ("exp_avg", "exp_avg_sq"):  # entries <= 1 after the clip: absolute 1e-14
                torch.testing.assert_close(mars.state[p][key], adamw.state[q][key],
                                           rtol=0, atol=1e-14)


@given(lr=st.floats(1e-4, 1e-1), lr_1d=st.floats(1e-4, 1e-1), betas_1d=st.tuples(unit, unit),
       eps=st.floats(1e-10, 1e-3), gamma=st.floats(0.0, 1.0), wd=st.floats(0.0, 0.5),
       wd_1d=st.floats(0.0, 0.5), log_scale=st.floats(-3, 3), seed=seeds)
def test_mt2_non_2d_tensors_follow_adamw_with_1d_hyperparameters(
        lr, lr_1d, betas_1d, eps, gamma, wd, wd_1d, log_scale, seed):
    """optimize_1d=False: 1-D and 4-D params are AdamW(lr r, betas_1d, eps, weight_decay_1d),
    r = lr_1d / lr, whatever gamma and the group's weight_decay; the raw g (no clip)."""
    rng = np.random.default_rng(seed)
    shapes = [(3, 2), (5,), (2, 1, 2, 3)]
    ours = make_params(shapes, seed)
    theirs = clone_params(ours[1:])
    mars = MARS(ours, lr=lr, eps=eps, weight_decay=wd, gamma=gamma, lr_1d=lr_1d,
                betas_1d=betas_1d, weight_decay_1d=wd_1d)
    adamw = torch.optim.AdamW(theirs, lr=lr * (lr_1d / lr), betas=betas_1d, eps=eps,
                              weight_decay=wd_1d, foreach=False)
    travelled = 0.0
    for _ in range(5):
        grads = random_grads(rng, shapes, scale=10.0**log_scale)
        before = snapshot(theirs)
        feed(mars, ours, grads)
        feed(adamw, theirs, grads[1:])
        travelled += max((p - q).abs().max().item() for p, q in zip(theirs, before))
        for p, q in zip(ours[1:], theirs):
            assert_ulp_close(p, q, travelled)  # same reason as MT1


@pytest.mark.parametrize("mars_type", MARS_TYPES)
def test_mt17_lr_schedule_scales_2d_and_1d_updates(mars_type):
    """StepLR on group['lr'] scales every update by the schedule's factor (wd = 0, so the
    moments do not depend on lr and the two runs see the same directions)."""
    rng = np.random.default_rng(0)
    shapes = [(4, 3), (3, 5), (4,), (2, 2, 1, 2)]
    kw = dict(lr=1e-2, lr_1d=4e-3, weight_decay=0.0, weight_decay_1d=0.0, mars_type=mars_type,
              ns_dtype=F64)
    const_p = make_params(shapes)
    sched_p = clone_params(const_p)
    const, sched = MARS(const_p, **kw), MARS(sched_p, **kw)
    scheduler = torch.optim.lr_scheduler.StepLR(sched, step_size=2, gamma=0.3)
    for t in range(7):
        grads = random_grads(rng, shapes)
        factor = sched.param_groups[0]["lr"] / kw["lr"]
        a0, b0 = snapshot(const_p), snapshot(sched_p)
        feed(const, const_p, grads)
        feed(sched, sched_p, grads)
        scheduler.step()
        for p, p0, q, q0 in zip(const_p, a0, sched_p, b0):
            # differences of O(1) iterates lose ~log10(1/step) digits: 1e-9 relative
            torch.testing.assert_close(q - q0, factor * (p - p0), rtol=1e-9, atol=1e-15)
    assert sched.param_groups[0]["lr"] < kw["lr"] * 0.3**2  # the schedule did act


# ------------------------------------------------------------------ MT3: the clip

@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@given(shapes=st.lists(shape2d, min_size=1, max_size=4), log_scales=st.lists(
    st.floats(-3, 3), min_size=4, max_size=4), a=st.floats(0.0, 20.0), seed=seeds)
def test_mt3_functional_clip_bound_and_identity_below_one(foreach, shapes, log_scales, a, seed):
    rng = np.random.default_rng(seed)
    grads = [g * 10.0**s for g, s in zip(random_grads(rng, shapes), log_scales)]
    prev = random_grads(rng, shapes)
    bufs = [p.clone() for p in prev]
    ops = FOREACH if foreach else SINGLE
    gamma, beta1 = a, 0.5  # a = gamma beta1 / (1 - beta1) = gamma, exactly (powers of two)
    if foreach:
        mars_equations.corrected_gradient_(bufs, grads, gamma, beta1, ops)
        norms = ops.norm(bufs)
    else:
        norms = [ops.norm(mars_equations.corrected_gradient_(b, g, gamma, beta1, ops))
                 for b, g in zip(bufs, grads)]
    cs = [b.clone() for b in bufs]
    for c, g, gp in zip(cs, grads, prev):  # MT5 in place: c = (1 + a) g - a g_prev
        # two roundings of terms of size (1 + a)|g| and a|g_prev|
        scale = (1 + a) * (g.abs().max() + gp.abs().max())
        torch.testing.assert_close(c, (1 + a) * g - a * gp, rtol=0, atol=1e-15 * scale)
    if foreach:
        mars_equations.clip_tensor_(bufs, norms, ops)
    else:
        for b, n in zip(bufs, norms):
            mars_equations.clip_tensor_(b, n, ops)
    for c, clipped, n in zip(cs, bufs, norms):
        if n <= 1:
            assert torch.equal(clipped, c)  # dividing by max(1, n) = 1 is exact
        else:  # a division per entry and the norm's rounding: 1e-14 relative
            assert torch.linalg.vector_norm(clipped) <= 1 + 1e-14


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@given(shapes=st.lists(shape2d, min_size=1, max_size=4), log_scales=st.lists(
    st.floats(-3, 3), min_size=4, max_size=4), seed=seeds)
def test_mt3_functional_global_clip_divides_by_the_joint_norm(foreach, shapes, log_scales, seed):
    """``clip_global_``: every c divided by max(1, sqrt(sum ||c_i||^2)), one norm for all."""
    rng = np.random.default_rng(seed)
    cs = [g * 10.0**s for g, s in zip(random_grads(rng, shapes), log_scales)]
    joint = torch.linalg.vector_norm(torch.cat([c.flatten() for c in cs]))
    ops = FOREACH if foreach else SINGLE
    out = mars_equations.clip_global_([c.clone() for c in cs],
                                      [torch.linalg.vector_norm(c) for c in cs], ops)
    for c, clipped in zip(cs, out):  # the norm's rounding and one division: 1e-14 relative
        torch.testing.assert_close(clipped, c / joint.clamp(min=1.0), rtol=1e-14, atol=0)


def _clip_run(scope, mars_type, b1, gamma, scales, seed, n_steps=6):
    """Run MARS on two matrices, returning per step (g, m_before, m_after) per tensor."""
    rng = np.random.default_rng(seed)
    shapes = [(3, 4), (2, 2)]
    params = make_params(shapes, seed)
    opt = MARS(params, lr=1e-2, betas=(b1, 0.99), gamma=gamma, clip_scope=scope,
               mars_type=mars_type, ns_dtype=F64)
    log = []
    for _ in range(n_steps):
        grads = [g * s for g, s in zip(random_grads(rng, shapes), scales)]
        before = [opt.state[p]["exp_avg"].clone() if p in opt.state else torch.zeros_like(p)
                  for p in params]
        feed(opt, params, grads)
        log.append((grads, before, [opt.state[p]["exp_avg"].clone() for p in params]))
    return log


@pytest.mark.parametrize("scope", ["tensor", "global"])
@given(b1=st.floats(0.0, 0.9), gamma=st.floats(0.0, 1.0),
       log_scales=st.tuples(st.floats(-2, 2), st.floats(-2, 2)), seed=seeds)
def test_mt3_clipped_corrected_gradient_and_momentum_bound(scope, b1, gamma, log_scales, seed):
    """c~ = c / max(1, ||c||) (per tensor, or with the global norm), and ||m_t|| <= 1 - b1^t."""
    a = correction_coefficient(gamma, b1)
    log = _clip_run(scope, "mars-adamw", b1, gamma, [10.0**s for s in log_scales], seed)
    g_prev = [torch.zeros_like(g) for g in log[0][0]]
    for t, (grads, m0, m1) in enumerate(log, start=1):
        cs = [g + a * (g - gp) for g, gp in zip(grads, g_prev)]
        norms = [torch.linalg.vector_norm(c) for c in cs]
        if scope == "global":
            norms = [torch.linalg.vector_norm(torch.stack(norms))] * len(cs)
        got = [recovered_c(x, y, b1) for x, y in zip(m1, m0)]
        for c, n, c_tilde in zip(cs, norms, got):
            # recovery cancels m_{t-1}: error <= (1 + b1) ulp(|m|) / (1 - b1) <= 1e-14 (b1 <= 0.9)
            torch.testing.assert_close(c_tilde, c / n.clamp(min=1.0), rtol=1e-10, atol=1e-13)
        total = [torch.linalg.vector_norm(c) for c in got]
        bound = 1 - b1**t
        if scope == "tensor":
            assert max(total) <= 1 + 1e-12
            assert all(torch.linalg.vector_norm(m) <= bound * (1 + 1e-14) for m in m1)
        else:
            assert torch.linalg.vector_norm(torch.stack(total)) <= 1 + 1e-12
            m_norm = torch.linalg.vector_norm(torch.cat([m.flatten() for m in m1]))
            assert m_norm <= bound * (1 + 1e-14)  # a convex-combination bound, ulp slack
        g_prev = grads


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("mars_type", MARS_TYPES)
@given(log_k=st.floats(-3, 3), seed=seeds)
def test_mt3_scaling_one_tensor_leaves_the_others_alone_under_tensor_scope(
        foreach, mars_type, log_k, seed):
    rng = np.random.default_rng(seed)
    shapes = [(3, 4), (4, 2)]
    seq = [random_grads(rng, shapes, scale=5.0) for _ in range(4)]  # ||c|| > 1: clips fire
    runs = {}
    for scope in ("tensor", "global"):
        for k in (1.0, 10.0**log_k):
            params = make_params(shapes, seed)
            opt = MARS(params, lr=1e-2, gamma=0.5, mars_type=mars_type, clip_scope=scope,
                       foreach=foreach, ns_dtype=F64)
            steps(opt, params, [[g[0] * k, g[1]] for g in seq])
            runs[scope, k] = params[1], opt.state[params[1]]
    (p, s), (q, r) = runs["tensor", 1.0], runs["tensor", 10.0**log_k]
    assert torch.equal(p, q) and all(torch.equal(s[key], r[key]) for key in s)
    if abs(log_k) > 0.1:  # global scope couples the tensors through the shared norm (Lion's
        # sign may hide it in the iterate, so compare the momentum it acts on)
        assert not torch.equal(runs["global", 1.0][1]["exp_avg"],
                               runs["global", 10.0**log_k][1]["exp_avg"])


# ------------------------------------------------------------------ MT4, MT5, MT15: step 1

@pytest.mark.parametrize("scope", ["none", "tensor"])
@given(b1=unit, gamma=st.floats(0.0, 1.0), shape=shape2d, log_scale=st.floats(-3, 3), seed=seeds)
def test_mt4_first_corrected_gradient_is_one_plus_a_times_g(scope, b1, gamma, shape, log_scale,
                                                            seed):
    g = random_grads(np.random.default_rng(seed), [shape], scale=10.0**log_scale)[0]
    params = make_params([shape], seed)
    opt = MARS(params, betas=(b1, 0.99), gamma=gamma, clip_scope=scope)
    feed(opt, params, [g])
    c1 = (1 + correction_coefficient(gamma, b1)) * g
    if scope == "tensor":
        c1 = c1 / torch.linalg.vector_norm(c1).clamp(min=1.0)
    # m_1 = (1 - b1) c~_1: one rounding to form, one to divide back
    torch.testing.assert_close(opt.state[params[0]]["exp_avg"] / (1 - b1), c1, rtol=1e-14, atol=0)


@pytest.mark.parametrize("scope", ["tensor", "global", "none"])
@given(lr=st.floats(1e-3, 1e-1), betas=st.tuples(unit, st.floats(0.0, 0.999)),
       gamma=st.floats(0.0, 1.0), shape=shape2d, seed=seeds)
def test_mt15_first_step_with_eps_zero_is_lr_sign_g(scope, lr, betas, gamma, shape, seed):
    rng = np.random.default_rng(seed)
    g = torch.tensor(rng.choice([-1.0, 1.0], size=shape) * 10.0 ** rng.uniform(-3, 3, size=shape))
    params = make_params([shape], seed, bound=1.0)
    before = snapshot(params)[0]
    opt = MARS(params, lr=lr, betas=betas, eps=0.0, gamma=gamma, clip_scope=scope)
    feed(opt, params, [g])
    # u = c~ / |c~| up to ~4 roundings; p - lr u rounds once at |p| <= 1 >= lr/1000: 1e-12
    torch.testing.assert_close(params[0] - before, -lr * torch.sign(g), rtol=1e-12, atol=0)


@given(b1=unit, gamma=st.floats(0.0, 1.0), n_steps=st.integers(1, 8), seed=seeds)
def test_mt15_bias_corrected_momentum_for_constant_gradients(b1, gamma, n_steps, seed):
    """Identical g every step, no clip: m_k / (1 - b1^k) = g (1 + a (1-b1) b1^(k-1) / (1-b1^k));
    so exactly g when gamma = 0."""
    g = random_grads(np.random.default_rng(seed), [(3, 3)])[0]
    params = make_params([(3, 3)], seed)
    opt = MARS(params, betas=(b1, 0.99), gamma=gamma, clip_scope="none")
    a = correction_coefficient(gamma, b1)
    for k in range(1, n_steps + 1):
        feed(opt, params, [g])
        expected = g * (1 + a * (1 - b1) * b1 ** (k - 1) / (1 - b1**k))
        # a geometric sum of k terms, ~3 roundings each, on entries of size (1 + a)|g|
        torch.testing.assert_close(opt.state[params[0]]["exp_avg"] / (1 - b1**k), expected,
                                   rtol=1e-13, atol=1e-14 * (1 + a))


# ------------------------------------------------------------------ MT16: weight decay

@pytest.mark.parametrize("mars_type", MARS_TYPES)
def test_mt16_zero_gradient_decays_by_each_groups_factor(mars_type):
    lr, lr_1d, wd_1d = 0.1, 0.05, 0.3
    groups = [dict(params=make_params([(3, 4), (3,)], 1), weight_decay=0.2),
              dict(params=make_params([(2, 5), (2, 1, 1, 2)], 2), weight_decay=0.7)]
    opt = MARS(groups, lr=lr, lr_1d=lr_1d, weight_decay_1d=wd_1d, mars_type=mars_type)
    for _ in range(3):
        before = [snapshot(g["params"]) for g in groups]
        feed(opt, [p for g in groups for p in g["params"]],
             [torch.zeros_like(p) for g in groups for p in g["params"]])
        for group, old in zip(groups, before):
            matrix, other = group["params"]
            # m = v = 0 and c = 0: the update is exactly 0, leaving one multiplication
            torch.testing.assert_close(matrix, old[0] * (1 - lr * group["weight_decay"]),
                                       rtol=4e-16, atol=0)
            torch.testing.assert_close(other, old[1] * (1 - lr * (lr_1d / lr) * wd_1d),
                                       rtol=4e-16, atol=0)


# ------------------------------------------------------------------ MT18: AMSGrad

@given(b2=st.floats(0.0, 0.999), gamma=st.floats(0.0, 1.0), log_scales=st.lists(
    st.floats(-2, 2), min_size=6, max_size=6), seed=seeds)
def test_mt18_amsgrad_max_never_decreases(b2, gamma, log_scales, seed):
    rng = np.random.default_rng(seed)
    params = make_params([(3, 4)], seed)
    opt = MARS(params, betas=(0.9, b2), gamma=gamma, amsgrad=True)
    previous = torch.zeros(3, 4, dtype=F64)
    for s in log_scales:
        feed(opt, params, random_grads(rng, [(3, 4)], scale=10.0**s))
        st_ = opt.state[params[0]]
        assert torch.all(st_["max_exp_avg_sq"] >= previous)
        assert torch.all(st_["max_exp_avg_sq"] >= st_["exp_avg_sq"])
        previous = st_["max_exp_avg_sq"].clone()


@given(b2=st.floats(0.0, 0.99), growth=st.floats(1.0, 2.0), seed=seeds)
def test_mt18_amsgrad_equals_v_when_v_is_non_decreasing(b2, growth, seed):
    """gamma = 0 and no clip: c_t = g_t, and |g_t| = growth^t |g| never shrinks, so v_t >= v_{t-1}
    (v_{t-1} is a convex combination of earlier c^2 <= c_t^2)."""
    g = random_grads(np.random.default_rng(seed), [(3, 4)])[0]
    params = make_params([(3, 4)], seed)
    ams = MARS(params, betas=(0.9, b2), gamma=0.0, clip_scope="none", amsgrad=True)
    for t in range(6):
        feed(ams, params, [g * growth**t])
        st_ = ams.state[params[0]]
        assert torch.equal(st_["max_exp_avg_sq"], st_["exp_avg_sq"])
