"""Differential tests: ``torch_impl.MARSM`` against the NumPy float64 oracle ``reference.mars.mars_m``.

The stochastic problem of ``mars_harness`` (a 1-D, two 2-D and a 4-D tensor, batch-dependent
weights, per-tensor scales so that the clip fires on some tensors only).  2-D tensors take the
MARS-M rule, the others the AdamW backup.  Newton-Schulz runs in float64 for the float64
comparison, in float32 for the float32 one, and in bf16 (the default) against the oracle with
the bf16 precision's tolerance.
"""
import itertools

import numpy as np
import pytest
import torch

from theory_tests.support.mars_harness import SHAPES, batches, grad_oracle, initial_params, run_torch, torch_loss
from reference.mars.mars_m import MARSMConfig, mars_m_trajectory
from torch_impl import MARSM

RULES = ["mars_m" if len(s) == 2 else "adamw" for s in SHAPES]
N_STEPS = 12
CASES = {
    "approx": {},
    "no-clip": dict(clip_c=False),
    "gamma-0.3": dict(gamma=0.3, weight_decay=0.02),
    "efficient": dict(efficient=True, clip_c=False),
    "exact": dict(is_approx=False),
    "exact-no-clip": dict(is_approx=False, clip_c=False, momentum=0.9),
}


def _reference(kw):
    config = MARSMConfig(lr=0.03, **kw)
    return mars_m_trajectory(initial_params(), RULES, grad_oracle, batches(N_STEPS), config)


def _torch(kw, dtype, ns_dtype, foreach):
    def factory(params):
        return MARSM(params, lr=0.03, ns_dtype=ns_dtype, foreach=foreach, **kw)
    xs, _, _ = run_torch(factory, initial_params(), batches(N_STEPS), dtype=dtype)
    return xs


def _max_error(xs, ref):
    return max(np.abs(a - b).max() for xa, xb in zip(xs, ref) for a, b in zip(xa, xb))


# float64 end to end: the two sides differ only in rounding (lerp vs beta m + (1-beta) c, the
# fused addmm form of Newton-Schulz); measured <= 4.5e-16 over 12 steps (iterates O(1)).
@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("case", list(CASES))
def test_float64_matches_reference(case, foreach):
    err = _max_error(_torch(CASES[case], torch.float64, torch.float64, foreach),
                     _reference(CASES[case]))
    assert err < 1e-12, err


# float32 state and float32 Newton-Schulz: ~1e-7 relative per step, compounded through NS
# (a Lipschitz constant of a few) over 12 steps; measured <= 1.3e-6 on O(1) iterates.
@pytest.mark.parametrize("case", ["approx", "efficient", "exact"])
def test_float32_matches_reference(case):
    err = _max_error(_torch(CASES[case], torch.float32, torch.float32, False),
                     _reference(CASES[case]))
    assert err < 1e-5, err


def test_bfloat16_newton_schulz_within_its_precision():
    """The default (bf16 NS, as the authors): each update is NS's output (entries <= ~1.2)
    times lr 0.2 sqrt(max(A, B)) ~ 0.03; bf16's 2^-8 relative error on it, over 12 steps and
    the trajectories' divergence, stays below 1e-2 (measured 1.3e-3 against a total movement of
    0.42) -- and well above the float64 agreement."""
    err = _max_error(_torch({}, torch.float64, torch.bfloat16, False), _reference({}))
    assert 1e-6 < err < 1e-2, err


def test_exact_mode_differs_from_approx_and_clip_matters():
    """The comparison can fail: exact against approx, clip against no clip, differ."""
    ref = {case: _reference(kw) for case, kw in CASES.items()}
    assert _max_error(ref["exact"], ref["approx"]) > 1e-3
    assert _max_error(ref["no-clip"], ref["approx"]) > 1e-3
    assert _max_error(ref["efficient"], ref["no-clip"]) < 1e-12  # (M18): the same iterates


@pytest.mark.parametrize("maximize", [False, True], ids=["minimize", "maximize"])
@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
def test_authors_exact_loop_equals_closure_exact_mode(foreach, maximize):
    """``train_mars.py``'s scheme: grad on the *next* batch at x_t, ``update_previous_grad``,
    zero_grad, grad on the current batch, ``step()``, zero_grad, ``update_last_grad``.  It
    gives the same iterates as the closure form and the oracle's exact mode (bit for bit
    against the closure: both feed last_grad = grad f(x_{t-1}, xi_t)).  With ``maximize`` the
    loop runs on -f and must be the minimizing run on f bit for bit (negation is exact)."""
    kw = dict(CASES["exact"], lr=0.03, ns_dtype=torch.float64, foreach=foreach, maximize=maximize)
    sign = -1.0 if maximize else 1.0
    xis = batches(N_STEPS + 1)
    params = [torch.nn.Parameter(torch.tensor(x)) for x in initial_params()]
    opt = MARSM(params, **kw)
    xs = [[p.detach().numpy().copy() for p in params]]
    for t in range(N_STEPS):
        (sign * torch_loss(params, xis[t + 1])).backward()  # the next batch at x_t
        opt.update_previous_grad()
        opt.zero_grad(set_to_none=True)
        (sign * torch_loss(params, xis[t])).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        opt.update_last_grad()
        xs.append([p.detach().numpy().copy() for p in params])
    closure_xs = _torch(CASES["exact"], torch.float64, torch.float64, foreach)
    assert _max_error(xs, closure_xs) == 0.0
    assert _max_error(xs, _reference(CASES["exact"])) < 1e-12


def test_exact_mode_without_closure_or_authors_api_raises():
    params = [torch.nn.Parameter(torch.tensor(x)) for x in initial_params()]
    opt = MARSM(params, is_approx=False)
    torch_loss(params, batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match="closure"):
        opt.step()


@pytest.mark.parametrize("gamma,momentum", list(itertools.product([0.0, 0.025, 0.5], [0.9, 0.95])))
def test_efficient_torch_equals_unclipped_torch(gamma, momentum):
    """(M18) numerically, on the torch side: MARS_M_Efficient's recursion and the unclipped
    MARS-M momentum give the same iterates (float64 NS), to a few ulps of the iterates."""
    kw = dict(gamma=gamma, momentum=momentum, clip_c=False)
    a = _torch(dict(kw, efficient=True), torch.float64, torch.float64, False)
    b = _torch(kw, torch.float64, torch.float64, False)
    assert _max_error(a, b) < 1e-12
