"""Exact mode (M1, MARS.md 2.7): MT7, MT8, the closure protocol and its random-number handling.

Exact mode needs grad f(x_{t-1}, xi_t), the *current* batch at the *previous* iterate; the port
gets it by re-running the step's closure at x_{t-1} (restoring the RNG so that dropout-like
randomness is the same sample) before evaluating it at x_t.
"""
import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from theory_tests.support.mars_harness import batches, initial_params, run_torch, torch_loss
from theory_tests.support.mars_property_helpers import F64, MARS_TYPES, make_params
from reference.mars.mars_equations import correction_coefficient
from torch_impl import MARS

N_STEPS = 6


def _trajectory(is_approx, mars_type, xis, foreach=False):
    xs, _, _ = run_torch(lambda ps: MARS(ps, lr=1e-2, gamma=0.3, is_approx=is_approx,
                                         mars_type=mars_type, foreach=foreach, ns_dtype=F64),
                         initial_params(), xis)
    return xs


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("mars_type", MARS_TYPES)
def test_mt7_exact_equals_approx_on_a_deterministic_loss(mars_type, foreach):
    """The same batch every step: grad f(x_{t-1}, xi) = g_{t-1}, recomputed bit for bit."""
    xis = batches(1) * N_STEPS
    exact, approx = (_trajectory(mode, mars_type, xis, foreach) for mode in (False, True))
    for t, (xe, xa) in enumerate(zip(exact, approx)):
        assert all(np.array_equal(a, b) for a, b in zip(xe, xa)), f"step {t}"


@pytest.mark.parametrize("mars_type", MARS_TYPES)
def test_exact_and_approx_differ_on_a_stochastic_loss(mars_type):
    """Fresh batches: the modes agree at step 1 (g_prev = 0 in both) and then part ways."""
    exact, approx = (_trajectory(mode, mars_type, batches(N_STEPS)) for mode in (False, True))
    assert all(np.array_equal(a, b) for a, b in zip(exact[1], approx[1]))
    assert not all(np.array_equal(a, b) for a, b in zip(exact[-1], approx[-1]))


# ------------------------------------------------------------------ MT8: hand computation

def _quadratic_batch(rng, n, k):
    """f(X; xi) = 1/2 tr(X^T A X) - tr(B^T X), A symmetric positive definite: grad = A X - B."""
    Q = rng.normal(size=(n, n))
    return torch.tensor(Q @ Q.T / n + np.eye(n)), torch.tensor(rng.normal(size=(n, k)))


def _quadratic_loss(X, A, B):
    return 0.5 * torch.sum(X * (A @ X)) - torch.sum(B * X)


@given(b1=st.floats(0.5, 0.95), gamma=st.floats(0.05, 1.0), seed=st.integers(0, 2**32 - 1))
def test_mt8_exact_correction_uses_the_new_batch_at_the_old_point(b1, gamma, seed):
    rng = np.random.default_rng(seed)
    X = make_params([(4, 3)], seed)[0]
    opt = MARS([X], lr=5e-2, betas=(b1, 0.99), gamma=gamma, is_approx=False, clip_scope="none")
    a = correction_coefficient(gamma, b1)
    xs, ms, data = [X.detach().clone()], [torch.zeros(4, 3, dtype=F64)], []
    for t in range(3):
        A, B = _quadratic_batch(rng, 4, 3)
        data.append((A, B))

        def closure(A=A, B=B):
            opt.zero_grad()
            loss = _quadratic_loss(X, A, B)
            loss.backward()
            return loss
        opt.step(closure)
        xs.append(X.detach().clone())
        ms.append(opt.state[X]["exp_avg"].clone())
    for t in (1, 2):  # steps 2 and 3 (0-based t): the correction needs x_{t-1} and batch t
        A, B = data[t]
        g_now, g_old = A @ xs[t] - B, A @ xs[t - 1] - B
        expected = g_now + a * (g_now - g_old)
        got = (ms[t + 1] - b1 * ms[t]) / (1 - b1)  # c_t from (M4), no clip
        # entries O((1 + a) |g|); the recovery cancels b1 m: (1 + b1)/(1 - b1) ulps -> 1e-12
        scale = (1 + a) * expected.abs().max()
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12 * scale)
        A_prev, B_prev = data[t - 1]  # approx would have used the previous batch's gradient
        approx = g_now + a * (g_now - (A_prev @ xs[t - 1] - B_prev))
        assert not torch.allclose(got, approx, rtol=1e-6, atol=0)


def test_exact_mode_without_closure_raises():
    p = make_params([(3, 3)])[0]
    opt = MARS([p], is_approx=False)
    p.grad = torch.ones_like(p)
    with pytest.raises((RuntimeError, ValueError), match="closure"):
        opt.step()


@pytest.mark.parametrize("is_approx", [True, False], ids=["approx", "exact"])
def test_closure_evaluations_per_step(is_approx):
    """Exact: once at step 1 (no x_0 yet), then twice per step; approx: once per step."""
    params = [torch.nn.Parameter(torch.tensor(x)) for x in initial_params()]
    opt = MARS(params, is_approx=is_approx)
    xi, calls = batches(1)[0], []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = torch_loss(params, xi)
        loss.backward()
        return loss
    for t in range(1, 5):
        before = len(calls)
        loss = opt.step(closure)
        assert len(calls) - before == (1 if is_approx or t == 1 else 2)
        assert torch.is_tensor(loss)  # step returns the closure's loss (at x_t)


def _noisy_run(is_approx, n_steps=4, seed=123):
    """A dropout-like loss: noise = torch.rand(...) inside the closure; records every draw."""
    torch.manual_seed(seed)
    X = make_params([(3, 4)], 7)[0]
    opt = MARS([X], lr=1e-2, gamma=0.5, is_approx=is_approx)
    draws = []

    def closure():
        opt.zero_grad()
        noise = torch.rand(3, 4, dtype=F64)
        draws.append((noise, X.detach().clone()))
        loss = torch.sum((X - noise) ** 2)
        loss.backward()
        return loss
    per_step = []
    for _ in range(n_steps):
        start = len(draws)
        opt.step(closure)
        per_step.append(draws[start:])
    return per_step, opt, X


def test_exact_mode_reuses_the_random_sample_at_both_points():
    exact, opt, X = _noisy_run(False)
    approx, _, _ = _noisy_run(True)
    for t, evals in enumerate(exact):
        if t == 0:
            assert len(evals) == 1
            continue
        (noise_old, x_old), (noise_now, x_now) = evals
        assert torch.equal(noise_old, noise_now)  # the same xi_t at x_{t-1} and x_t
        assert not torch.equal(x_old, x_now)      # ... at two different points
        assert torch.equal(x_old, exact[t - 1][-1][1])  # x_{t-1} is the previous step's point
    # the RNG advances by one sample per step, as without exact mode
    for e, a in zip(exact, approx):
        assert torch.equal(e[-1][0], a[0][0])
    assert not torch.equal(exact[1][-1][0], exact[2][-1][0])
