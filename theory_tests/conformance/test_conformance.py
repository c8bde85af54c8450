"""One conformance battery for every optimizer of the project (issue 21, items 2 and 3).

The list of behaviours follows torch's own optimizer suite (test/test_optim.py with the
``OptimizerInfo`` registry of torch/testing/_internal/common_optimizers.py); the code is this
project's.  Each test function is one behaviour, parametrized over the cases of
``conformance_cases.CASES`` that take part in it (ids: ``mars_adamw``, ``lamb``, ``mkor``, ...).
The references -- ``adamw_reference`` for the first-order optimizers, ``sgd_reference`` (the
backbone alone) for MKOR and K-FAC -- run in the same tests, so every assertion is shown to hold
for torch's own optimizer; where torch does otherwise the case is left out and the reason is in
the registry and in theory_tests/conformance/README.md (the table there is ``applicability_table()``).

Everything runs on TinyNet (30 scalars in 5 tensors) for 2-4 steps, in float64 and again with bf16
and fp16 parameters (``case_dtypes_for``: ids ``<case>``, ``<case>-bf16``, ``<case>-fp16``), the same
assertion in each dtype -- bit for bit where float64's is -- except where the registry says why
not (``ONE_DTYPE``, ``LOW_PRECISION_SKIPS``, a case's ``low_precision_skips`` / ``_xfails``).
``python -m pytest -n0 -q -p no:cacheprovider theory_tests/conformance/test_conformance.py``.
"""
import copy
import io
import pickle
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, OneCycleLR, StepLR

from theory_tests.support.conformance_cases import (BEHAVIOURS, BY_NAME, CASES, F64, applicability_table, cases_for,
                               case_dtypes_for,
                               loss_of, tiny_model)
from theory_tests.support.dynamo_probe import compiled_graphs

# -- helpers --------------------------------------------------------------------------------------


def train_step(case, model, opt, t, *, sign=1.0, extra=None):
    """One step on batch ``t`` of ``sign * (loss + extra())``, the way the case is driven:
    backward then ``step()``, or ``step(closure)`` (MARS exact mode)."""
    def closure():
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, t)
        if extra is not None:
            loss = loss + extra()
        loss = sign * loss
        loss.backward()
        return loss
    if case.closure:
        return opt.step(closure)
    closure()
    return opt.step()


def train(case, model, opt, steps, start=0, **kwargs):
    for t in range(start, start + steps):
        train_step(case, model, opt, t, **kwargs)


def params_of(model, *extra):
    out = {name: p.detach().clone() for name, p in model.named_parameters()}
    out.update({f"extra{i}": p.detach().clone() for i, p in enumerate(extra)})
    return out


def snapshot(model, opt, *extra):
    """Everything a step may change: the parameters and the optimizer's ``state_dict`` (for
    MKOR / K-FAC the backbone's state plus the factors, counters and step count)."""
    return {"params": params_of(model, *extra), "opt": copy.deepcopy(opt.state_dict())}


def without_groups(snap):
    """A snapshot without the param_groups (a scheduler adds keys such as ``initial_lr``)."""
    return {"params": snap["params"],
            "opt": {k: v for k, v in snap["opt"].items() if k != "param_groups"}}


_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t):
    """The tensor's bit patterns (floating and complex entries as integers), so that -0.0 and
    0.0, or two NaN payloads, count as different."""
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point():
        t = t.contiguous().view(_SAME_SIZE_INT[t.element_size()])
    return t


def assert_identical(a, b, where="snapshot"):
    """Bit-identical nested dicts / lists of tensors (same dtype, shape and bits)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{where}: {a.dtype}{tuple(a.shape)} " \
                                                         f"!= {b.dtype}{tuple(b.shape)}"
        if not torch.equal(bits(a), bits(b)):
            diff = (a - b).abs().max().item() if a.is_floating_point() or a.is_complex() else "-"
            raise AssertionError(f"{where}: not bit-identical (max |diff| {diff})")
    elif isinstance(a, Mapping):  # a preconditioner's per-parameter state is a live Mapping
        assert isinstance(b, Mapping), f"{where}: {type(b).__name__} is not a mapping"
        assert a.keys() == b.keys(), f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for key in a:
            assert_identical(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_close_relative(a, b, rtol):
    """Every tensor of ``a`` within ``rtol`` of ``b``'s, relative to ``b``'s largest entry."""
    for name, want in b.items():
        error = ((a[name] - want).abs().max() / want.abs().max()).item()
        assert error <= rtol, f"{name}: relative difference {error:.3g} > {rtol:g}"


def differs(a, b):
    try:
        assert_identical(a, b)
    except AssertionError:
        return True
    return False


# complex parameter (behaviour 7): z, and a nonlinear real loss term of it
Z0 = torch.tensor([0.3 + 0.4j, -0.5 + 0.1j, 0.2 - 0.7j], dtype=torch.complex128)
C = torch.tensor([1 - 1j, 0.5 + 2j, -1 + 0.25j], dtype=torch.complex128)


def complex_term(z):
    return 0.1 * ((z * z - C.to(z.dtype)).abs() ** 2).sum()


def bad_parameter(kind, dtype=F64):
    """(parameter, loss term) giving a gradient the step refuses: a complex parameter (always
    complex128: the refusal is of complex numbers, whatever the model's dtype), or an
    embedding in ``dtype`` whose gradient is sparse."""
    if kind == "complex":
        z = nn.Parameter(Z0.clone())
        return z, lambda: complex_term(z)
    torch.manual_seed(5)
    emb = nn.Embedding(5, 3, sparse=True).to(dtype)
    rows = torch.tensor([1, 3, 3])
    return emb.weight, lambda: emb(rows).pow(2).sum()


# -- 1. construction and hyperparameters ----------------------------------------------------------


@pytest.mark.parametrize("case,dtype", case_dtypes_for("construct"))
def test_construction_from_list_named_parameters_groups_and_add_param_group(case, dtype):
    """A parameter list and ``model.named_parameters()`` (torch 2.x records the names in the
    group's ``param_names``) give bit-identical training; group dicts carry per-group
    hyperparameters (a group at lr = 0 stays put while the other moves); ``add_param_group``
    fills the new group from the defaults and its parameter trains.  Reference: AdamW / SGD."""
    m_list, m_named = tiny_model(dtype), tiny_model(dtype)
    o_list = case.make(m_list, list(m_list.parameters()))
    o_named = case.make(m_named, m_named.named_parameters())
    names = [name for name, _ in m_named.named_parameters()]
    assert o_named.param_groups[0]["param_names"] == names
    assert o_named.state_dict()["param_groups"][0]["param_names"] == names
    train(case, m_list, o_list, 2)
    train(case, m_named, o_named, 2)
    assert_identical(params_of(m_list), params_of(m_named))

    model = tiny_model(dtype)
    rest = [model.fc2.weight, model.fc2.bias, model.gain]
    opt = case.make(model, [{"params": list(model.fc1.parameters()), **case.zero_lr},
                            {"params": rest}])
    assert opt.param_groups[0]["lr"] == 0.0 and opt.param_groups[1]["lr"] == case.hyper["lr"]
    before = params_of(model)
    train(case, model, opt, 2)
    after = params_of(model)
    assert all(torch.equal(after[n], before[n]) for n in ("fc1.weight", "fc1.bias"))
    assert all(not torch.equal(after[n], before[n]) for n in ("fc2.weight", "fc2.bias", "gain"))

    # the new group's lr: 2 lr, so that one step moves gain (~1) in bf16 too (half an ulp of
    # 1.2 is 2^-8 ~ 0.004; MARS's 1-D fallback steps by lr * lr_1d / lr0 = 0.3 * 2 lr = 0.006)
    model = tiny_model(dtype)
    opt = case.make(model, [model.fc1.weight, model.fc1.bias, model.fc2.weight, model.fc2.bias])
    opt.add_param_group({"params": [model.gain], "lr": case.hyper["lr"] * 2})
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == case.hyper["lr"] * 2
    assert set(opt.param_groups[0]) <= set(opt.param_groups[1])  # defaults filled in
    gain = model.gain.detach().clone()
    train(case, model, opt, 1)
    assert not torch.equal(model.gain, gain) and opt.state.get(model.gain)


@pytest.mark.parametrize("case", cases_for("bad_hyper_ctor"))
def test_bad_hyperparameter_in_constructor_raises_value_error_naming_it(case):
    """``lr=-1`` and one optimizer-specific value out of range raise ValueError whose message
    names the hyperparameter (torch's AdamW / SGD say "learning rate").  Reference: AdamW /
    SGD."""
    for overrides, pattern in case.bad_hyper:
        with pytest.raises(ValueError, match=pattern):
            case.make(tiny_model(), **overrides)


@pytest.mark.parametrize("case", cases_for("bad_hyper_group"))
def test_bad_hyperparameter_in_group_dict_raises_value_error_naming_it(case):
    """The same values in a parameter-group dict, at construction and through
    ``add_param_group`` (which then leaves the groups as they were).  No reference: torch checks
    only its constructor arguments (AdamW and SGD accept a group with lr=-1, measured)."""
    for overrides, pattern in case.bad_hyper:
        model = tiny_model()
        with pytest.raises(ValueError, match=pattern):
            case.make(model, [{"params": list(model.parameters()), **overrides}])
        opt = case.make(model, list(model.fc1.parameters()))
        with pytest.raises(ValueError, match=pattern):
            opt.add_param_group({"params": [model.gain], **overrides})
        assert len(opt.param_groups) == 1


# -- 2. hooks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("case,dtype", case_dtypes_for("hooks"))
def test_every_optimizer_hook_fires_once_per_call_with_the_optimizer(case, dtype):
    """``register_step_{pre,post}_hook``, ``register_state_dict_{pre,post}_hook`` and
    ``register_load_state_dict_{pre,post}_hook``: each fires once per call, in that order,
    with the optimizer as its first argument.  Reference: AdamW / SGD."""
    model = tiny_model(dtype)
    opt = case.make(model)
    calls = []

    def record(kind):
        def hook(optimizer, *rest):
            calls.append((kind, optimizer is opt))
        return hook

    opt.register_step_pre_hook(record("step_pre"))
    opt.register_step_post_hook(record("step_post"))
    opt.register_state_dict_pre_hook(record("state_dict_pre"))
    opt.register_state_dict_post_hook(record("state_dict_post"))
    opt.register_load_state_dict_pre_hook(record("load_pre"))
    opt.register_load_state_dict_post_hook(record("load_post"))
    train_step(case, model, opt, 0)
    assert calls == [("step_pre", True), ("step_post", True)]
    calls.clear()
    saved = opt.state_dict()
    assert calls == [("state_dict_pre", True), ("state_dict_post", True)]
    calls.clear()
    opt.load_state_dict(saved)
    assert calls == [("load_pre", True), ("load_post", True)]


REMAP = [pytest.param(*p.values, {}, id=p.id, marks=p.marks)
         for p in case_dtypes_for("load_hook_remap")]
REMAP += [pytest.param(*p.values, {"state_dtype": torch.float32}, id=f"{p.id}-state_dtype",
                       marks=p.marks)
          for p in case_dtypes_for("load_hook_remap") if p.values[0].applies("state_dtype")]


@pytest.mark.parametrize("case,dtype,overrides", REMAP)
def test_load_state_dict_pre_hook_that_swaps_two_states_is_honoured(case, dtype, overrides):
    """A load pre-hook returns the checkpoint with the states of the two same-shaped biases
    swapped; the loaded optimizer holds the swapped states (also with MARS's ``state_dtype``,
    whose load re-casts the state).  Reference: AdamW / SGD."""
    model = tiny_model(dtype)
    opt = case.make(model, **overrides)
    train(case, model, opt, 2)
    saved = copy.deepcopy(opt.state_dict())
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}  # the saved ids
    b1, b2 = index["fc1.bias"], index["fc2.bias"]
    assert differs(saved["state"][b1], saved["state"][b2])  # a swap is visible

    def swap(optimizer, state_dict):
        state = dict(state_dict["state"])
        state[b1], state[b2] = state[b2], state[b1]
        return {**state_dict, "state": state}

    fresh = tiny_model(dtype, seed=1)
    loaded = case.make(fresh, **overrides)
    loaded.register_load_state_dict_pre_hook(swap)
    loaded.load_state_dict(saved)
    assert_identical(dict(loaded.state[fresh.fc1.bias]), saved["state"][b2], "fc1.bias")
    assert_identical(dict(loaded.state[fresh.fc2.bias]), saved["state"][b1], "fc2.bias")


# -- 3. checkpoints and copies --------------------------------------------------------------------


@pytest.mark.parametrize("case,dtype", case_dtypes_for("checkpoint"))
def test_state_dict_through_torch_save_and_load_continues_bit_identically(case, dtype):
    """Two steps, ``torch.save`` of the model's and the optimizer's state_dict, ``torch.load``
    (weights_only=True, the default) into a fresh model (other initial weights) and a fresh
    optimizer -- for MKOR / K-FAC a new preconditioner on the new model -- then two more steps:
    bit-identical to four uninterrupted steps (parameters and state).  Reference: AdamW / SGD."""
    m_run = tiny_model(dtype)
    o_run = case.make(m_run)
    train(case, m_run, o_run, 4)

    m_first = tiny_model(dtype)
    o_first = case.make(m_first)
    train(case, m_first, o_first, 2)
    buffer = io.BytesIO()
    torch.save({"model": m_first.state_dict(), "opt": o_first.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    m_resumed = tiny_model(dtype, seed=1)
    m_resumed.load_state_dict(checkpoint["model"])
    o_resumed = case.make(m_resumed)
    o_resumed.load_state_dict(checkpoint["opt"])
    train(case, m_resumed, o_resumed, 2, start=2)
    assert_identical(snapshot(m_run, o_run), snapshot(m_resumed, o_resumed))


@pytest.mark.parametrize("case,dtype", case_dtypes_for("copy"))
def test_deepcopy_and_pickle_of_model_and_optimizer_continue_bit_identically(case, dtype):
    """``copy.deepcopy((model, opt))`` and a pickle round trip of the pair (as torch's tests copy
    them together), then each copy and the original train on independently: all three stay
    bit-identical, so the copies share no tensor with the original.  Reference: AdamW / SGD."""
    model = tiny_model(dtype)
    opt = case.make(model)
    train(case, model, opt, 2)
    copies = [copy.deepcopy((model, opt)), pickle.loads(pickle.dumps((model, opt)))]
    for m, o in [(model, opt)] + copies:
        train(case, m, o, 2, start=2)
    for m, o in copies:
        assert_identical(snapshot(model, opt), snapshot(m, o))


@pytest.mark.parametrize("case,dtype", case_dtypes_for("copy_refused"))
def test_preconditioner_refuses_deepcopy_and_pickle_pointing_to_state_dict(case, dtype):
    """``copy.deepcopy(pre)`` and ``pickle.dumps(pre)`` raise TypeError whose message points to
    ``state_dict`` (the preconditioner is bound to its model by hooks).  No reference: a plain
    torch optimizer copies (behaviour ``copy``)."""
    model = tiny_model(dtype)
    pre = case.make(model)
    train(case, model, pre, 1)
    with pytest.raises(TypeError, match="state_dict"):
        copy.deepcopy(pre)
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(pre)


@pytest.mark.parametrize("case,dtype", case_dtypes_for("model_copy_inert"))
def test_deepcopy_of_the_hooked_model_does_not_change_the_originals_step(case, dtype):
    """``copy.deepcopy(model)`` of the hooked model works, and a forward + backward of the copy,
    run between the original's backward and its step, leaves that step and the next one
    bit-identical to a run without the copy.  Reference: SGD (nothing hooks the model)."""
    runs = []
    for with_copy in (False, True):
        model = tiny_model(dtype)
        opt = case.make(model)
        train(case, model, opt, 2)
        opt.zero_grad(set_to_none=True)
        loss_of(model, 2).backward()
        if with_copy:
            twin = copy.deepcopy(model)
            loss_of(twin, 7).backward()
        opt.step()
        train(case, model, opt, 1, start=3)
        runs.append(snapshot(model, opt))
    assert_identical(*runs)


# -- 4. schedulers --------------------------------------------------------------------------------


def scheduled_equals_by_hand(case, make_scheduler, keys, dtype=F64):
    """Three steps under the scheduler, recording ``keys`` of every group before each step; a
    second run sets the recorded values by hand: bit-identical.  A third run at the constant
    hyperparameters ends elsewhere (the schedule acted)."""
    model = tiny_model(dtype)
    opt = case.make(model)
    scheduler = make_scheduler(opt)
    seen = []
    for t in range(3):
        seen.append([{k: group[k] for k in keys} for group in opt.param_groups])
        train_step(case, model, opt, t)
        scheduler.step()
    by_hand_model = tiny_model(dtype)
    by_hand = case.make(by_hand_model)
    for t in range(3):
        for group, values in zip(by_hand.param_groups, seen[t]):
            group.update(values)
        train_step(case, by_hand_model, by_hand, t)
    scheduled = without_groups(snapshot(model, opt))
    assert_identical(scheduled, without_groups(snapshot(by_hand_model, by_hand)))
    constant_model = tiny_model(dtype)
    constant = case.make(constant_model)
    train(case, constant_model, constant, 3)
    assert differs(scheduled, without_groups(snapshot(constant_model, constant)))


SCHEDULES = {"StepLR": lambda opt: StepLR(opt, step_size=1, gamma=0.5),
             "LambdaLR": lambda opt: LambdaLR(opt, lambda t: 1.0 / (1 + t) ** 2)}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("case,dtype", case_dtypes_for("schedulers"))
def test_lr_scheduler_equals_setting_lr_by_hand(case, dtype, schedule):
    """``StepLR`` / ``LambdaLR`` on ``lr``: bit-identical to writing the same lr into
    ``param_groups`` by hand before each step.  Reference: AdamW / SGD."""
    scheduled_equals_by_hand(case, SCHEDULES[schedule], ("lr",), dtype)


@pytest.mark.parametrize("case,dtype", case_dtypes_for("onecycle"))
def test_one_cycle_with_cycle_momentum_equals_setting_lr_and_momentum_by_hand(case, dtype):
    """``OneCycleLR(cycle_momentum=True)`` drives ``lr`` and ``betas[0]`` (AdamW, MARS, LAMB) or
    ``momentum`` (MARS-M; the SGD backbone of MKOR / K-FAC): bit-identical to writing the same
    values by hand.  Reference: AdamW (betas) / SGD (momentum)."""
    scheduled_equals_by_hand(
        case, lambda opt: OneCycleLR(opt, max_lr=case.hyper["lr"], total_steps=4,
                                     cycle_momentum=True), ("lr", case.momentum_key), dtype)


# -- 5. torch.compile -----------------------------------------------------------------------------

# Tolerance of compiled against eager, float32 (unit roundoff u = 2^-24 = 6e-8).  Inductor may
# fuse, contract a*b+c into an FMA and reorder the reductions (the clip and trust-ratio norms),
# which changes each intermediate by a few u relative.  The update of a step is bounded by
# lr * |u_t| with |u_t| <= ~3 here (Adam-like ratios, sign, a Newton-Schulz output of spectral norm
# ~1 scaled by sqrt(max(A,B)) <= 2); its relative error is at most ~10 u per elementwise op chain,
# and the five quintic Newton-Schulz iterations (ns_dtype float64 here, so they add nothing in
# float32) are computed in float64.  Over 3 steps at lr <= 0.1: |dp| <= 3 * 0.1 * 3 * 100 u ~ 5e-6,
# plus the rounding of p itself to float32 (1 ulp of |p| <= 1.5, 1.2e-7 each step).  So
# atol = 2e-5 (about 4x that bound), rtol = 1e-5.  (A Lion sign flip of an entry of m within
# rounding of 0 would exceed it; none occurs on these batches.)
COMPILE_ATOL, COMPILE_RTOL = 2e-5, 1e-5


def compile_tolerance(case, dtype):
    """(atol, rtol) of compiled against eager: float32's above; bf16 (u = 2^-8) derived here.
    Eager rounds every intermediate of a step to bf16, Inductor keeps a fused chain in float32
    and rounds where it stores.  So the two stored parameters may land on neighbouring bf16
    numbers at each step -- one ulp of |p| per step, rtol = 3 eps = 6 u over 3 steps (the
    states m, v likewise, which changes the next update by ~u relative: inside the next
    term) -- and the update lr u_t (|u_t| <= ~3) differs by eager's roundings, <= ~10 u of
    it: atol = 3 steps * 10 u * 3 lr (7e-3 at lr = 0.01 in bf16; measured <= 3.9e-3, at
    |p| >= 0.5 where rtol allows 1.2e-2).  fp16 has no such bound: ``LOW_PRECISION_SKIPS``."""
    if dtype == torch.float32:
        return COMPILE_ATOL, COMPILE_RTOL
    u = torch.finfo(dtype).eps / 2
    return 3 * 10 * u * 3 * case.hyper["lr"], 6 * u


@pytest.mark.parametrize("case,dtype", case_dtypes_for("compile"))
def test_compiled_step_equals_eager_within_float32_tolerance(case, dtype):
    """``step = torch.compile(opt.step)`` called after ``backward()`` for 3 float32 (and bf16)
    steps equals the eager step within the tolerance derived above.  Reference: AdamW / SGD."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    runs = []
    for compiled in (False, True):
        model = tiny_model(dtype)
        opt = case.make(model)
        step = torch.compile(opt.step) if compiled else opt.step
        for t in range(3):
            opt.zero_grad(set_to_none=True)
            loss_of(model, t).backward()
            step()
        runs.append(params_of(model))
    graphs = compiled_graphs()
    torch._dynamo.reset()
    assert graphs >= 1  # the step was compiled, not only run eagerly
    eager, compiled = runs
    atol, rtol = compile_tolerance(case, dtype)
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], atol=atol, rtol=rtol,
                                   msg=lambda m: f"{name}: {m}")


# -- 6. low precision -----------------------------------------------------------------------------


def low_precision_run(case, dtype, **overrides):
    model = tiny_model(dtype)
    before = params_of(model)
    opt = case.make(model, **overrides)
    train(case, model, opt, 2)
    after = params_of(model)
    assert all(p.dtype == dtype for p in after.values()), {n: p.dtype for n, p in after.items()}
    assert all(torch.isfinite(p).all() for p in after.values())
    assert any(not torch.equal(after[n], before[n]) for n in after)
    return opt


@pytest.mark.parametrize("case", cases_for("bf16"))
def test_bf16_parameters_keep_their_dtype_and_the_step_runs(case):
    """bf16 parameters: two steps run, every parameter stays bf16 and finite, and the step
    moves them.  Reference: AdamW / SGD."""
    low_precision_run(case, torch.bfloat16)


@pytest.mark.parametrize("case", cases_for("fp16"))
def test_fp16_parameters_keep_their_dtype_and_the_step_runs(case):
    """The same for fp16 parameters on the CPU (AdamW needs eps above fp16's underflow,
    ``conformance_cases.ADAMW_FP16``).  Reference: AdamW / SGD."""
    low_precision_run(case, torch.float16, **case.low_precision.get("fp16", {}))


def state_tensors(opt):
    """(name, tensor) of the floating state a ``state_dtype`` governs (not ``step``, nor
    exact mode's ``prev_param``, which keeps the parameter's dtype)."""
    return [(k, v) for st in opt.state.values() for k, v in st.items()
            if torch.is_tensor(v) and v.is_floating_point() and k not in ("step", "prev_param")]


@pytest.mark.parametrize("case", cases_for("state_dtype"))
def test_state_dtype_float32_keeps_float32_state_for_bf16_parameters(case):
    """bf16 parameters with ``state_dtype=torch.float32``: the parameters stay bf16 and every
    moment / gradient buffer is float32.  No reference: torch has no state_dtype."""
    opt = low_precision_run(case, torch.bfloat16, state_dtype=torch.float32)
    assert {k: v.dtype for k, v in state_tensors(opt)} == \
        {k: torch.float32 for k, _ in state_tensors(opt)}


@pytest.mark.parametrize("case", cases_for("state_dtype"))
def test_bf16_state_with_float32_parameters_at_lr0_leaves_them_bit_identical(case):
    """float32 parameters with ``state_dtype=torch.bfloat16`` and lr = 0: the state is bf16 and
    the parameters do not change by a single bit (the update is computed in float32 and is
    exactly 0).  No reference: torch has no state_dtype."""
    model = tiny_model(torch.float32)
    before = params_of(model)
    opt = case.make(model, state_dtype=torch.bfloat16, **case.zero_lr)
    train(case, model, opt, 2)
    assert_identical(before, params_of(model))
    assert state_tensors(opt) and all(v.dtype == torch.bfloat16 for _, v in state_tensors(opt))


# -- 7. complex parameters, sparse gradients ------------------------------------------------------


# Complex against its real view, float64: an optimizer that steps the real view (AdamW, LAMB)
# does the same operations on the same numbers: bit-identical (``case.complex_exact``).  One that
# steps the complex tensor (SGD, the backbone of MKOR / K-FAC) multiplies by real scalars in
# complex arithmetic, which the vectorised kernels may round differently from the real product
# (measured: 1 ulp, 2.8e-17 on entries ~0.3).  A few ulp per step over three steps of O(1)
# sensitivity: 1e-14 relative to the tensor's largest entry (~50x margin).  fp16 (complex32
# against the fp16 real view), the same count in fp16's eps = 2^-10: at most half an ulp per
# rounding that differs, three per step (buffer scale, buffer add, parameter update), three
# steps: 4.5 ulp of the largest entry, plus the gradient's dependence on that drift
# (lr |dg/dz| <= 0.1 * 0.8 per step): 8 eps = 7.8e-3 (measured 3.2e-4, 0.33 eps).
COMPLEX_RTOL = {torch.float64: 1e-14, torch.float16: 8 * torch.finfo(torch.float16).eps}


COMPLEX_OF = {torch.float64: torch.complex128, torch.float16: torch.complex32}


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("case,dtype", case_dtypes_for("complex_equal"))
def test_complex_parameter_equals_its_view_as_real(case, dtype):
    """A complex parameter z (complex128; complex32 with fp16 models) trains as the real
    parameter ``torch.view_as_real(z)`` does under the same loss (torch's AdamW steps the real
    view), three steps: bit-identical, or within the tolerance derived above for SGD.
    Reference: AdamW / SGD."""
    z0 = Z0.to(COMPLEX_OF[dtype])
    model = tiny_model(dtype)
    z = nn.Parameter(z0.clone())
    opt = case.make(model, list(model.parameters()) + [z])
    train(case, model, opt, 3, extra=lambda: complex_term(z))

    real_model = tiny_model(dtype)
    r = nn.Parameter(torch.view_as_real(z0.clone()).clone())
    real_opt = case.make(real_model, list(real_model.parameters()) + [r])
    train(case, real_model, real_opt, 3, extra=lambda: complex_term(torch.view_as_complex(r)))
    assert not torch.equal(torch.view_as_real(z.detach()), torch.view_as_real(z0))  # (no
    # torch.equal for complex32)
    as_complex = params_of(model, torch.view_as_real(z.detach()))
    if case.complex_exact:
        assert_identical(as_complex, params_of(real_model, r))
    else:
        assert_close_relative(as_complex, params_of(real_model, r), COMPLEX_RTOL[dtype])


def refused_with_nothing_changed(case, kind, dtype=F64):
    model = tiny_model(dtype)
    bad, term = bad_parameter(kind, dtype)
    opt = case.make(model, list(model.parameters()) + [bad])
    train(case, model, opt, 1)  # `bad` takes no part yet: state for the others only
    before = snapshot(model, opt, bad)
    with pytest.raises((RuntimeError, ValueError), match=kind):
        train_step(case, model, opt, 1, extra=term)
    assert_identical(before, snapshot(model, opt, bad))


@pytest.mark.parametrize("case,dtype", case_dtypes_for("complex_refused"))
def test_complex_parameter_is_refused_with_nothing_changed(case, dtype):
    """A step with a gradient on a complex parameter raises RuntimeError / ValueError mentioning
    "complex", and leaves every parameter and the whole state bit-identical.  No reference:
    AdamW supports complex parameters (behaviour complex_equal)."""
    refused_with_nothing_changed(case, "complex", dtype)


@pytest.mark.parametrize("case,dtype", case_dtypes_for("sparse_refused"))
def test_sparse_gradient_is_refused_with_nothing_changed(case, dtype):
    """A step with the sparse gradient of an ``nn.Embedding(sparse=True)`` raises an error
    mentioning "sparse", and leaves every parameter and the whole state bit-identical.
    Reference: AdamW (RuntimeError "Adam does not support sparse gradients")."""
    refused_with_nothing_changed(case, "sparse", dtype)


@pytest.mark.parametrize("case,dtype", case_dtypes_for("sparse_passed"))
def test_sparse_gradient_reaches_the_backbone_as_in_sgd_alone(case, dtype):
    """MKOR / K-FAC leave a sparse embedding gradient to the backbone: the embedding trains
    bit-identically to SGD alone (which supports sparse gradients).  Reference: SGD."""
    runs = []
    for which in (case, BY_NAME["sgd_reference"]):
        model = tiny_model(dtype)
        weight, term = bad_parameter("sparse", dtype)
        opt = which.make(model, list(model.parameters()) + [weight])
        train(which, model, opt, 2, extra=term)
        assert weight.grad.is_sparse
        runs.append(weight.detach().clone())
    assert_identical(*runs)


# -- 8. parameters without gradients, frozen parameters, a parameter in two groups ----------------


@pytest.mark.parametrize("case,dtype", case_dtypes_for("no_grad"))
def test_parameters_without_gradients_get_no_state_and_do_not_move(case, dtype):
    """A parameter that never enters the loss (grad None): unchanged, no state.  Reference:
    AdamW / SGD."""
    model = tiny_model(dtype)
    unused = nn.Parameter(torch.ones(3, 3, dtype=dtype))
    opt = case.make(model, list(model.parameters()) + [unused])
    train(case, model, opt, 2)
    assert torch.equal(unused, torch.ones(3, 3, dtype=dtype))
    assert not opt.state.get(unused)
    assert all(opt.state.get(p) for p in model.parameters())


def _own(opt, param, copy_fn=lambda x: x):
    """``opt.state[param]`` without a preconditioner's run entry (``mkor_run`` / ``kfac_run``:
    the step count and switch of the whole run, which rides on the first parameter, frozen or
    not; :mod:`torch_impl.kronecker.state_layout`)."""
    state = opt.state.get(param)
    if state is None:
        return None
    return copy_fn({k: v for k, v in state.items() if not k.endswith("_run")})


def _sat_out(state):
    """The state of a parameter after steps it sat out: as it was, but for MARS's and
    MARS-M's ``last_grad``, g_{t-1} of a step outside the loss, which is 0 (M2; the rule of
    ``theory_tests/mars/test_missing_gradients.py``)."""
    if state and "last_grad" in state:
        state["last_grad"] = torch.zeros_like(state["last_grad"])
    return state


@pytest.mark.parametrize("case,dtype", case_dtypes_for("freeze"))
def test_parameter_frozen_mid_training_stops_and_the_others_train_as_without_it(case, dtype):
    """After two steps ``case.frozen`` get ``requires_grad=False`` and ``grad=None``: for two more
    steps they and their state stay as they were (MARS's and MARS-M's ``last_grad`` becomes 0:
    ``_sat_out``), and the other parameters end bit-identical
    to a run in which those parameters were never optimized (constants following the same
    values).  Reference: AdamW / SGD, which behave so (the spec)."""
    model = tiny_model(dtype)
    opt = case.make(model)
    named = dict(model.named_parameters())
    history = []
    for t in range(2):
        history.append({n: named[n].detach().clone() for n in case.frozen})
        train_step(case, model, opt, t)
    for n in case.frozen:
        named[n].requires_grad_(False)
        named[n].grad = None
    frozen = {n: named[n].detach().clone() for n in case.frozen}
    frozen_state = {n: _sat_out(_own(opt, named[n], copy.deepcopy)) for n in case.frozen}
    train(case, model, opt, 2, start=2)
    assert_identical(frozen, {n: named[n].detach() for n in case.frozen})
    assert_identical(frozen_state, {n: _own(opt, named[n]) for n in case.frozen})

    constants_model = tiny_model(dtype)
    constants = dict(constants_model.named_parameters())
    for n in case.frozen:
        constants[n].requires_grad_(False)
    others = [p for n, p in constants_model.named_parameters() if n not in case.frozen]
    constants_opt = case.make(constants_model, others)
    for t in range(4):
        with torch.no_grad():
            for n, value in (history[t] if t < 2 else frozen).items():
                constants[n].copy_(value)
        train_step(case, constants_model, constants_opt, t)
    assert_identical(params_of(model), params_of(constants_model))


@pytest.mark.parametrize("case", cases_for("duplicate_param"))
def test_parameter_in_two_groups_raises_value_error(case):
    """A parameter listed in two groups: ValueError at construction (torch's check).
    Reference: AdamW / SGD."""
    model = tiny_model()
    with pytest.raises(ValueError, match="more than one parameter group"):
        case.make(model, [{"params": [model.fc1.weight]},
                          {"params": [model.fc1.weight, model.fc1.bias]}])


# -- 9. maximize, foreach -------------------------------------------------------------------------


@pytest.mark.parametrize("case,dtype", case_dtypes_for("maximize"))
def test_maximize_equals_minimising_the_negated_loss(case, dtype):
    """``maximize=True`` on the loss L equals the default on -L, bit for bit (parameters and
    state), over three steps (negation is exact).  For MKOR / K-FAC ``maximize`` is the SGD
    backbone's.  Reference: AdamW / SGD."""
    m_max = tiny_model(dtype)
    o_max = case.make(m_max, maximize=True)
    train(case, m_max, o_max, 3)
    m_min = tiny_model(dtype)
    o_min = case.make(m_min)
    train(case, m_min, o_min, 3, sign=-1.0)
    assert_identical(without_groups(snapshot(m_min, o_min)),
                     without_groups(snapshot(m_max, o_max)))


@pytest.mark.parametrize("case,dtype", case_dtypes_for("foreach"))
def test_foreach_equals_the_per_tensor_loop(case, dtype):
    """``foreach=True`` equals ``foreach=False`` bit for bit (three steps; float64, bf16, fp16):
    on the CPU the foreach kernels run the same elementwise operations tensor by tensor, in the
    same order (a different association of an operation chain would show up here first), and
    ours multiply by a number as the loop does in bf16 / fp16 too (``tensor_ops.scalar_operand``:
    torch's CPU ``_foreach_mul_`` rounds the number to the dtype, which is why torch's SGD is an
    xfail there).  For MKOR / K-FAC ``foreach`` is the SGD backbone's.  Reference: AdamW / SGD."""
    runs = []
    for foreach in (True, False):
        model = tiny_model(dtype)
        opt = case.make(model, foreach=foreach)
        train(case, model, opt, 3)
        runs.append(snapshot(model, opt))
    assert_identical(without_groups(runs[0]), without_groups(runs[1]))


# -- 10. GradScaler -------------------------------------------------------------------------------

MAX_NORM = 0.05  # below the gradient norms of these batches, so the clip acts


@pytest.mark.parametrize("case,dtype", case_dtypes_for("grad_scaler"))
def test_grad_scaler_with_unscale_and_clipping_equals_the_unscaled_loop(case, dtype):
    """``scaler.scale(loss).backward(); scaler.unscale_(opt); clip_grad_norm_; scaler.step(opt);
    scaler.update()`` with ``torch.amp.GradScaler("cpu", init_scale=2**10)`` equals
    ``loss.backward(); clip_grad_norm_; opt.step()`` bit for bit: the scale is a power of two,
    so scaling every backward quantity and unscaling the gradients is exact in float64 and bf16
    (float32's exponent range: no overflow or underflow here; torch refuses fp16 gradients), and
    MKOR / K-FAC divide their statistics by the same scale
    (their documented loop passes ``grad_scaler=scaler``).  Then a step whose gradient holds an
    inf changes nothing (parameters, state, factors) and halves the scale.  Reference: AdamW /
    SGD."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaled_model = tiny_model(dtype)
    scaled = case.make(scaled_model, **({"grad_scaler": scaler} if case.scaler_keyword else {}))
    plain_model = tiny_model(dtype)
    plain = case.make(plain_model)
    norms = []
    for t in range(3):
        scaled.zero_grad(set_to_none=True)
        scaler.scale(loss_of(scaled_model, t)).backward()
        scaler.unscale_(scaled)
        torch.nn.utils.clip_grad_norm_(scaled_model.parameters(), MAX_NORM)
        scaler.step(scaled)
        scaler.update()
        plain.zero_grad(set_to_none=True)
        loss_of(plain_model, t).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(plain_model.parameters(), MAX_NORM))
        plain.step()
    assert max(norms) > MAX_NORM  # the clip acted
    assert_identical(snapshot(plain_model, plain), snapshot(scaled_model, scaled))

    before, scale = snapshot(scaled_model, scaled), scaler.get_scale()
    scaled.zero_grad(set_to_none=True)
    scaler.scale(loss_of(scaled_model, 3)).backward()
    with torch.no_grad():
        scaled_model.fc2.weight.grad[0, 0] = float("inf")
    scaler.unscale_(scaled)
    torch.nn.utils.clip_grad_norm_(scaled_model.parameters(), MAX_NORM)
    scaler.step(scaled)
    scaler.update()
    assert_identical(before, snapshot(scaled_model, scaled))
    assert scaler.get_scale() == scale / 2


# -- 11. atomic failure ---------------------------------------------------------------------------

ATOMIC = [pytest.param(*p.values, kind, id=f"{p.id}-{kind}", marks=p.marks)
          for p in case_dtypes_for("atomic") for kind in sorted(p.values[0].rejects)]


@pytest.mark.parametrize("case,dtype,kind", ATOMIC)
def test_bad_gradient_in_the_second_group_leaves_the_first_untouched(case, dtype, kind):
    """Group 1 holds the model, group 2 a parameter with a refused gradient (complex, or sparse):
    the step raises and group 1's parameters and the whole state are bit-identical to before;
    the same step without the bad gradient then moves group 1 (the check is not vacuous).  No
    reference: torch's AdamW updates the first group before raising on the second (measured)."""
    model = tiny_model(dtype)
    bad, term = bad_parameter(kind, dtype)
    opt = case.make(model, [{"params": list(model.parameters())}, {"params": [bad]}])
    train(case, model, opt, 1)
    before = snapshot(model, opt, bad)
    with pytest.raises((RuntimeError, ValueError), match=kind):
        train_step(case, model, opt, 1, extra=term)
    assert_identical(before, snapshot(model, opt, bad))
    train_step(case, model, opt, 1)
    assert differs(before["params"], params_of(model, bad))


# -- 12. fused / capturable / differentiable ------------------------------------------------------

TORCH_FLAGS = ("fused", "capturable", "differentiable")


@pytest.mark.parametrize("flag", TORCH_FLAGS)
@pytest.mark.parametrize("case,dtype", case_dtypes_for("torch_flags_off"))
def test_torch_flag_off_is_accepted(case, dtype, flag):
    """``fused`` / ``capturable`` / ``differentiable`` = False in the constructor and in a group
    dict: accepted, and a step runs.  Reference: AdamW."""
    model = tiny_model(dtype)
    opt = case.make(model, **{flag: False})
    train(case, model, opt, 1)
    model = tiny_model(dtype)
    opt = case.make(model, [{"params": list(model.parameters()), flag: False}])
    train(case, model, opt, 1)


@pytest.mark.parametrize("flag", TORCH_FLAGS)
@pytest.mark.parametrize("case", cases_for("torch_flags_on"))
def test_torch_flag_on_is_refused_with_value_error_naming_it(case, flag):
    """The same keyword = True: ValueError naming it, in the constructor and in a group dict (the
    optimizer has no such implementation, and silently ignoring it would hide that).  No
    reference: torch's AdamW implements all three."""
    model = tiny_model()
    with pytest.raises(ValueError, match=flag):
        case.make(model, **{flag: True})
    with pytest.raises(ValueError, match=flag):
        case.make(model, [{"params": list(model.parameters()), flag: True}])


# -- the notes ------------------------------------------------------------------------------------


def test_notes_table_is_the_registry():
    """theory_tests/conformance/README.md shows ``applicability_table()``: the table cannot drift from
    what the battery runs.  Regenerate with
    ``python -c "import theory_tests.support.conformance_cases as c;
    print(c.applicability_table())"``."""
    notes = (Path(__file__).resolve().parent / "README.md").read_text()
    assert applicability_table() in notes
    assert all(f"`{key}`" in notes for key in BEHAVIOURS)
