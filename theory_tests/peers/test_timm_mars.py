"""Our MARS against timm's ``Mars`` (timm 1.0.31) through the convention map
``theory_tests/support/peer_conventions.py::from_timm_mars`` (``theory_tests/peers/README.md``).

A small model with a 3-D Conv1d kernel, a 2-D Linear weight, 1-D biases and a 0-D scale; six
steps under a changing lr, weight decay on, ``lr_1d_factor`` and ``betas_1d`` set; both
optimizers fed the same gradients (``_lockstep``).  The difference must stay within the
accumulated rounding bound (``_lockstep.rounding_bound``); measured: float64 1.1e-16,
float32 1.2e-7.
"""
import inspect

import pytest
import torch

from theory_tests.peers._lockstep import (assert_within, lockstep,
                                          rounding_bound)
from theory_tests.support.peer_conventions import TIMM_DEFAULTS, from_timm_mars
from theory_tests.support.peer_loading import load_timm_mars

Mars = load_timm_mars()
WD = 0.04  # not our weight_decay_1d default (0.1): the fallback must take the group's
KW = dict(lr=1e-2, weight_decay=WD, lr_1d_factor=0.5, betas_1d=(0.8, 0.9))
DTYPES = [torch.float64, torch.float32]


def _run(dtype, **kw):
    kw = {**KW, **kw}
    return lockstep(lambda ps: Mars(ps, **kw), lambda named: from_timm_mars(named, **kw), dtype)


def test_the_maps_defaults_are_the_installed_timm_defaults():
    signature = inspect.signature(Mars.__init__)
    installed = {k: v.default for k, v in signature.parameters.items() if k not in ("self", "params")}
    assert installed == TIMM_DEFAULTS


@pytest.mark.parametrize("mars_type", ["adamw", "lion"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["float64", "float32"])
def test_ours_takes_timms_steps(dtype, mars_type):
    """Every tensor kind, every step, within the rounding bound (float64 ~1e-16)."""
    history = _run(dtype, mars_type=mars_type)
    worst, _ = assert_within(history, rounding_bound(history, dtype, WD))
    moved = max((r["peer"] - r["before"]).abs().max().item() for r in history[-1])
    assert moved > 1e-4  # the runs move: the agreement is not that of two idle optimizers
    assert worst < (1e-14 if dtype == torch.float64 else 1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float64", "float32"])
def test_ours_takes_timms_steps_with_optimize_1d_and_default_betas_1d(dtype):
    history = _run(dtype, optimize_1d=True, betas_1d=None, gamma=0.1, betas=(0.95, 0.98))
    assert_within(history, rounding_bound(history, dtype, WD))


def test_step_one_takes_the_raw_gradient_and_gamma_is_restored():
    """timm's c_1 = g_1: the map zeroes our gamma for step 1 only, and puts it back after."""
    named = list(torch.nn.Linear(3, 2).double().named_parameters())
    mapping = from_timm_mars(named, gamma=0.3)
    ours = mapping.build()
    seen = []
    for t in range(3):
        for _, p in named:
            p.grad = torch.full_like(p, 0.01 * (t + 1))
        mapping.before_step(ours)
        seen.append(ours.param_groups[0]["gamma"])
        ours.step()
        mapping.after_step(ours)
        assert ours.param_groups[0]["gamma"] == 0.3
    assert seen == [0.0, 0.3, 0.3]


def test_the_refusals_raise():
    named = list(torch.nn.Linear(3, 2).named_parameters())
    with pytest.raises(ValueError, match="caution"):
        from_timm_mars(named, caution=True)
    with pytest.raises(ValueError, match="mars_type"):
        from_timm_mars(named, mars_type="shampoo")
    with pytest.raises(ValueError, match="no counterpart"):
        from_timm_mars(named, foreach=True)
    # a MARS-path tensor without a gradient after a step (timm keeps its last_grad)
    mapping = from_timm_mars(named)
    ours = mapping.build()
    for _, p in named:
        p.grad = torch.ones_like(p)
    mapping.step(ours)
    named[0][1].grad = None
    with pytest.raises(ValueError, match="weight: no gradient after a step"):
        mapping.step(ours)
    # a MARS-path tensor starting late, beside one that has stepped (per-tensor step 1)
    late = list(torch.nn.Linear(3, 2).named_parameters()) + [("late", torch.nn.Parameter(torch.ones(2, 2)))]
    mapping = from_timm_mars(late)
    ours = mapping.build()
    for _, p in late[:-1]:
        p.grad = torch.ones_like(p)
    mapping.step(ours)
    for _, p in late:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="late: takes its first step"):
        mapping.step(ours)
