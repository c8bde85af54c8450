"""``torch_impl.MARS`` against the torch.optim contract (CONVENTIONS.md section 2) and the state
properties MT6, MT16 (lr = 0), MT19, MT20: copies not aliases, parity, checkpoints, validation.
"""
import copy
import io

import numpy as np
import pytest
import torch

from theory_tests.support.mars_harness import batches, initial_params, torch_loss
from theory_tests.support.mars_property_helpers import F64, MARS_TYPES, assert_same_optimizer, clone_params, \
    closure_for, feed, make_params, random_grads, snapshot
from torch_impl import MARS


# ------------------------------------------------------------------ MT6: raw last_grad (B1)

@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("mars_type", MARS_TYPES)
def test_mt6_last_grad_is_a_copy_of_the_raw_gradient(mars_type, foreach):
    params = make_params([(3, 4), (4, 2)])
    opt = MARS(params, gamma=0.5, mars_type=mars_type, foreach=foreach)
    rng = np.random.default_rng(0)
    for _ in range(3):
        grads = random_grads(rng, [(3, 4), (4, 2)], scale=5.0)
        feed(opt, params, grads)
        for p, g in zip(params, grads):
            st = opt.state[p]
            assert torch.linalg.vector_norm(g) > 1  # so c~ (norm <= 1) cannot equal g
            assert torch.equal(st["last_grad"], g)
            storage = st["last_grad"].untyped_storage().data_ptr()
            assert storage != p.grad.untyped_storage().data_ptr()
    opt.zero_grad(set_to_none=False)
    assert all(torch.all(p.grad == 0) for p in params)
    assert all(torch.equal(opt.state[p]["last_grad"], g) for p, g in zip(params, grads))
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in params)
    assert all(torch.equal(opt.state[p]["last_grad"], g) for p, g in zip(params, grads))


@pytest.mark.parametrize("mars_type", MARS_TYPES)
def test_mt6_trajectory_independent_of_zero_grad_set_to_none(mars_type):
    runs = []
    for set_to_none in (False, True):
        params = [torch.nn.Parameter(torch.tensor(x)) for x in initial_params()]
        opt = MARS(params, lr=1e-2, gamma=0.3, mars_type=mars_type)
        for xi in batches(8):
            opt.step(closure_for(opt, params, torch_loss, xi, set_to_none=set_to_none))
        runs.append((params, opt))
    assert_same_optimizer(*runs[0], *runs[1])


# ------------------------------------------------------------------ MT20: foreach == loop

MLP_SHAPES = [(4, 3), (4,), (2, 4), (2,), (2, 1, 2, 2), (5, 2), (0, 3), (0,)]


def _parity_run(foreach, device, **kw):
    params = make_params(MLP_SHAPES, 11, dtype=F64)
    params = [torch.nn.Parameter(p.detach().to(device)) for p in params]
    opt = MARS(params, lr=1e-2, gamma=0.2, weight_decay=0.1, foreach=foreach, ns_dtype=F64, **kw)
    rng = np.random.default_rng(5)
    for t in range(7):
        grads = [g.to(device) for g in random_grads(rng, MLP_SHAPES, scale=2.0)]
        if t == 2:
            grads = [None] * len(grads)  # a step where no parameter has a gradient
        if t == 4:
            grads[1] = grads[2] = None   # and one where some do not
        feed(opt, params, grads)
    return params, opt


@pytest.mark.parametrize("clip_scope", ["tensor", "global"])
@pytest.mark.parametrize("optimize_1d", [False, True], ids=["fallback", "optimize_1d"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("mars_type", MARS_TYPES)
def test_mt20_foreach_matches_single_tensor(mars_type, amsgrad, optimize_1d, clip_scope, device):
    kw = dict(mars_type=mars_type, amsgrad=amsgrad, optimize_1d=optimize_1d, clip_scope=clip_scope)
    if amsgrad and not _amsgrad_applies(mars_type, optimize_1d):
        with pytest.raises(ValueError, match="amsgrad"):
            _parity_run(False, device, **kw)
        return
    single, foreach = _parity_run(False, device, **kw), _parity_run(True, device, **kw)
    if device.type == "cpu":
        assert_same_optimizer(*single, *foreach)
    else:  # CUDA's _foreach_norm is another kernel than vector_norm: ulp-level float64 slack
        for p, q in zip(single[0], foreach[0]):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("shape", [(0, 3), (3, 0), (0,)])
@pytest.mark.parametrize("orthogonalizer", ["newton_schulz", "svd"])
@pytest.mark.parametrize("mars_type", MARS_TYPES)
def test_zero_size_parameters_step_on_every_route(mars_type, orthogonalizer, shape):
    """A zero-size parameter (e.g. nn.Linear(0, 3).weight, shape (3, 0)) steps like any other."""
    params = make_params([shape, (3, 2)])
    opt = MARS(params, mars_type=mars_type, orthogonalizer=orthogonalizer)
    feed(opt, params, [torch.ones_like(p) for p in params])
    assert opt.state[params[0]]["exp_avg"].shape == shape


# ------------------------------------------------------------------ MT19: checkpoints, state

@pytest.mark.parametrize("via_bytes", [False, True], ids=["in-memory", "torch.save"])
@pytest.mark.parametrize("is_approx", [True, False], ids=["approx", "exact"])
@pytest.mark.parametrize("mars_type", MARS_TYPES)
def test_mt19_state_dict_round_trip_continues_bit_identically(mars_type, is_approx, via_bytes):
    kw = dict(lr=1e-2, gamma=0.3, weight_decay=0.05, mars_type=mars_type, is_approx=is_approx,
              amsgrad=mars_type != "mars-lion", optimize_1d=mars_type == "mars-shampoo",
              ns_dtype=F64)  # (bf16 NS is a pure function of m, and slow on CPU)
    xis = batches(20)
    params = [torch.nn.Parameter(torch.tensor(x)) for x in initial_params()]
    opt = MARS(params, **kw)
    for xi in xis[:10]:
        opt.step(closure_for(opt, params, torch_loss, xi))
    saved = opt.state_dict()
    if via_bytes:
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        buffer.seek(0)
        saved = torch.load(buffer)
    else:  # load_state_dict keeps same-dtype tensors by reference: copy, as torch's own test
        saved = copy.deepcopy(saved)
    twins = clone_params(params)
    twin = MARS(twins, lr=1.0)  # hyperparameters come from the checkpoint
    twin.load_state_dict(saved)
    for xi in xis[10:]:
        opt.step(closure_for(opt, params, torch_loss, xi))
        twin.step(closure_for(twin, twins, torch_loss, xi))
    assert_same_optimizer(params, opt, twins, twin)
    # (the twin may carry keys torch's __setstate__ back-fills, e.g. "differentiable")
    for ours, theirs in zip(opt.param_groups, twin.param_groups):
        assert all(theirs[k] == ours[k] for k in ours if k != "params")


def _amsgrad_applies(mars_type, optimize_1d):
    """amsgrad acts on the AdamW rule only: mars-adamw, or mars-shampoo's non-2-D tensors
    with optimize_1d (otherwise the constructor raises)."""
    return mars_type == "mars-adamw" or (mars_type == "mars-shampoo" and optimize_1d)


def _state_keys(mars_type, is_approx, amsgrad, optimize_1d):
    params = make_params([(3, 4), (4,), (2, 1, 2, 2)])
    opt = MARS(params, mars_type=mars_type, is_approx=is_approx, amsgrad=amsgrad,
               optimize_1d=optimize_1d)
    for _ in range(2):
        opt.step(closure_for(opt, params, lambda ps: sum((p**2).sum() for p in ps)))
    for p in params:
        st = opt.state[p]
        assert st["step"].ndim == 0 and st["step"].device.type == "cpu" and st["step"] == 2
        assert all(v.shape == p.shape and v.dtype == p.dtype for k, v in st.items() if k != "step")
    return [set(opt.state[p]) for p in params]


@pytest.mark.parametrize("optimize_1d", [False, True], ids=["fallback", "optimize_1d"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("is_approx", [True, False], ids=["approx", "exact"])
@pytest.mark.parametrize("mars_type", MARS_TYPES)
def test_mt19_state_keys(mars_type, is_approx, amsgrad, optimize_1d):
    """AdamW rule: {step, exp_avg, exp_avg_sq, last_grad} (+ max_exp_avg_sq with amsgrad);
    Lion and Shampoo matrices: no exp_avg_sq (documented deviation from B6); the fallback:
    {step, exp_avg, exp_avg_sq}; exact mode adds prev_param everywhere."""
    if amsgrad and not _amsgrad_applies(mars_type, optimize_1d):
        with pytest.raises(ValueError, match="amsgrad"):
            _state_keys(mars_type, is_approx, amsgrad, optimize_1d)
        return
    adam = {"step", "exp_avg", "exp_avg_sq", "last_grad"}
    adam |= {"max_exp_avg_sq"} if amsgrad else set()
    lion = {"step", "exp_avg", "last_grad"}
    fallback = {"step", "exp_avg", "exp_avg_sq"}
    matrix = {"mars-adamw": adam, "mars-lion": lion, "mars-shampoo": lion}[mars_type]
    other = fallback if not optimize_1d else (lion if mars_type == "mars-lion" else adam)
    expected = [matrix, other, other]
    if not is_approx:
        expected = [keys | {"prev_param"} for keys in expected]
    assert _state_keys(mars_type, is_approx, amsgrad, optimize_1d) == expected


# ------------------------------------------------------------------ param groups (MT16)

@pytest.mark.parametrize("optimize_1d", [False, True], ids=["fallback", "optimize_1d"])
@pytest.mark.parametrize("mars_type", MARS_TYPES)
def test_group_with_lr_zero_never_moves(mars_type, optimize_1d):
    """Every route (matrix rule, 1-D/4-D fallback or optimize_1d) honours its group's lr = 0,
    weight decay included, while the other group moves."""
    frozen, moving = make_params([(3, 4), (4,), (2, 1, 2, 2)], 1), make_params([(3, 4), (4,)], 2)
    start_frozen, start_moving = snapshot(frozen), snapshot(moving)
    opt = MARS([dict(params=frozen, lr=0.0, weight_decay=0.5),
                dict(params=moving, weight_decay=0.5)],
               lr=1e-2, lr_1d=5e-3, weight_decay_1d=0.2, mars_type=mars_type,
               optimize_1d=optimize_1d)
    rng = np.random.default_rng(0)
    for _ in range(5):
        feed(opt, frozen + moving, random_grads(rng, [p.shape for p in frozen + moving]))
    assert all(torch.equal(p, p0) for p, p0 in zip(frozen, start_frozen))
    assert all(torch.all(p != p0) for p, p0 in zip(moving, start_moving))


# ------------------------------------------------------------------ validation

INVALID = [
    (dict(lr=-1e-3), "lr"), (dict(lr=float("nan")), "lr"), (dict(lr_1d=-1.0), "lr_1d"),
    (dict(lr=0.0), "lr_1d"),  # lr = 0 with the default lr_1d > 0: the ratio is undefined
    (dict(eps=-1e-8), "eps"), (dict(weight_decay=-0.1), "weight_decay"),
    (dict(weight_decay_1d=-0.1), "weight_decay_1d"),
    (dict(betas=(1.0, 0.99)), "betas[0]"), (dict(betas=(-0.1, 0.99)), "betas[0]"),
    (dict(betas=(0.9, 1.0)), "betas[1]"), (dict(betas=(0.9,)), "betas"),
    (dict(betas_1d=(1.5, 0.9)), "betas_1d[0]"), (dict(betas_1d=(0.9, -0.5)), "betas_1d[1]"),
    (dict(gamma=-0.1), "gamma"), (dict(gamma=1.5), "gamma"),
    (dict(mars_type="mars-sgd"), "mars_type"), (dict(clip_scope="layer"), "clip_scope"),
    (dict(orthogonalizer="qr"), "orthogonalizer"), (dict(ns_steps=0), "ns_steps"),
    (dict(ns_steps=2.5), "ns_steps"), (dict(ns_dtype=torch.int32), "ns_dtype"),
    (dict(weight_decay_1d_source="model"), "weight_decay_1d_source"),
    (dict(state_dtype=torch.int64), "state_dtype"),
    (dict(amsgrad="yes"), "amsgrad"), (dict(foreach="auto"), "foreach"),
]


@pytest.mark.parametrize("kwargs, name", INVALID,
                         ids=[f"{n}={list(k.values())[0]}" for k, n in INVALID])
def test_invalid_hyperparameter_raises_value_error_naming_it(kwargs, name):
    params = make_params([(2, 2)])
    pattern = "^" + name.replace("[", r"\[").replace("]", r"\]") + r"(\b|:)"
    with pytest.raises(ValueError, match=pattern):
        MARS(params, **kwargs)
    if name not in ("lr_1d",):  # the same check on a later group's own value
        opt = MARS(params)
        with pytest.raises(ValueError, match=pattern):
            opt.add_param_group(dict(params=make_params([(2, 2)], 1), **kwargs))
        assert len(opt.param_groups) == 1  # a rejected group is not left behind


def test_mixing_exact_and_approx_groups_raises():
    a, b = make_params([(2, 2), (2, 2)])
    with pytest.raises(ValueError, match="^is_approx"):
        MARS([dict(params=[a]), dict(params=[b], is_approx=False)])


def test_sparse_gradient_raises():
    p = make_params([(3, 3)])[0]
    opt = MARS([p])
    p.grad = torch.eye(3, dtype=F64).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


@pytest.mark.parametrize("mars_type", MARS_TYPES)
def test_parameter_without_grad_is_skipped(mars_type):
    """grad None: neither the parameter nor its state (step counter included) changes, but
    for ``last_grad``: the g_{t-1} of a step the tensor sat out is 0 (M2,
    ``test_missing_gradients.py``)."""
    live, idle, fresh = make_params([(3, 4), (2, 2), (3,)])
    opt = MARS([live, idle, fresh], mars_type=mars_type, weight_decay=0.1)
    feed(opt, [live, idle], [torch.ones(3, 4, dtype=F64), torch.ones(2, 2, dtype=F64)])
    live0, idle0, fresh0 = snapshot([live, idle, fresh])
    idle_state = copy.deepcopy(opt.state[idle])
    feed(opt, [live, idle, fresh], [torch.ones(3, 4, dtype=F64), None, None])
    assert not torch.equal(live, live0) and torch.equal(idle, idle0) and torch.equal(fresh, fresh0)
    assert opt.state[idle].keys() == idle_state.keys()
    assert all(torch.equal(opt.state[idle][k], torch.zeros_like(v) if k == "last_grad" else v)
               for k, v in idle_state.items())
    assert len(opt.state.get(fresh, {})) == 0


@pytest.mark.parametrize("is_approx", [True, False], ids=["approx", "exact"])
def test_step_without_any_gradient_is_a_no_op(is_approx):
    """Official bug B3: the step raised UnboundLocalError when no parameter had a gradient."""
    params = make_params([(3, 4), (4,)])
    start = snapshot(params)
    opt = MARS(params, is_approx=is_approx)
    if is_approx:
        assert opt.step() is None
    else:  # exact mode needs a closure; this one computes no gradient
        assert torch.equal(opt.step(lambda: torch.tensor(1.0)), torch.tensor(1.0))
    assert all(torch.equal(p, p0) for p, p0 in zip(params, start))
    assert all(len(st) == 0 for st in opt.state.values())  # no state was created


@pytest.mark.parametrize("clip_scope", ["tensor", "global"])
@pytest.mark.parametrize("is_approx", [True, False], ids=["approx", "exact"])
@pytest.mark.parametrize("mars_type", MARS_TYPES)
def test_maximize_equals_minimizing_the_negation(mars_type, is_approx, clip_scope):
    """Also with the global clip, whose joint norm is a first pass over the (negated) g."""
    runs = []
    for maximize, sign in ((True, -1.0), (False, 1.0)):
        params = [torch.nn.Parameter(torch.tensor(x)) for x in initial_params()]
        opt = MARS(params, lr=1e-2, gamma=0.3, mars_type=mars_type, is_approx=is_approx,
                   maximize=maximize, clip_scope=clip_scope)
        for xi in batches(6):  # negation is exact in IEEE arithmetic: bit-identical
            opt.step(closure_for(opt, params, lambda ps, xi, s=sign: -s * torch_loss(ps, xi), xi))
        runs.append((params, opt))
    for p, q in zip(runs[0][0], runs[1][0]):
        assert torch.equal(p, q)


@pytest.mark.parametrize("is_approx", [True, False], ids=["approx", "exact"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("mars_type", MARS_TYPES)
def test_twenty_closure_steps_decrease_a_least_squares_loss(mars_type, strided, is_approx):
    """torch's test_optimizer_can_converge shape: (W x + b)^2 summed, 20 closure steps."""
    gen = torch.Generator().manual_seed(0)
    if strided:  # non-contiguous views as parameters
        W = torch.nn.Parameter(torch.randn(10, 5, 2, generator=gen)[..., 0])
        b = torch.nn.Parameter(torch.randn(10, 2, generator=gen)[..., 0])
        assert not W.is_contiguous() and not b.is_contiguous()
    else:
        W = torch.nn.Parameter(torch.randn(10, 5, generator=gen))
        b = torch.nn.Parameter(torch.randn(10, generator=gen))
    x = torch.randn(5, generator=gen)
    opt = MARS([W, b], lr=1e-2, lr_1d=1e-2, mars_type=mars_type, is_approx=is_approx)
    closure = closure_for(opt, [W, b], lambda ps: (ps[0] @ x + ps[1]).pow(2).sum())
    initial = closure().item()
    for _ in range(20):
        opt.step(closure)
    assert closure().item() < initial


def test_repr_and_deepcopy():
    params = make_params([(3, 4), (4,)])
    opt = MARS(params, mars_type="mars-lion", gamma=0.1)
    feed(opt, params, [torch.ones_like(p) for p in params])
    text = repr(opt)
    assert text.startswith("MARS (") and "mars_type: mars-lion" in text and "gamma: 0.1" in text
    twin = copy.deepcopy(opt)  # torch's __setstate__ may back-fill keys such as "differentiable"
    assert all(twin.defaults[k] == v for k, v in opt.defaults.items())
    twin_params = twin.param_groups[0]["params"]
    assert all(p is not q and torch.equal(p, q) for p, q in zip(params, twin_params))
    assert_same_optimizer(params, opt, twin_params, twin)
    before = snapshot(params), copy.deepcopy(opt.state_dict())
    twin.step()  # the copy is independent: stepping it leaves the original untouched
    assert all(torch.equal(p, p0) for p, p0 in zip(params, before[0]))
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], before[1]["state"][0]["exp_avg"])
