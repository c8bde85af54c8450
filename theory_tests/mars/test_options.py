"""MARS options and edge cases beyond the official class: state_dtype, per-group 1-D
hyperparameters, a gamma schedule, late-joining parameters in exact mode, complex
parameters, the default correction coefficient, and the class docstring's example."""
import copy
import doctest

import numpy as np
import pytest
import torch

import torch_impl.mars.mars
from theory_tests.support.mars_property_helpers import clone_params, closure_for, feed, make_params, snapshot
from reference.mars.mars import MARSConfig, MARSReference
from torch_impl import MARS


def test_default_first_step_is_1_475_g():
    """Defaults gamma=0.025, beta1=0.95: a = 0.475 and c_1 = 1.475 g_1 (spec 1, MT4); with no
    clip, m_1 = (1 - beta1) c_1 exactly up to one rounding."""
    (p,) = make_params([(3, 4)])
    g = torch.full((3, 4), 0.01, dtype=torch.float64)
    opt = MARS([p], clip_scope="none")
    feed(opt, [p], [g])
    torch.testing.assert_close(opt.state[p]["exp_avg"] / 0.05, 1.475 * g, rtol=1e-14, atol=0)


def test_group_lr_1d_and_weight_decay_1d_stay_per_group():
    """Spec B5: the official weight_decay_1d ignores param groups.  Here a group's own lr_1d
    and weight_decay_1d act on that group only (g = 0 isolates the decay: p(1 - lr r wd1d))."""
    a, b = make_params([(5,), (5,)])
    a0, b0 = snapshot([a, b])
    opt = MARS([{"params": [a], "lr": 0.1, "lr_1d": 0.05, "weight_decay_1d": 0.2},
                {"params": [b]}], lr=0.01, lr_1d=0.01, weight_decay_1d=0.1)
    feed(opt, [a, b], [torch.zeros(5, dtype=torch.float64)] * 2)
    torch.testing.assert_close(a, a0 * (1 - 0.1 * 0.5 * 0.2), rtol=1e-15, atol=0)
    torch.testing.assert_close(b, b0 * (1 - 0.01 * 1.0 * 0.1), rtol=1e-15, atol=0)
    with pytest.raises(ValueError, match="lr_1d"):
        MARS([{"params": [a], "lr": 0.0, "lr_1d": 0.1}])


def test_gamma_schedule_is_read_every_step():
    """group['gamma'] changed between steps equals the oracle with the same schedule (the
    paper's gamma_t): the correction uses each step's own gamma."""
    gammas, rng = [0.0, 0.5, 0.1, 0.9, 0.025], np.random.default_rng(3)
    grads = [rng.normal(size=(4, 3)) * 0.3 for _ in gammas]
    x0 = rng.normal(size=(4, 3))
    ref = MARSReference([x0], MARSConfig(lr=1e-2, clip_scope="none", mars_type="mars-adamw"))
    p = torch.nn.Parameter(torch.tensor(x0))
    opt = MARS([p], lr=1e-2, clip_scope="none")
    for gamma, g in zip(gammas, grads):
        ref.config.gamma = gamma
        opt.param_groups[0]["gamma"] = gamma
        (expected,) = ref.step([g])
        feed(opt, [p], [torch.tensor(g)])
        np.testing.assert_allclose(p.detach().numpy(), expected, rtol=1e-13, atol=1e-15)


def test_exact_mode_parameter_joining_late_starts_like_step_one():
    """Spec B4: a parameter whose first gradient arrives at step 3 in exact mode must not
    fail; it starts with last_grad = 0 (c_1 = (1 + a) g, here unclipped) like any step 1."""
    w, late = make_params([(3, 3), (2, 2)])
    x = torch.randn(3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    opt = MARS([w, late], lr=1e-2, is_approx=False, clip_scope="none", gamma=0.2)
    for t in range(4):
        use_late = t >= 2
        loss_fn = (lambda ps: (ps[0] @ x).square().sum() + (ps[1].square().sum() if use_late else 0))
        opt.step(closure_for(opt, [w, late], loss_fn))
        if t == 2:  # first step of `late`: m = (1 - beta1)(1 + a) g with g = 2 late_before
            a = 0.2 * 0.95 / 0.05
            g = 2 * opt.state[late]["prev_param"]
            torch.testing.assert_close(opt.state[late]["exp_avg"], 0.05 * (1 + a) * g,
                                       rtol=1e-14, atol=0)
    assert opt.state[late]["step"].item() == 2


def test_complex_parameters_raise_and_change_nothing():
    real, cplx = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2, dtype=torch.cfloat))
    opt = MARS([real, cplx])
    real.grad, cplx.grad = torch.ones(2, 2), torch.ones(2, dtype=torch.cfloat)
    with pytest.raises(RuntimeError, match="view_as_real"):
        opt.step()
    assert len(opt.state) == 0 and torch.equal(real, torch.ones(2, 2))


@pytest.mark.parametrize("mars_type", ["mars-adamw", "mars-lion", "mars-shampoo"])
def test_state_dtype_float32_for_bf16_params(mars_type):
    """bf16 parameters with float32 state are exactly a float32 run whose parameters (and
    gradients) are rounded to bf16 at every step: the update is computed in float32 and
    rounded once.  The state stays float32, also through load_state_dict (torch would cast it
    to bf16), and the update is not lost to bf16 (spec F4)."""
    shapes, rng = [(6, 4), (4,)], np.random.default_rng(1)
    seq = [[torch.tensor(rng.normal(size=s), dtype=torch.float32) for s in shapes]
           for _ in range(10)]
    start = [p.detach().bfloat16() for p in make_params(shapes, seed=2, dtype=torch.float32)]
    # lr_1d = lr: a step must exceed half a bf16 ulp of |p| <= 2 (2^-8) to survive rounding
    kw = dict(lr=1e-2, lr_1d=1e-2, mars_type=mars_type, ns_dtype=torch.float32)
    got = [torch.nn.Parameter(p.clone()) for p in start]
    opt = MARS(got, state_dtype=torch.float32, **kw)
    emulated = [torch.nn.Parameter(p.float()) for p in start]
    opt32 = MARS(emulated, **kw)
    for grads in seq:
        feed(opt, got, grads)
        feed(opt32, emulated, [g.bfloat16().float() for g in grads])
        with torch.no_grad():
            for p in emulated:
                p.copy_(p.bfloat16().float())
    for p0, p, q in zip(start, got, emulated):
        assert p.dtype == torch.bfloat16
        assert torch.equal(p.float(), q)
        assert (p.float() - p0.float()).abs().max() > 0.05  # moved: 10 steps of lr 1e-2
        for key, value in opt.state[p].items():
            if key != "step":
                assert value.dtype == torch.float32 and torch.equal(value, opt32.state[q][key])
    fresh = MARS(clone_params(got), state_dtype=torch.float32, **kw)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert all(v.dtype == torch.float32 for st in fresh.state.values()
               for k, v in st.items() if k != "step")


def test_class_docstring_example_runs():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner()
    for test in finder.find(torch_impl.mars.mars.MARS, "MARS", globs={"torch": torch, "MARS": MARS}):
        runner.run(test)
    assert runner.failures == 0 and runner.tries > 0
