"""``state_dtype`` on MARS-M and LAMB with MARS's semantics (issue 47, item 1), one implementation
for the three (``torch_impl/common/state_storage.py``): the state is stored in ``state_dtype``,
a step computes in the wider of it and the parameter's dtype and writes back once, the
parameter is rounded only to its own dtype, ``load_state_dict`` keeps the state's dtype, a
checkpoint without the key loads with the constructor's, and a group's changed ``state_dtype``
moves its state at the next step.  MARS's own tests (``theory_tests/mars``) pin MARS to its
behaviour from before the move, bit for bit."""
import copy

import pytest
import torch

from theory_tests.support.low_precision_runs import (BF16, F32, OPTIMIZERS, clone, grads,
                                                     make_params, same_bits, state_entries,
                                                     step)
from torch_impl import LAMB

STEPS = 3


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_narrow_state_is_the_wide_run_with_its_state_rounded_after_every_step(name):
    """float32 parameters, bf16 state: bit for bit a float32-state run whose state is rounded
    to bf16 (nearest) after every step; the parameters are float32 values."""
    params = make_params(F32, seed=1)
    twin = clone(params)
    opt, emulated = OPTIMIZERS[name](params, state_dtype=BF16), OPTIMIZERS[name](twin)
    for t in range(STEPS):
        gs = grads(t, F32, seed=1)
        step(opt, params, gs)
        step(emulated, twin, gs)
        for q in twin:
            for value in state_entries(emulated, q).values():
                value.copy_(value.to(BF16))
    for p, q in zip(params, twin):
        assert same_bits(p, q)
        entries = state_entries(opt, p)
        assert entries.keys() == state_entries(emulated, q).keys()
        for key, value in entries.items():
            assert value.dtype == BF16, key
            assert same_bits(value.float(), emulated.state[q][key]), key
    assert not all(torch.equal(p, p.to(BF16).float()) for p in params)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_narrow_parameters_with_wide_state_compute_in_the_wide_dtype(name):
    """bf16 parameters, float32 state: bit for bit a float32 run whose parameters are rounded
    to bf16 (nearest) after every step: one rounding per step, of the parameter only."""
    params = make_params(BF16, seed=2)
    wide = clone(params, F32)
    opt, emulated = OPTIMIZERS[name](params, state_dtype=F32), OPTIMIZERS[name](wide)
    for t in range(STEPS):
        gs = grads(t, F32, seed=2)
        step(opt, params, gs)
        step(emulated, wide, gs)
        with torch.no_grad():
            for q in wide:
                q.copy_(q.to(BF16))
    for p, q in zip(params, wide):
        assert p.dtype == BF16 and same_bits(p.float(), q)
        for key, value in state_entries(opt, p).items():
            assert same_bits(value, emulated.state[q][key]), key


def _saved_without(state_dict, keys):
    saved = copy.deepcopy(state_dict)
    for group in saved["param_groups"]:
        for key in keys:
            group.pop(key, None)
    return saved


@pytest.mark.parametrize("name", ["mars-m", "lamb"])
@pytest.mark.parametrize("without_keys", [False, True], ids=["ours", "without-the-keys"])
def test_load_state_dict_keeps_the_state_dtype_and_continues_bit_identically(name, without_keys):
    """bf16 parameters with float32 state: torch's load would cast the state to bf16; it stays
    float32, also from a checkpoint whose groups lack the storage keys (the authors' format,
    ours from before the options: the constructor's apply), and the resumed run is the
    uninterrupted one."""
    params = make_params(BF16, seed=3)
    opt = OPTIMIZERS[name](params, state_dtype=F32)
    for t in range(2):
        step(opt, params, grads(t, F32, seed=3))
    saved = copy.deepcopy(opt.state_dict())  # torch's load aliases same-dtype tensors
    if without_keys:
        saved = _saved_without(saved, ("state_dtype", "state_rounding", "rounding_seed",
                                       "kahan_sum"))
    twin = clone(params)
    resumed = OPTIMIZERS[name](twin, state_dtype=F32)
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["state_dtype"] == F32
    for t in range(2, 4):
        step(opt, params, grads(t, F32, seed=3))
        step(resumed, twin, grads(t, F32, seed=3))
    for p, q in zip(params, twin):
        assert same_bits(p, q)
        for key, value in state_entries(opt, p).items():
            assert value.dtype == F32 and same_bits(resumed.state[q][key], value), key


@pytest.mark.parametrize("name", ["mars-m", "lamb"])
def test_a_groups_changed_state_dtype_moves_its_state_at_the_next_step(name):
    params = make_params(F32, seed=4)
    opt = OPTIMIZERS[name](params)
    step(opt, params, grads(0, F32, seed=4))
    assert all(v.dtype == F32 for p in params for v in state_entries(opt, p).values())
    opt.param_groups[0]["state_dtype"] = BF16
    step(opt, params, grads(1, F32, seed=4))
    assert all(v.dtype == BF16 for p in params for v in state_entries(opt, p).values())


def test_init_state_creates_the_state_in_state_dtype():
    for name in ("mars-adamw", "mars-m", "lamb"):
        params = make_params(BF16, seed=5)
        opt = OPTIMIZERS[name](params, state_dtype=F32)
        opt.init_state()
        first = {k: v.dtype for p in params for k, v in state_entries(opt, p).items()}
        fresh = OPTIMIZERS[name](clone(params), state_dtype=F32)
        step(fresh, fresh.param_groups[0]["params"], grads(0, F32, seed=5))
        assert first == {k: v.dtype for p in fresh.param_groups[0]["params"]
                         for k, v in state_entries(fresh, p).items()}, name
        assert set(first.values()) == {F32}, name


def test_a_complex_parameter_with_a_state_dtype_is_refused():
    """LAMB steps complex parameters through their real view, whose state is complex: a real
    ``state_dtype`` cannot hold it."""
    z = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"^state_dtype: complex parameters"):
        LAMB([z], state_dtype=F32)
    opt = LAMB([z])
    z.grad = torch.ones_like(z)
    opt.step()
    opt.param_groups[0]["state_dtype"] = F32
    with pytest.raises(ValueError, match=r"^state_dtype: complex parameters"):
        opt.step()


@pytest.mark.parametrize("name", ["mars-m", "lamb"])
def test_a_bad_state_dtype_is_refused_naming_it(name):
    with pytest.raises(ValueError, match=r"^state_dtype: expected one of"):
        OPTIMIZERS[name](make_params(F32), state_dtype=torch.int32)
