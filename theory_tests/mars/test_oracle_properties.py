"""The MT properties of MARS.md section 7 on the NumPy oracle itself (``reference.mars.mars``).

``mars/test_properties.py`` and its siblings check MT1-MT18 on the torch port; the port is then
compared with the oracle by the float64 differential tests.  A bug shared by both, or one in an
oracle function the differential never reaches, would pass both, so each property that names
oracle code in ``paper_notes/claims.md`` is checked here on the oracle directly, against
``reference.common.first_order`` (an independent AdamW and Lion) or a closed form.  float64
throughout; tolerances are stated where a comparison is not exact.
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from theory_tests.support.mars_property_helpers import P_STAR
from reference.common.first_order import adamw as adamw_ref
from reference.mars.mars import MARSConfig, MARSReference, mars_trajectory
from reference.mars.mars_equations import (clip_global, clip_tensor, correction_coefficient,
                                          corrected_gradient, lion_step, shampoo_direction,
                                          shape_scale)
from reference.common.matrix_functions import newton_schulz, orthogonalize_svd

seeds = st.integers(0, 2**32 - 1)
unit = st.floats(0.0, 0.95)


def _rtol_close(actual, expected, travelled):
    """Two float64 evaluations of the same update in another order: a few ulps per step, so
    1e-13 of the distance travelled plus 1e-14 of the iterate (as ``assert_ulp_close``)."""
    np.testing.assert_allclose(actual, expected, rtol=1e-14, atol=1e-13 * travelled)


# ------------------------------------------------------------------ MT1, MT2: reductions

@given(lr=st.floats(1e-4, 1e-1), b1=unit, b2=st.floats(0.0, 0.999), eps=st.floats(1e-10, 1e-3),
       wd=st.floats(0.0, 0.5), log_norm=st.floats(-1, 1.5), seed=seeds)
def test_mt1_oracle_gamma_zero_is_adamw_fed_the_clipped_gradient(lr, b1, b2, eps, wd, log_norm,
                                                                  seed):
    rng = np.random.default_rng(seed)
    shapes = [(3, 4), (2, 2)]
    params = [rng.normal(size=s) for s in shapes]
    opt = MARSReference(params, MARSConfig(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd,
                                           gamma=0.0))
    theirs, states, travelled = [p.copy() for p in params], [{} for _ in shapes], 0.0
    for _ in range(5):
        grads = [rng.normal(size=s) * 10.0 ** (log_norm + rng.uniform(-1, 1)) for s in shapes]
        ours = opt.step(grads)
        new = [adamw_ref(p, g / max(1.0, np.linalg.norm(g)), st_, lr=lr, betas=(b1, b2), eps=eps,
                         weight_decay=wd) for p, g, st_ in zip(theirs, grads, states)]
        travelled += max(np.abs(a - b).max() for a, b in zip(new, theirs))
        theirs = new
        for p, q in zip(ours, theirs):
            _rtol_close(p, q, travelled)


@pytest.mark.parametrize("source", ["constructor", "group"])
@given(lr=st.floats(1e-4, 1e-1), lr_1d=st.floats(1e-4, 1e-1), betas_1d=st.tuples(unit, unit),
       gamma=st.floats(0.0, 1.0), wd=st.floats(0.0, 0.5), wd_1d=st.floats(0.0, 0.5),
       log_scale=st.floats(-3, 3), seed=seeds)
def test_mt2_oracle_fallback_is_adamw_with_1d_hyperparameters(source, lr, lr_1d, betas_1d, gamma,
                                                               wd, wd_1d, log_scale, seed):
    """(M14): 1-D and 4-D tensors take AdamW(lr r, betas_1d, eps, wd_1d or the group's wd) on
    the raw g, r = lr_1d / lr, whatever gamma; the 2-D tensor takes MARS."""
    rng = np.random.default_rng(seed)
    shapes = [(3, 2), (5,), (2, 1, 2, 3)]
    params = [rng.normal(size=s) for s in shapes]
    opt = MARSReference(params, MARSConfig(lr=lr, lr_1d=lr_1d, betas_1d=betas_1d, gamma=gamma,
                                           weight_decay=wd, weight_decay_1d=wd_1d,
                                           weight_decay_1d_source=source))
    decay = wd_1d if source == "constructor" else wd
    theirs, states, travelled = [p.copy() for p in params[1:]], [{}, {}], 0.0
    for _ in range(5):
        grads = [rng.normal(size=s) * 10.0**log_scale for s in shapes]
        ours = opt.step(grads)
        new = [adamw_ref(p, g, st_, lr=lr * (lr_1d / lr), betas=betas_1d, eps=1e-8,
                         weight_decay=decay) for p, g, st_ in zip(theirs, grads[1:], states)]
        travelled += max(np.abs(a - b).max() for a, b in zip(new, theirs))
        theirs = new
        for p, q in zip(ours[1:], theirs):
            _rtol_close(p, q, travelled)


# ------------------------------------------------------------------ MT3, MT4: clip, step 1

@given(shapes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 4)), min_size=1, max_size=4),
       log_scales=st.lists(st.floats(-3, 3), min_size=4, max_size=4), seed=seeds)
def test_mt3_oracle_clip_is_c_over_max_one_norm(shapes, log_scales, seed):
    """clip_tensor: c / max(1, ||c||) per tensor (identity below 1, norm exactly 1 above);
    clip_global: every tensor divided by max(1, the joint norm)."""
    rng = np.random.default_rng(seed)
    cs = [rng.normal(size=s) * 10.0**k for s, k in zip(shapes, log_scales)]
    for c in cs:
        n = np.linalg.norm(c)
        clipped = clip_tensor(c)
        if n <= 1:
            assert np.array_equal(clipped, c)
        else:  # one division per entry: 1e-15 relative, and the norm is 1 to a few ulps
            np.testing.assert_allclose(clipped, c / n, rtol=1e-15, atol=0)
            assert abs(np.linalg.norm(clipped) - 1) <= 1e-14
    joint = np.sqrt(sum(np.sum(c * c) for c in cs))
    for c, clipped in zip(cs, clip_global(cs)):
        np.testing.assert_allclose(clipped, c / max(1.0, joint), rtol=1e-15, atol=0)
    assert np.sqrt(sum(np.sum(c * c) for c in clip_global(cs))) <= 1 + 1e-14


@given(b1=unit, gamma=st.floats(0.0, 1.0), log_scale=st.floats(-3, 3), seed=seeds)
def test_mt4_oracle_first_corrected_gradient_is_one_plus_a_times_g(b1, gamma, log_scale, seed):
    g = np.random.default_rng(seed).normal(size=(3, 4)) * 10.0**log_scale
    a = correction_coefficient(gamma, b1)
    c1 = corrected_gradient(g, np.zeros_like(g), gamma, b1)
    np.testing.assert_allclose(c1, (1 + a) * g, rtol=1e-15, atol=0)  # g + a g: one rounding
    opt = MARSReference([np.ones((3, 4))], MARSConfig(betas=(b1, 0.99), gamma=gamma))
    opt.step([g])
    expected = (1 + a) * g / max(1.0, np.linalg.norm((1 + a) * g))
    np.testing.assert_allclose(opt.exp_avg[0] / (1 - b1), expected, rtol=1e-14, atol=0)


def test_default_first_corrected_gradient_is_1_475_g():
    g = np.full((2, 3), 0.01)
    np.testing.assert_allclose(corrected_gradient(g, 0 * g, 0.025, 0.95), 1.475 * g, rtol=1e-15)


# ------------------------------------------------------------------ MT6-MT8: g_prev

def test_mt6_oracle_last_grad_is_the_raw_gradient():
    """Approx mode stores g_t itself (spec B1, F1), not c or c~: ||g|| > 1, so c~ != g."""
    rng = np.random.default_rng(0)
    shapes = [(3, 4), (5,)]
    opt = MARSReference([rng.normal(size=s) for s in shapes], MARSConfig(gamma=0.5))
    for _ in range(3):
        grads = [rng.normal(size=s) * 5 for s in shapes]
        opt.step(grads)
        assert all(np.array_equal(last, g) for last, g in zip(opt.last_grad, grads))


def _oracle_problem(seed=0):
    rng = np.random.default_rng(seed)
    A = [rng.uniform(0.5, 2.0, size=(4, 3)) for _ in range(6)]
    B = [rng.normal(size=(4, 3)) for _ in range(6)]
    calls = []

    def grad(x, xi):
        calls.append((x[0].copy(), xi))
        return [A[xi] * x[0] - B[xi] + 0.1 * np.sin(x[0])]
    return grad, calls


@pytest.mark.parametrize("mars_type", ["mars-adamw", "mars-lion", "mars-shampoo"])
def test_mt7_oracle_exact_equals_approx_on_a_deterministic_loss(mars_type):
    grad, _ = _oracle_problem()
    runs = [mars_trajectory([np.ones((4, 3))], grad, [0] * 6,
                            MARSConfig(lr=1e-2, gamma=0.3, mars_type=mars_type, is_approx=mode))
            for mode in (False, True)]
    for t, (xe, xa) in enumerate(zip(*runs)):
        assert np.array_equal(xe[0], xa[0]), f"step {t}"  # grad f(x_{t-1}, xi) = g_{t-1} exactly


@pytest.mark.parametrize("is_approx", [True, False], ids=["approx", "exact"])
def test_mt8_oracle_trajectory_evaluates_the_new_batch_at_the_old_point(is_approx):
    """Exact mode (M1) evaluates grad f(x_{t-1}, xi_t) besides grad f(x_t, xi_t): one more
    forward+backward per step from step 2 on (P-MARS-exact-cost); approx mode one per step."""
    grad, calls = _oracle_problem()
    xs = mars_trajectory([np.ones((4, 3))], grad, list(range(6)),
                         MARSConfig(lr=1e-2, gamma=0.3, is_approx=is_approx))
    expected = [(xs[0][0], 0)]
    for t in range(1, 6):
        expected += [(xs[t][0], t)] if is_approx else [(xs[t][0], t), (xs[t - 1][0], t)]
    assert len(calls) == len(expected)
    assert sorted((xi, x.tobytes()) for x, xi in calls) == \
        sorted((xi, x.tobytes()) for x, xi in expected)


@pytest.mark.parametrize("is_approx", [True, False], ids=["approx", "exact"])
@given(b1=st.floats(0.5, 0.95), gamma=st.floats(0.05, 1.0), seed=seeds)
def test_oracle_step_corrects_with_the_previous_gradient(is_approx, b1, gamma, seed):
    """(M2) approx: c_t = g_t + a (g_t - g_{t-1}), g_0 = 0; (M1) exact, ``step(g_t, prev)``:
    c_t = g_t + a (g_t - prev_t) from step 2 on, c_1 = (1 + a) g_1 whatever is passed at
    step 1 (no clip, so c is read back from the momentum)."""
    rng = np.random.default_rng(seed)
    opt = MARSReference([rng.normal(size=(4, 3))], MARSConfig(
        betas=(b1, 0.99), gamma=gamma, is_approx=is_approx, clip_scope="none"))
    a, m_before, g_before = correction_coefficient(gamma, b1), np.zeros((4, 3)), np.zeros((4, 3))
    for t in range(4):
        g, prev = rng.normal(size=(4, 3)), rng.normal(size=(4, 3))
        opt.step([g], None if is_approx or t == 0 else [prev])
        c = (opt.exp_avg[0] - b1 * m_before) / (1 - b1)
        g_prev = g_before if is_approx else (prev if t else 0)
        # the recovery cancels b1 m: (1 + b1) / (1 - b1) ulps of entries O((1 + a) |g|)
        np.testing.assert_allclose(c, (1 + a) * g - a * g_prev, rtol=0,
                                   atol=1e-12 * (1 + a) * np.abs(g).max())
        m_before, g_before = opt.exp_avg[0].copy(), g


# ------------------------------------------------------------------ MT9, MT14: Lion, Shampoo

@given(lr=st.floats(1e-3, 1e-1), wd=st.floats(0.0, 1.0), seed=seeds)
def test_mt9_oracle_lion_moves_every_coordinate_by_exactly_lr(lr, wd, seed):
    rng = np.random.default_rng(seed)
    p, m = rng.uniform(-1, 1, size=(3, 4)), rng.normal(size=(3, 4))
    m[:, 0] = 0.0  # m_i = 0: the coordinate only decays
    step = lion_step(p, m, lr, wd) - p
    np.testing.assert_allclose(step, -lr * (np.sign(m) + wd * p), rtol=0, atol=1e-15)
    assert np.array_equal(lion_step(p, m, lr, 0.0)[:, 0], p[:, 0])
    # p - lr rounds once at |p| <= 1 + lr: 2.2e-16 / lr relative <= 2.2e-13
    np.testing.assert_allclose(np.abs(lion_step(p, m, lr, 0.0) - p)[:, 1:], lr, rtol=1e-12)


@pytest.mark.parametrize("shape", [(3, 5), (5, 3), (4, 4), (6, 2)])
@given(b1=unit, seed=seeds)
def test_mt14_oracle_shampoo_direction(shape, b1, seed):
    """svd: exactly s U V^T; Newton-Schulz: s NS(m, eps (1 - b1)) (the prescale is an eps
    rescaling), spectral norm <= P* s, m's singular vectors kept."""
    m = np.random.default_rng(seed).normal(size=shape)
    s = shape_scale(shape)
    assert s == max(1.0, shape[0] / shape[1]) ** 0.5
    np.testing.assert_allclose(shampoo_direction(m, b1, 1e-8, "svd"), s * orthogonalize_svd(m),
                               rtol=0, atol=1e-13)  # SVD backward error, a well-spread m
    eps = 1e-3  # large enough that a wrong placement would show
    u = shampoo_direction(m, b1, eps)
    np.testing.assert_allclose(u, s * newton_schulz(m, eps=eps * (1 - b1)), rtol=0, atol=1e-12)
    assert np.linalg.svd(u, compute_uv=False).max() <= P_STAR * s * (1 + 1e-12)
    U, _, Vt = np.linalg.svd(m, full_matrices=False)
    inner = U.T @ u @ Vt.T
    np.testing.assert_allclose(inner - np.diag(np.diag(inner)), 0, atol=1e-12)


# ------------------------------------------------------------------ MT16-MT18

@pytest.mark.parametrize("mars_type", ["mars-adamw", "mars-lion", "mars-shampoo"])
def test_mt16_oracle_zero_gradient_decays_by_the_factor(mars_type):
    lr, lr_1d, wd, wd_1d = 0.1, 0.05, 0.2, 0.3
    rng = np.random.default_rng(1)
    params = [rng.normal(size=(3, 4)), rng.normal(size=(3,))]
    opt = MARSReference(params, MARSConfig(lr=lr, lr_1d=lr_1d, weight_decay=wd,
                                           weight_decay_1d=wd_1d, mars_type=mars_type))
    for _ in range(3):
        before = [p.copy() for p in opt.params]
        after = opt.step([np.zeros((3, 4)), np.zeros(3)])
        # m = v = 0 and c = 0: the update is exactly 0, leaving one multiplication
        np.testing.assert_allclose(after[0], before[0] * (1 - lr * wd), rtol=4e-16, atol=0)
        np.testing.assert_allclose(after[1], before[1] * (1 - lr * (lr_1d / lr) * wd_1d),
                                   rtol=4e-16, atol=0)


@pytest.mark.parametrize("mars_type", ["mars-adamw", "mars-lion", "mars-shampoo"])
def test_mt17_oracle_lr_schedule_scales_2d_and_1d_updates(mars_type):
    """Changing ``lr`` between steps scales every update by lr / lr0, the 1-D ones through the
    constructor ratio r = lr_1d / lr0 (wd = 0: the moments do not depend on lr)."""
    rng = np.random.default_rng(0)
    shapes = [(4, 3), (4,), (2, 2, 1, 2)]
    x0 = [rng.normal(size=s) for s in shapes]
    cfg = dict(lr=1e-2, lr_1d=4e-3, weight_decay=0.0, weight_decay_1d=0.0, mars_type=mars_type)
    const, sched = MARSReference(x0, MARSConfig(**cfg)), MARSReference(x0, MARSConfig(**cfg))
    for t in range(6):
        grads = [rng.normal(size=s) for s in shapes]
        sched.lr = cfg["lr"] * 0.3 ** (t // 2)
        a0, b0 = [p.copy() for p in const.params], [p.copy() for p in sched.params]
        a1, b1 = const.step(grads), sched.step(grads)
        for p, p0, q, q0 in zip(a1, a0, b1, b0):
            # differences of O(1) iterates lose ~log10(1/step) digits: 1e-9 relative
            np.testing.assert_allclose(q - q0, sched.lr / cfg["lr"] * (p - p0), rtol=1e-9,
                                       atol=1e-15)


@given(b2=st.floats(0.0, 0.999), gamma=st.floats(0.0, 1.0), log_scales=st.lists(
    st.floats(-2, 2), min_size=6, max_size=6), seed=seeds)
def test_mt18_oracle_amsgrad_max_never_decreases(b2, gamma, log_scales, seed):
    rng = np.random.default_rng(seed)
    opt = MARSReference([rng.normal(size=(3, 4))], MARSConfig(betas=(0.9, b2), gamma=gamma,
                                                              amsgrad=True))
    previous = np.zeros((3, 4))
    for s in log_scales:
        opt.step([rng.normal(size=(3, 4)) * 10.0**s])
        assert np.all(opt.max_exp_avg_sq[0] >= previous)
        assert np.all(opt.max_exp_avg_sq[0] >= opt.exp_avg_sq[0])
        previous = opt.max_exp_avg_sq[0].copy()
