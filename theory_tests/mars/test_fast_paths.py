"""The fast paths of MARS against its single-tensor path, and the memory promises.

* ``compiled=True`` (one torch.compile'd kernel per tensor) equals the single-tensor path in
  float64 on CPU, and in float32 on CUDA when present; it compiles once, then never again
  (schedules and step counts enter as tensors, lengths are dynamic).
* Approx-mode MARS-AdamW keeps exactly three parameter-sized buffers per matrix, and a step's
  temporaries never exceed one parameter-sized buffer per tensor (measured at the dispatcher).
"""
import pytest
import torch
import torch._dynamo

from theory_tests.support.mars_property_helpers import clone_params, feed, make_params
from torch_impl import MARS
from figures.bench.step_memory import StepMemory

SHAPES = [(6, 5), (7,), (3, 2, 2), (4, 9), (0, 3)]


def _grads(step, dtype, device):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen, dtype=dtype).mul_(0.7).to(device) for s in SHAPES]


def _run_pair(kw, steps=6, dtype=torch.float64, device="cpu", mode=True):
    base = [torch.nn.Parameter(p.detach().to(device)) for p in make_params(SHAPES, 4, dtype)]
    a, b = base, clone_params(base)
    opt_a = MARS(a, foreach=False, **kw)
    opt_b = MARS(b, compiled=mode, **kw)
    for t in range(steps):
        grads = _grads(t, dtype, device)
        feed(opt_a, a, grads)
        feed(opt_b, b, grads)
    return (a, opt_a), (b, opt_b)


def _assert_close_runs(run_a, run_b, rtol, atol):
    (a, opt_a), (b, opt_b) = run_a, run_b
    for p, q in zip(a, b):
        torch.testing.assert_close(q, p, rtol=rtol, atol=atol)
        for key, value in opt_a.state[p].items():
            torch.testing.assert_close(opt_b.state[q][key], value, rtol=rtol, atol=atol)


# float64: Inductor may reassociate the elementwise arithmetic (e.g. fold lr / bc1 before the
# division), a few ulps per step; over 6 steps of O(1) quantities 1e-13 relative is ample.
@pytest.mark.parametrize("mode", [True, "group"])
@pytest.mark.parametrize("mars_type", ["mars-adamw", "mars-lion"])
def test_compiled_equals_single_tensor_float64(mars_type, mode):
    kw = dict(lr=1e-2, weight_decay=0.1, gamma=0.3, mars_type=mars_type)
    _assert_close_runs(*_run_pair(kw, mode=mode), rtol=1e-13, atol=1e-15)


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(clip_scope="global"), dict(amsgrad=True)], ids=["global", "amsgrad"])
def test_group_compiled_equals_single_tensor_with_options(kw):
    _assert_close_runs(*_run_pair(dict(lr=1e-2, gamma=0.3, **kw), mode="group"),
                       rtol=1e-13, atol=1e-15)


def test_compiled_mode_is_validated():
    with pytest.raises(ValueError, match="compiled"):
        MARS(make_params([(2, 2)]), compiled="fused")


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(clip_scope="global"), dict(clip_scope="none"),
                                dict(amsgrad=True), dict(maximize=True),
                                dict(weight_decay_1d_source="group", weight_decay=0.2),
                                dict(mars_type="mars-shampoo", ns_dtype=torch.float64),
                                dict(optimize_1d=True, mars_type="mars-lion")],
                         ids=["global", "none", "amsgrad", "maximize", "wd1d-group",
                              "shampoo", "opt1d-lion"])
def test_compiled_equals_single_tensor_every_option(kw):
    _assert_close_runs(*_run_pair(dict(lr=1e-2, gamma=0.3, **kw)), rtol=1e-13, atol=1e-15)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device present")
def test_compiled_equals_single_tensor_float32_cuda():
    # float32 on CUDA: FMA contraction and reassociation, ~1e-6 relative per step
    kw = dict(lr=1e-2, weight_decay=0.1, gamma=0.3)
    _assert_close_runs(*_run_pair(kw, dtype=torch.float32, device="cuda"), rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device present")
@pytest.mark.parametrize("clip_scope", ["tensor", "global"])
def test_compiled_step_never_synchronises_on_cuda(clip_scope):
    params = [torch.nn.Parameter(p.detach().cuda()) for p in make_params(SHAPES, 5, torch.float32)]
    opt = MARS(params, compiled=True, clip_scope=clip_scope, weight_decay=0.1)
    feed(opt, params, _grads(0, torch.float32, "cuda"))  # compile outside the checked region
    grads = _grads(1, torch.float32, "cuda")
    for p, g in zip(params, grads):
        p.grad = g
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("mode", [True, "group"])
def test_compiled_never_recompiles_after_the_first_step(mode):
    params = make_params([(8, 4), (16, 3), (5,), (2, 3, 4)], seed=1, dtype=torch.float32)
    opt = MARS(params, compiled=mode, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    feed(opt, params, [torch.randn(p.shape) for p in params])  # compiles here
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(5):  # new lr, new step count, other shapes: no new compilation
            feed(opt, params, [torch.randn(p.shape) for p in params])
            schedule.step()


# ---------------------------------------------------------------- memory

def _step_temporaries(opt_factory, shapes):
    params = make_params(shapes, 2, torch.float32)
    opt = opt_factory(params)
    feed(opt, params, [torch.randn(p.shape) for p in params])  # state exists before measuring
    for p in params:
        p.grad = torch.randn(p.shape)
    with StepMemory() as mem:
        opt.step()
    return mem.peak_bytes, params, opt


MEMORY_SHAPES = [(64, 32), (128,), (32, 4, 3, 3), (48, 16)]


def test_single_tensor_step_temporaries_at_most_one_parameter_buffer():
    """The loop path holds one temporary (the Adam denominator) at a time: the peak is the
    largest parameter's size (the 0-d clip norm adds 4 bytes)."""
    peak, params, _ = _step_temporaries(lambda ps: MARS(ps, foreach=False), MEMORY_SHAPES)
    largest = max(p.numel() * p.element_size() for p in params)
    assert peak <= largest + 64, (peak, largest)


def test_foreach_step_temporaries_at_most_one_buffer_per_tensor():
    peak, params, _ = _step_temporaries(lambda ps: MARS(ps, foreach=True), MEMORY_SHAPES)
    total = sum(p.numel() * p.element_size() for p in params)
    assert peak <= total + 64 * len(params), (peak, total)


def test_approx_mars_adamw_state_is_three_parameter_buffers():
    """m, v and g_prev for every matrix (the 1-D fallback keeps m and v only): 12 bytes per
    fp32 matrix entry, against AdamW's 8."""
    _, params, opt = _step_temporaries(lambda ps: MARS(ps), [(64, 32), (48, 16)])
    for p in params:
        buffers = [t for t in opt.state[p].values() if t.numel() == p.numel()]
        assert len(buffers) == 3 and all(t.shape == p.shape for t in buffers)
