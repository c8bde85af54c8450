"""Our MARS against pytorch_optimizer's ``MARS`` (4.1.0), loop and foreach paths, through the
convention map ``theory_tests/support/peer_conventions.py::from_pytorch_optimizer_mars``
(``theory_tests/peers/README.md``).

The same lockstep as the timm tests (``_lockstep``: six steps, changing lr, weight decay and
weight_decay_1d on, lr_1d set, default betas and betas_1d, which differ, so the eps map needs
its two groups).  The peer's sqrt(v + 1e-15) is the one unmapped term: the difference must
stay within the rounding bound plus ``_lockstep.sqrt_shift_bound``, derived from it and the
peer's own v (measured float64 9.2e-10 on the 2-D weight, whose smallest v is 1.6e-9, and the
bound 9.8e-10; float32 1.2e-7).  With the 1e-15 set to 0 in the peer, the rest of the map is
rounding-exact (float64 <= 1e-15).
"""
import functools
import inspect

import pytest
import torch
from pytorch_optimizer import MARS as PeerMARS
from pytorch_optimizer.base.optimizer import BaseOptimizer

from theory_tests.peers._lockstep import (assert_within, lockstep, max_abs_difference,
                                          rounding_bound, sqrt_shift_bound)
from theory_tests.support.peer_conventions import (PYTORCH_OPTIMIZER_DEFAULTS, SQRT_EPS_1E15,
                                                   from_pytorch_optimizer_mars)

WD, WD_1D = 0.1, 0.05
KW = dict(lr=1e-2, weight_decay=WD, weight_decay_1d=WD_1D, lr_1d=4e-3)
DECAY = max(WD, WD_1D * 0.4)  # the largest lr factor x weight decay of any rule
DTYPES = [torch.float64, torch.float32]
FALLBACK = ("conv.bias", "lin.bias", "scale")  # ndim < 2: the peer's AdamW (and ours)


def _run(dtype, **kw):
    kw = {**KW, **kw}
    return lockstep(lambda ps: PeerMARS(ps, **kw),
                    lambda named: from_pytorch_optimizer_mars(named, **kw), dtype)


def _bounds(history, dtype, mars_type, shift=SQRT_EPS_1E15):
    uses = lambda name: mars_type == "adamw" or name in FALLBACK  # noqa: E731
    return (rounding_bound(history, dtype, DECAY),
            sqrt_shift_bound(history, 1e-8, DECAY, uses, shift))


def test_the_maps_defaults_are_the_installed_defaults():
    signature = inspect.signature(PeerMARS.__init__)
    installed = {k: v.default for k, v in signature.parameters.items()
                 if k not in ("self", "params", "kwargs")}
    assert installed == PYTORCH_OPTIMIZER_DEFAULTS


@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
@pytest.mark.parametrize("mars_type", ["adamw", "lion"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["float64", "float32"])
def test_ours_takes_the_peers_steps(dtype, mars_type, foreach):
    history = _run(dtype, mars_type=mars_type, foreach=foreach)
    worst, _ = assert_within(history, *_bounds(history, dtype, mars_type))
    moved = max((r["peer"] - r["before"]).abs().max().item() for r in history[-1])
    assert moved > 1e-4
    assert worst < (1e-8 if dtype == torch.float64 else 1e-6)


@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
def test_without_the_1e15_the_map_is_rounding_exact(monkeypatch, foreach):
    """The peer's sqrt(v + 1e-15) set to sqrt(v + 0): what remains is rounding (float64)."""
    for name in ("apply_ams_bound", "apply_ams_bound_foreach"):
        original = inspect.getattr_static(BaseOptimizer, name).__func__
        monkeypatch.setattr(BaseOptimizer, name,
                            staticmethod(functools.partial(original, exp_avg_sq_eps=0.0)))
    history = _run(torch.float64, foreach=foreach)
    assert_within(history, rounding_bound(history, torch.float64, DECAY))
    assert max_abs_difference(history) <= 1e-15


@pytest.mark.parametrize("dtype", DTYPES, ids=["float64", "float32"])
def test_ours_takes_the_peers_steps_with_optimize_1d(dtype):
    history = _run(dtype, optimize_1d=True, gamma=0.1, betas=(0.9, 0.95))
    assert_within(history, *_bounds(history, dtype, "adamw"))


@pytest.mark.parametrize("flag, value", [("mars_type", "shampoo"), ("ams_bound", True),
                                         ("cautious", True), ("weight_decouple", False),
                                         ("fixed_decay", True), ("maximize", True)])
def test_the_refusals_raise(flag, value):
    named = list(torch.nn.Linear(3, 2).named_parameters())
    with pytest.raises(ValueError, match=flag):
        from_pytorch_optimizer_mars(named, **{flag: value})


def test_a_tensor_that_misses_a_step_is_refused():
    """The peer's per-group step counter moves on without a tensor; ours is per tensor."""
    named = list(torch.nn.Linear(3, 2).named_parameters())
    mapping = from_pytorch_optimizer_mars(named)
    ours = mapping.build()
    for _, p in named:
        p.grad = torch.ones_like(p)
    mapping.step(ours)
    named[1][1].grad = None
    with pytest.raises(ValueError, match="bias: no gradient at the group's step 2 after 1 steps"):
        mapping.step(ours)
    with pytest.raises(ValueError, match="no counterpart"):
        from_pytorch_optimizer_mars(named, honour_everything=True)
