"""``state_rounding="stochastic"`` in MARS (every rule and route), MARS-M and LAMB (issue 47,
item 1): each narrower write of a step is LP1 with its LP2 stream, bit for bit; the rounded
state is unbiased at the rate its sample count predicts; the loop, foreach and compiled paths
and ``torch.compile(opt.step)`` write the same bits; a resumed run is the uninterrupted one;
streams are never shared.  The stall of a slowly moving second moment under round-to-nearest,
and its absence under stochastic rounding: ``test_state_rounding_stall.py``."""
import copy

import pytest
import torch

from theory_tests.support.low_precision_runs import (BF16, F32, OPTIMIZERS, SHAPES, clone,
                                                     grads, make_params, same_bits,
                                                     state_entries, step)
from torch_impl import MARS, MARSM
from torch_impl.common.rounding import name_word, stochastic_round, stream_seed

SEED = 1234
WARMUP = 2  # steps before the one checked: its step word is WARMUP + 1


def _stochastic(name, params, **kw):
    state_dtype = None if params[0].dtype == BF16 else BF16
    return OPTIMIZERS[name](params, state_dtype=state_dtype, state_rounding="stochastic",
                            rounding_seed=SEED, **kw)


def _wide_twin(name, opt, params):
    """A float32, round-to-nearest copy of ``opt`` at its current state: its next step's
    float32 state and parameters are ``opt``'s working copies of that step."""
    wide = clone(params, F32)
    twin = OPTIMIZERS[name](wide)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch's load aliases tensors
    for group in twin.param_groups:  # the same step, into float32, rounded by nobody
        group.update(state_dtype=None, state_rounding="nearest")
    return twin, wide


def _seed(group_index, position, key, t):
    return stream_seed(SEED, group_index, position, name_word(key), t)


def _cases(rows, slow=()):
    """pytest params; the ``compiled=`` ones (seconds of Inductor each) under -m slow."""
    return [pytest.param(*row, id="-".join(
        [row[0]] + [f"{'bf16' if x == BF16 else 'f32'}-params" for x in row[1:2] if
                    isinstance(x, torch.dtype)] + [f"{k}={v}" for k, v in row[-1].items()]),
        marks=[pytest.mark.slow] if "compiled" in row[-1] and row not in slow else [])
        for row in rows]


CASES = _cases([(name, dtype, {}) for name in OPTIMIZERS for dtype in (F32, BF16)] + [
    ("mars-adamw", BF16, dict(foreach=True)), ("mars-m", BF16, dict(foreach=True)),
    ("lamb", BF16, dict(foreach=True)), ("mars-adamw", F32, dict(compiled="tensor")),
    ("mars-adamw-amsgrad-1d", F32, dict(compiled="group")), ("mars-m", F32, dict(compiled=True))])


@pytest.mark.parametrize("name, param_dtype, path", CASES)
def test_each_write_is_lp1_with_its_documented_stream(name, param_dtype, path):
    """One step with stochastic rounding = the same step into float32 state (nearest), then
    ``stochastic_round(w, bf16, stream_seed(rounding_seed, group, position, name_word(key),
    t))`` of each written tensor w -- the state buffers, and bf16 parameters (key "param"),
    whichever path runs the step (the loop, foreach, the compiled kernels: the twin runs the
    same one, its group options loaded with the state)."""
    params = make_params(param_dtype, seed=7)
    opt = _stochastic(name, params, **path)
    for t in range(WARMUP):
        step(opt, params, grads(t, F32, seed=7))
    twin, wide = _wide_twin(name, opt, params)
    gs = grads(WARMUP, F32, seed=7)
    step(opt, params, gs)
    step(twin, wide, gs)
    t = WARMUP + 1
    rounded = 0
    for position, (p, q) in enumerate(zip(params, wide)):
        assert int(opt.state[p]["step"]) == t
        for key, value in state_entries(opt, p).items():
            want = stochastic_round(twin.state[q][key], BF16, _seed(0, position, key, t))
            assert same_bits(value, want), key
            rounded += int((value.float() != twin.state[q][key]).sum())
        if param_dtype == BF16:
            assert same_bits(p.detach(), stochastic_round(q.detach(), BF16,
                                                          _seed(0, position, "param", t)))
        else:
            assert same_bits(p.detach(), q.detach())  # float32 parameters: not rounded
    assert rounded > 0  # the writes were inexact: the rule had something to decide


def test_exact_modes_g_prev_is_lp1_with_its_stream():
    """Exact mode (the authors' loop): ``update_last_grad`` writes g_prev for step t + 1 into
    bf16 ``last_grad`` as SR(previous_grad) from the stream ("g_prev", t + 1); the closure loop
    refills it through the same function (``state_storage.write_state``)."""
    for cls in (MARS, MARSM):
        params = make_params(F32, seed=8, shapes=[(6, 5)])
        kw = dict(ns_dtype=F32) if cls is MARSM else {}
        opt = cls(params, lr=1e-2, is_approx=False, state_dtype=BF16,
                  state_rounding="stochastic", rounding_seed=SEED, **kw)
        p, gen = params[0], torch.Generator().manual_seed(8)
        for t in range(2):
            p.grad = torch.randn(6, 5, generator=gen)  # not bf16 values: the write rounds
            opt.update_previous_grad()
            opt.zero_grad()
            p.grad = torch.randn(6, 5, generator=gen)
            opt.step()
            opt.update_last_grad()
        previous = opt.state[p]["previous_grad"]
        want = stochastic_round(previous, BF16, _seed(0, 0, "g_prev", 3))
        assert same_bits(opt.state[p]["last_grad"], want), cls.__name__
        assert not torch.equal(opt.state[p]["last_grad"].float(), previous)


def _run(name, steps=3, seed=9, **kw):
    params = make_params(F32, seed=seed)
    opt = _stochastic(name, params, **kw)
    for t in range(steps):
        step(opt, params, grads(t, F32, seed=seed))
    return opt, params


def _assert_same_run(a, pa, b, pb, params_atol=0.0):
    """The same state bits; the same parameter bits (``params_atol``: float32 parameters
    within that, where Inductor's arithmetic differs from eager's by ulps, as it does
    without the option)."""
    for p, q in zip(pa, pb):
        if params_atol:
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=params_atol)
        else:
            assert same_bits(p.detach(), q.detach())
        ea, eb = state_entries(a, p), state_entries(b, q)
        assert ea.keys() == eb.keys()
        for key in ea:
            assert same_bits(ea[key], eb[key]), key


PATHS = [("mars-adamw", dict(foreach=True)), ("mars-adamw-amsgrad-1d", dict(foreach=True)),
         ("mars-lion", dict(foreach=True)), ("mars-shampoo", dict(foreach=True)),
         ("mars-m", dict(foreach=True)), ("mars-m-efficient", dict(foreach=True)),
         ("lamb", dict(foreach=True)), ("mars-adamw", dict(compiled="tensor")),
         ("mars-adamw", dict(compiled="group")), ("mars-m", dict(compiled=True))]
# float32 parameters after 3 steps of lr 1e-2: Inductor's kernels may fuse and reassociate,
# a few ulps of |p| <= 4 per step (measured: 1 ulp, 1.2e-7); the state is bit for bit
COMPILED_ATOL = 3 * 4 * 4 * torch.finfo(F32).eps


@pytest.mark.parametrize("name, path", _cases(PATHS, slow=[("mars-adamw", dict(compiled="tensor"))]))
def test_the_loop_foreach_and_compiled_paths_write_the_same_bits(name, path):
    """The rounding is the write-back's, shared by every path: the same working values give
    the same stored bits.  The loop's and foreach's arithmetic is bit-identical (MT20), so
    is their whole run; the compiled kernels' state arithmetic is too on these tensors (their
    float32 parameters differ by Inductor's ulps, as without the option)."""
    atol = COMPILED_ATOL if "compiled" in path else 0.0
    _assert_same_run(*_run(name), *_run(name, **path), params_atol=atol)


@pytest.mark.parametrize("name", ["mars-adamw", pytest.param("lamb", marks=pytest.mark.slow)])
def test_torch_compile_of_the_step_writes_the_eager_bits(name):
    """``torch.compile(opt.step)`` with stochastic rounding: the rounding runs outside the
    graph (``torch._dynamo.disable``: a generator and the counters' host reads), the rest is
    traced; the stored state is the eager run's, bit for bit (the float32 parameters of
    MARS's traced step differ from eager's by ulps, as without the option:
    ``theory_tests/mars/test_torch_optim_surface.py``)."""
    torch._dynamo.reset()
    eager, pe = _run(name, steps=0)
    traced, pt = _run(name, steps=0)
    compiled_step = torch.compile(traced.step, backend="aot_eager")
    for t in range(3):
        gs = grads(t, F32, seed=9)
        step(eager, pe, gs)
        for p, g in zip(pt, gs):
            p.grad = g.clone()
        compiled_step()
    _assert_same_run(eager, pe, traced, pt, params_atol=COMPILED_ATOL)


@pytest.mark.parametrize("name", ["mars-adamw-amsgrad-1d", "mars-m", "lamb"])
def test_a_resumed_run_is_the_uninterrupted_one(name, tmp_path):
    """The streams are a function of what ``state_dict`` holds (the group's rounding_seed,
    each tensor's step count): an optimizer built with another seed, given the checkpoint
    (through ``torch.save``), continues bit for bit."""
    opt, params = _run(name, steps=2)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    twin_params = clone(params)
    twin = OPTIMIZERS[name](twin_params, state_dtype=BF16, state_rounding="stochastic")
    assert twin.param_groups[0]["rounding_seed"] != SEED
    twin.load_state_dict(torch.load(tmp_path / "opt.pt"))
    assert twin.param_groups[0]["rounding_seed"] == SEED
    for t in range(2, 4):
        step(opt, params, grads(t, F32, seed=9))
        step(twin, twin_params, grads(t, F32, seed=9))
    _assert_same_run(opt, params, twin, twin_params)


def test_a_dcp_round_trip_resumes_bit_for_bit(tmp_path):
    """Through ``torch.distributed.checkpoint`` (one process), a fresh job's template: the
    group's rounding_seed and the counters come back, and so do the streams."""
    from theory_tests.support.checkpoint_checks import dcp_round_trip
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Linear(6, 3))
    fresh = copy.deepcopy(model)
    kw = dict(lr=1e-2, state_dtype=BF16, state_rounding="stochastic")
    opt, fresh_opt = MARS(model.parameters(), rounding_seed=SEED, **kw), \
        MARS(fresh.parameters(), rounding_seed=SEED + 1, **kw)
    fresh_opt.init_state()

    def train(m, o, t):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(t))
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
    for t in range(2):
        train(model, opt, t)
    dcp_round_trip(model, opt, fresh, fresh_opt, tmp_path / "ckpt")
    assert fresh_opt.param_groups[0]["rounding_seed"] == SEED
    for t in range(2, 4):
        train(model, opt, t)
        train(fresh, fresh_opt, t)
    _assert_same_run(opt, list(model.parameters()), fresh_opt, list(fresh.parameters()))


def test_two_optimizers_built_in_sequence_round_differently():
    """``rounding_seed=None``: one draw of torch's default generator per optimizer, so two
    optimizers built one after the other get different streams (and ``torch.manual_seed``
    fixes both); the draw is kept in the groups."""
    def pair():
        a, b = make_params(F32, seed=10), make_params(F32, seed=10)
        oa = OPTIMIZERS["mars-adamw"](a, state_dtype=BF16, state_rounding="stochastic")
        ob = OPTIMIZERS["mars-adamw"](b, state_dtype=BF16, state_rounding="stochastic")
        for o, ps in ((oa, a), (ob, b)):
            step(o, ps, grads(0, F32, seed=10))
        return (oa, a), (ob, b)
    torch.manual_seed(5)
    (oa, a), (ob, b) = pair()
    assert oa.param_groups[0]["rounding_seed"] != ob.param_groups[0]["rounding_seed"]
    assert not torch.equal(oa.state[a[0]]["exp_avg_sq"], ob.state[b[0]]["exp_avg_sq"])
    torch.manual_seed(5)
    (oc, c), _ = pair()
    assert oc.param_groups[0]["rounding_seed"] == oa.param_groups[0]["rounding_seed"]
    assert torch.equal(oc.state[c[0]]["exp_avg_sq"], oa.state[a[0]]["exp_avg_sq"])


def test_a_nearest_optimizer_draws_no_seed():
    """Round-to-nearest (the default) leaves torch's random stream as it was: building the
    optimizer draws nothing."""
    torch.manual_seed(6)
    OPTIMIZERS["mars-adamw"](make_params(F32), state_dtype=BF16)
    after = torch.rand(3)
    torch.manual_seed(6)
    assert torch.equal(torch.rand(3), after)


@pytest.mark.parametrize("name", ["mars-adamw", "mars-m", "lamb"])
def test_two_equal_tensors_round_differently(name):
    """Two tensors with equal values and gradients in one optimizer (two groups, and two
    positions of one group): each has its own stream, so their rounded states differ; a
    stream shared between tensors would store the same bits."""
    base = make_params(F32, seed=11, shapes=[(8, 8)])[0]
    ps = [torch.nn.Parameter(base.detach().clone()) for _ in range(3)]
    opt = OPTIMIZERS[name]([dict(params=ps[:2]), dict(params=ps[2:])], state_dtype=BF16,
                           state_rounding="stochastic", rounding_seed=SEED)
    g = grads(0, F32, seed=11, shapes=[(8, 8)])[0]
    step(opt, ps, [g, g, g])
    key = {"mars-m": "momentum_buffer"}.get(name, "exp_avg")
    states = [opt.state[p][key] for p in ps]
    assert not torch.equal(states[0], states[1])  # positions 0 and 1 of group 0
    assert not torch.equal(states[0], states[2])  # position 0 of groups 0 and 1


@pytest.mark.parametrize("name", ["mars-adamw", "mars-m", "lamb"])
def test_the_same_value_rounds_differently_at_two_steps(name):
    """The step count is a word of the stream: the same write at steps 1 and 2 (the state
    reset in between) rounds differently."""
    params = make_params(F32, seed=12, shapes=[(8, 8)])
    opt = OPTIMIZERS[name](params, state_dtype=BF16, state_rounding="stochastic",
                           rounding_seed=SEED)
    g = grads(0, F32, seed=12, shapes=[(8, 8)])
    start = copy.deepcopy(opt.state_dict())
    step(opt, params, g)
    first = {k: v.clone() for k, v in state_entries(opt, params[0]).items()}
    opt.load_state_dict(copy.deepcopy(start))  # no state: the first step's zeros again
    opt.init_state()
    opt.state[params[0]]["step"].fill_(1.0)  # the same write, one step later
    with torch.no_grad():
        params[0].copy_(make_params(F32, seed=12, shapes=[(8, 8)])[0])
    step(opt, params, g)
    key = {"mars-m": "momentum_buffer"}.get(name, "exp_avg")
    assert not torch.equal(first[key], opt.state[params[0]][key])


# ------------------------------------------------------------------ unbiasedness

UNBIASED_SEEDS = 256


@pytest.mark.parametrize("name", ["mars-adamw", "mars-m", "lamb"])
def test_the_stored_state_is_unbiased_at_the_rate_its_sample_count_predicts(name):
    """One step from a fixed state, over 256 rounding seeds: per element, the mean of the
    stored bf16 value is the float32 step's value w within 5 standard errors
    sqrt((hi - w)(w - lo) / 256), and the standardised errors have a mean square near 1 (the
    law's variance, not a smaller or larger one); a bf16 parameter likewise."""
    params = make_params(BF16, seed=13)
    opt = OPTIMIZERS[name](params, state_rounding="stochastic", rounding_seed=0)
    for t in range(WARMUP):
        step(opt, params, grads(t, F32, seed=13))
    start = copy.deepcopy(opt.state_dict())
    values = [p.detach().clone() for p in params]
    twin, wide = _wide_twin(name, opt, params)
    gs = grads(WARMUP, F32, seed=13)
    step(twin, wide, gs)
    sums, squares = {}, {}
    for seed in range(UNBIASED_SEEDS):
        opt.load_state_dict(copy.deepcopy(start))
        opt.param_groups[0]["rounding_seed"] = seed
        with torch.no_grad():
            for p, v in zip(params, values):
                p.copy_(v)
        step(opt, params, gs)
        for i, p in enumerate(params):
            for key, value in [("param", p.detach())] + list(state_entries(opt, p).items()):
                sums[i, key] = sums.get((i, key), 0.0) + value.double()
    z2, n = 0.0, 0
    for (i, key), total in sums.items():
        w = (wide[i].detach() if key == "param" else twin.state[wide[i]][key]).double()
        lo = w.to(BF16).double()
        other = torch.nextafter(w.to(BF16), torch.where(lo < w, torch.inf, -torch.inf).to(
            BF16)).double()
        var = (torch.maximum(lo, other) - w) * (w - torch.minimum(lo, other))
        se = (var / UNBIASED_SEEDS).sqrt()
        err = total / UNBIASED_SEEDS - w
        assert bool((err.abs() <= 5 * se + 1e-30).all()), (key, float((err.abs() / se).max()))
        live = se > 0
        z2 += float(((err[live] / se[live]) ** 2).sum())
        n += int(live.sum())
    assert n > 100
    assert 0.7 < z2 / n < 1.3, z2 / n


# ------------------------------------------------------------------ bad input

def _bf16(shape=(4, 3)):
    return [torch.nn.Parameter(torch.zeros(shape, dtype=BF16))]


@pytest.mark.parametrize("name", ["mars-adamw", "mars-m", "lamb"])
def test_bad_options_are_refused_naming_them(name):
    make = OPTIMIZERS[name]
    f32 = [torch.nn.Parameter(torch.zeros(4, 3))]
    with pytest.raises(ValueError, match=r"^state_rounding: expected one of"):
        make(f32, state_rounding="up")
    with pytest.raises(ValueError, match=r"^state_rounding: 'stochastic' rounds state .* "
                                         r"nothing to round"):
        make(f32, state_rounding="stochastic")  # float32 state
    with pytest.raises(ValueError, match=r"^state_rounding: 'stochastic' with "
                                         r"state_dtype=torch.float32 wider than"):
        make(_bf16(), state_rounding="stochastic", state_dtype=F32)
    for seed in (-1, 1.5, True, "0"):
        with pytest.raises(ValueError, match=r"^rounding_seed: expected None or an int"):
            make(_bf16(), state_rounding="stochastic", rounding_seed=seed)
    with pytest.raises(ValueError, match=r"^kahan_sum: expected a bool"):
        make(_bf16(), kahan_sum=1)
    make(_bf16(), state_rounding="stochastic", state_dtype=torch.float16)  # accepted


@pytest.mark.parametrize("name", ["mars-adamw", "mars-m", "lamb"])
def test_a_group_that_cannot_round_is_refused_in_add_param_group_and_at_the_step(name):
    opt = OPTIMIZERS[name](_bf16(), state_rounding="stochastic")
    with pytest.raises(ValueError, match=r"^state_rounding: 'stochastic' rounds state"):
        opt.add_param_group(dict(params=[torch.nn.Parameter(torch.zeros(4, 3))]))
    assert len(opt.param_groups) == 1
    p = opt.param_groups[0]["params"][0]
    p.grad = torch.ones_like(p)
    opt.step()
    opt.param_groups[0]["state_dtype"] = F32
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"^state_rounding: 'stochastic' with state_dtype"):
        opt.step()
    assert int(opt.state[p]["step"]) == int(before["state"][0]["step"])


def test_a_group_turned_stochastic_later_gets_the_optimizers_seed():
    opt = OPTIMIZERS["mars-adamw"](_bf16())
    assert opt.param_groups[0]["rounding_seed"] is None
    opt.param_groups[0]["state_rounding"] = "stochastic"
    p = opt.param_groups[0]["params"][0]
    p.grad = torch.ones_like(p)
    opt.step()
    seed = opt.param_groups[0]["rounding_seed"]
    assert isinstance(seed, int) and seed == opt.defaults["rounding_seed"]
    assert SHAPES  # the shared shapes exist (a smoke check of the helper's import)
