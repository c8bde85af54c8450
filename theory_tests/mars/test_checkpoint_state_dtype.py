"""``state_dtype`` survives a checkpoint that does not name it (issue 30, item 2).

bf16 parameters under ``MARS(state_dtype=torch.float32)``, loading a checkpoint whose groups
lack the key (the authors' format, or ours from before the option): the loaded group takes the
constructor's ``state_dtype`` and the state is kept in it -- not cast to bf16 by torch's load
while the group says float32 (before: every later step stored bf16 state).  The state's dtype
is the group's ``state_dtype`` at every step, so a group whose option is changed by hand moves
its state at the next step.
"""
import copy

import pytest
import torch

from theory_tests.support.mars_property_helpers import clone_params, feed, make_params
from torch_impl import MARS

BF16, F32 = torch.bfloat16, torch.float32
SHAPES = [(5, 4), (4,)]
STATE_KEYS = ("exp_avg", "exp_avg_sq", "last_grad")


def _grads(t):
    gen = torch.Generator().manual_seed(40 + t)
    return [torch.randn(s, generator=gen).to(BF16) for s in SHAPES]


def _bf16_params(seed=3):
    return [p.detach().to(BF16).requires_grad_() for p in make_params(SHAPES, seed, dtype=F32)]


def _without_state_dtype(state_dict):
    saved = copy.deepcopy(state_dict)
    for group in saved["param_groups"]:
        del group["state_dtype"]
    return saved


@pytest.mark.parametrize("mars_type", ["mars-adamw", "mars-lion", "mars-shampoo"])
def test_a_checkpoint_without_the_key_keeps_float32_state_and_continues_bit_identically(
        mars_type):
    kw = dict(mars_type=mars_type, optimize_1d=True, state_dtype=F32, ns_dtype=F32)
    params = _bf16_params()
    opt = MARS(params, **kw)
    for t in range(2):
        feed(opt, params, _grads(t))
    twin_params = clone_params(params)
    twin = MARS(twin_params, **kw)
    twin.load_state_dict(_without_state_dtype(opt.state_dict()))
    assert twin.param_groups[0]["state_dtype"] == F32
    for p, q in zip(params, twin_params):
        for key in STATE_KEYS:
            if key in opt.state[p]:
                assert twin.state[q][key].dtype == F32, key
                assert torch.equal(twin.state[q][key], opt.state[p][key]), key
    for t in range(2, 4):  # the resumed run is the uninterrupted one, bit for bit
        feed(opt, params, _grads(t))
        feed(twin, twin_params, _grads(t))
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)
        for key in STATE_KEYS:
            if key in opt.state[p]:
                assert twin.state[q][key].dtype == F32
                assert torch.equal(twin.state[q][key], opt.state[p][key]), key


def test_the_authors_format_with_state_in_the_parameter_dtype_loads_into_state_dtype():
    """The authors' checkpoints keep the state in the parameter's dtype and name no
    ``state_dtype``: loaded into ``state_dtype=float32``, the state is its exact widening,
    and stays float32."""
    params = _bf16_params()
    authors = MARS(params)  # state in bf16, as the parameters
    for t in range(2):
        feed(authors, params, _grads(t))
    saved = _without_state_dtype(authors.state_dict())
    ours_params = clone_params(params)
    ours = MARS(ours_params, state_dtype=F32)
    ours.load_state_dict(saved)
    feed(ours, ours_params, _grads(2))
    p = ours_params[0]
    for key in STATE_KEYS:
        assert ours.state[p][key].dtype == F32, key


def test_changing_a_groups_state_dtype_moves_the_state_at_the_next_step():
    params = _bf16_params()
    opt = MARS(params, state_dtype=F32)
    feed(opt, params, _grads(0))
    opt.param_groups[0]["state_dtype"] = BF16
    feed(opt, params, _grads(1))
    assert all(opt.state[p][key].dtype == BF16 for p in params for key in ("exp_avg", "exp_avg_sq"))
    opt.param_groups[0]["state_dtype"] = None  # back to the parameter's own dtype
    opt.param_groups[0]["params"][0].data = opt.param_groups[0]["params"][0].data.float()
    feed(opt, params, [g.float() if i == 0 else g for i, g in enumerate(_grads(2))])
    assert opt.state[params[0]]["exp_avg"].dtype == F32
