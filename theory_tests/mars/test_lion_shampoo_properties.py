"""Properties of the MARS-Lion (MT9) and MARS-Shampoo (MT14) updates, checked on torch_impl.MARS
against the closed forms of spec MARS.md section 7."""
import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from theory_tests.support.mars_property_helpers import P_STAR, F64, feed, make_params, random_grads, \
    snapshot, steps
from reference.common.matrix_functions import newton_schulz as ns_ref, orthogonalize_svd as svd_ref
from torch_impl import MARS

seeds = st.integers(0, 2**32 - 1)
shape2d = st.tuples(st.integers(1, 4), st.integers(1, 4))
unit = st.floats(0.0, 0.95)


# ------------------------------------------------------------------ MT9: MARS-Lion

@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@given(lr=st.floats(1e-3, 1e-1), b1=unit, gamma=st.floats(0.0, 1.0), shape=shape2d,
       log_scale=st.floats(-3, 3), seed=seeds)
def test_mt9_lion_moves_every_coordinate_by_exactly_lr(foreach, lr, b1, gamma, shape, log_scale,
                                                       seed):
    rng = np.random.default_rng(seed)
    params = make_params([shape], seed, bound=1.0)
    opt = MARS(params, lr=lr, betas=(b1, 0.99), gamma=gamma, mars_type="mars-lion",
               foreach=foreach)
    for _ in range(4):
        g = random_grads(rng, [shape], scale=10.0**log_scale)[0]
        g[:, 0] = 0.0  # a coordinate with m = 0 throughout: it must not move
        before = snapshot(params)[0]
        feed(opt, params, [g])
        step = params[0] - before
        assert torch.all(step[:, 0] == 0)
        moved = opt.state[params[0]]["exp_avg"] != 0
        # p - lr rounds once at |p| <= 1 + 4 lr: error <= 2.2e-16 / lr relative <= 2.2e-13
        torch.testing.assert_close(step.abs()[moved], torch.full_like(step[moved], lr),
                                   rtol=1e-12, atol=0)
        m = opt.state[params[0]]["exp_avg"]
        assert torch.equal(torch.sign(step[moved]), -torch.sign(m[moved]))


@given(lr=st.floats(1e-3, 1e-1), wd=st.floats(0.0, 1.0), seed=seeds)
def test_mt9_lion_with_weight_decay(lr, wd, seed):
    rng = np.random.default_rng(seed)
    params = make_params([(3, 4)], seed)
    opt = MARS(params, lr=lr, weight_decay=wd, mars_type="mars-lion")
    for _ in range(3):
        before = snapshot(params)[0]
        feed(opt, params, random_grads(rng, [(3, 4)]))
        m = opt.state[params[0]]["exp_avg"]
        expected = -lr * (torch.sign(m) + wd * before)
        # O(1) iterates differenced to an O(lr) step: 1e-13 absolute
        torch.testing.assert_close(params[0] - before, expected, rtol=0, atol=1e-13)


@pytest.mark.parametrize("log_scale", [-7, 7], ids=["never-clips", "always-clips"])
@pytest.mark.parametrize("k", [0.25, 0.5, 2.0, 4.0])
def test_mt9_lion_is_invariant_to_gradient_scale_when_the_clip_is_all_or_nothing(log_scale, k):
    """Powers of two scale every rounding exactly, so the runs are bit-identical."""
    rng = np.random.default_rng(3)
    seq = [random_grads(rng, [(3, 4)], scale=10.0**log_scale) for _ in range(6)]
    runs = []
    for factor in (1.0, k):
        params = make_params([(3, 4)])
        steps(MARS(params, lr=1e-2, gamma=0.3, mars_type="mars-lion"), params,
              [[g[0] * factor] for g in seq])
        runs.append(params[0])
    assert torch.equal(*runs)


# ------------------------------------------------------------------ MT14: MARS-Shampoo

shampoo_shapes = st.sampled_from([(3, 5), (5, 3), (4, 4), (6, 2)])


def _shampoo_step(shape, orthogonalizer, b1, lr, seed, n_steps, eps=1e-8, ns_dtype=F64):
    rng = np.random.default_rng(seed)
    params = make_params([shape], seed)
    opt = MARS(params, lr=lr, betas=(b1, 0.99), eps=eps, weight_decay=0.0, gamma=0.1,
               mars_type="mars-shampoo", orthogonalizer=orthogonalizer, ns_dtype=ns_dtype)
    for _ in range(n_steps):
        before = snapshot(params)[0]
        feed(opt, params, random_grads(rng, [shape]))
    m = opt.state[params[0]]["exp_avg"].numpy()
    return (params[0] - before).detach().numpy(), m, max(1.0, shape[0] / shape[1]) ** 0.5


@given(shape=shampoo_shapes, b1=unit, lr=st.floats(1e-3, 1e-1), n=st.integers(1, 4), seed=seeds)
def test_mt14_shampoo_svd_step_is_lr_s_u_vt(shape, b1, lr, n, seed):
    delta, m, s = _shampoo_step(shape, "svd", b1, lr, seed, n)
    # U V^T of m itself (no 1/(1-b1) prescale): the prescale changes nothing.  Differences of
    # O(1) iterates to an O(lr) step: 1e-13 absolute.
    np.testing.assert_allclose(delta, -lr * s * svd_ref(m), rtol=0, atol=1e-13)
    np.testing.assert_allclose(np.linalg.svd(delta, compute_uv=False), lr * s, rtol=1e-10)


@pytest.mark.parametrize("ns_dtype", [F64, torch.bfloat16], ids=["f64", "bf16"])
@given(shape=shampoo_shapes, b1=unit, lr=st.floats(1e-3, 1e-1), n=st.integers(1, 4), seed=seeds)
def test_mt14_shampoo_newton_schulz_step(ns_dtype, shape, b1, lr, n, seed):
    delta, m, s = _shampoo_step(shape, "newton_schulz", b1, lr, seed, n, eps=0.0,
                                ns_dtype=ns_dtype)
    spectral = np.linalg.svd(delta, compute_uv=False).max()
    U, _, Vt = np.linalg.svd(m, full_matrices=False)
    inner = U.T @ delta @ Vt.T  # m's singular vectors are kept: diagonal
    if ns_dtype == F64:
        # with eps = 0 the prescale is a pure scale: NS(m / (1 - b1)) = NS(m) to rounding
        # (1e-12, test_newton_schulz), times lr s, plus the step's differencing (1e-13)
        np.testing.assert_allclose(delta, -lr * s * ns_ref(m, eps=0.0), rtol=0, atol=1e-12)
        assert spectral <= P_STAR * lr * s * (1 + 1e-12)
        np.testing.assert_allclose(inner - np.diag(np.diag(inner)), 0, atol=1e-12)
    else:  # bf16 iteration: the 3e-2 excess derived in test_newton_schulz (BF16_EXCESS)
        assert spectral <= (P_STAR + 3e-2) * lr * s


@given(shape=shampoo_shapes, b1=unit, seed=seeds)
def test_mt14_prescale_with_eps_is_an_eps_rescaling(shape, b1, seed):
    """NS(m / (1 - b1), eps) = NS(m, eps (1 - b1)) exactly in real arithmetic."""
    eps = 1e-3  # large enough that a wrong placement would show
    delta, m, s = _shampoo_step(shape, "newton_schulz", b1, 1e-2, seed, 2, eps=eps)
    np.testing.assert_allclose(delta, -1e-2 * s * ns_ref(m, eps=eps * (1 - b1)), rtol=0,
                               atol=1e-13)  # ulp-level NS (1e-12) times lr
