"""MARS with bf16/fp16 parameters, and the proof that a step never synchronises with the device
(by construction on CPU, with CUDA's sync debug mode when a GPU is present)."""
import numpy as np
import pytest
import torch

from theory_tests.support.mars_property_helpers import MARS_TYPES, closure_for, feed, make_params, spy_on_scalar_reads
from torch_impl import MARS


# ------------------------------------------------------------------ low precision

# Against a float32 run of the same gradients, 5 steps of lr 1e-2:
# bf16 params: a rounding of up to half an ulp (2^-6 at |p| < 4) per step, plus a possible sign
#   flip of a near-zero Lion momentum (2 lr): 0.1; state (relative to its max): unit roundoff
#   2^-8 over ~5 accumulated roundings, measured 2e-2: 5e-2.
# fp16: ulp 2^-8 at |p| < 4 -> 0.03 (with the Lion flip); state 2^-11 x 5, measured 2.4e-3: 6e-3.
LOW = {torch.bfloat16: (0.1, 5e-2), torch.float16: (0.03, 6e-3)}


@pytest.mark.parametrize("dtype", list(LOW), ids=["bf16", "fp16"])
@pytest.mark.parametrize("mars_type", MARS_TYPES)
def test_low_precision_params(mars_type, dtype, device):
    shapes = [(4, 3), (3,), (2, 5)]
    rng = np.random.default_rng(0)
    # entries bounded away from 0, so that (1 - beta2) c~^2 stays above fp16's underflow
    # (an fp16 property shared with torch AdamW, not a MARS one)
    seq = [[torch.tensor(rng.choice([-3.0, 3.0], size=s) * rng.uniform(0.5, 1.0, size=s))
            for s in shapes] for _ in range(5)]
    runs = {}
    for d in (torch.float32, dtype):
        params = [torch.nn.Parameter(p.detach().to(device, d)) for p in make_params(shapes, 3)]
        opt = MARS(params, lr=1e-2, mars_type=mars_type)
        for grads in seq:
            feed(opt, params, [g.to(device) for g in grads])
        runs[d] = params, opt
    param_tol, state_tol = LOW[dtype]
    for p32, p in zip(runs[torch.float32][0], runs[dtype][0]):
        assert p.dtype == dtype and torch.isfinite(p).all()
        torch.testing.assert_close(p.float(), p32, rtol=0, atol=param_tol)
        for key, value in runs[dtype][1].state[p].items():
            if key == "step":
                continue
            ref = runs[torch.float32][1].state[p32][key]
            assert value.dtype == dtype and torch.isfinite(value).all(), key
            assert (value.float() - ref).abs().max() <= state_tol * ref.abs().max(), key


# ------------------------------------------------------------------ no host synchronisation

def _sync_problem(params):
    x = torch.linspace(-1, 1, params[1].shape[1], dtype=params[0].dtype, device=params[0].device)
    return lambda ps: (ps[0] @ (ps[1] @ x) + ps[2]).square().sum()


@pytest.mark.parametrize("is_approx", [True, False], ids=["approx", "exact"])
@pytest.mark.parametrize("clip_scope", ["tensor", "global"])
@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("mars_type", MARS_TYPES)
def test_step_reads_only_cpu_step_counters(mars_type, foreach, clip_scope, is_approx, monkeypatch):
    """Record every tensor-to-Python read during step(): each must be a state['step'] counter
    (a 0-d CPU tensor), never a norm, a parameter or anything on the parameters' device."""
    params = make_params([(4, 3), (3, 5), (4,)])
    opt = MARS(params, mars_type=mars_type, foreach=foreach, clip_scope=clip_scope, gamma=0.2,
               is_approx=is_approx)
    closure = closure_for(opt, params, _sync_problem(params))
    opt.step(closure)  # creates the state
    reads = spy_on_scalar_reads(monkeypatch)
    for _ in range(2):
        opt.step(closure)
    monkeypatch.undo()
    counters = [opt.state[p]["step"] for p in params]
    assert reads, "the spy saw nothing: the patch did not take"
    assert all(any(r is c for c in counters) for r in reads)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device present")
@pytest.mark.parametrize("is_approx", [True, False], ids=["approx", "exact"])
@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("mars_type", MARS_TYPES)
def test_step_is_sync_free_on_cuda(mars_type, foreach, is_approx):
    """The default orthogonalizer (Newton-Schulz); cuSOLVER's SVD is not claimed sync-free."""
    params = [torch.nn.Parameter(p.detach().cuda()) for p in make_params([(4, 3), (3, 5), (4,)])]
    opt = MARS(params, mars_type=mars_type, foreach=foreach, is_approx=is_approx,
               clip_scope="global" if foreach else "tensor")
    closure = closure_for(opt, params, _sync_problem(params))
    opt.step(closure)  # the first step allocates state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            opt.step(closure)
    finally:
        torch.cuda.set_sync_debug_mode("default")
