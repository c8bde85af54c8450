"""``init_state()`` of ``MARS`` and ``MARSM`` (and the authors' ``MARS_M``, ``MARS_M_Efficient``).

torchtitan's ``init_optim_state`` and DCP's ``_init_optim_state`` (run by ``get_state_dict``)
materialise an empty optimizer state with one zero-gradient, ``lr = 0`` step, which advances
the step counters (the first real step then takes t = 2).  ``init_state()`` creates the state
the first step would create, counters at 0, so that their init step does nothing.  Proved here,
for each option combination, bit for bit (``torch.equal``) in float64 and float32:

(a) ``init_state()`` then N steps equals N steps from fresh, parameters and every state tensor;
(b) the state after ``init_state()`` has the keys, shapes, dtypes and devices of a first step's
    state, values 0 and counters 0, parameters and gradients untouched;
(c) torchtitan's ``init_optim_state`` after ``init_state()`` changes nothing (state and
    param_groups), and the trajectory is the fresh one; without ``init_state()`` it changes
    the trajectory (exact mode: it raises, since its step has no closure);
(d) DCP's ``get_state_dict(model, opt)`` (one process, no process group) likewise;
(e) a state dict saved after ``init_state()`` (and after steps) loaded into a fresh optimizer
    that also called ``init_state()`` continues bit-identically.

The model has a matrix, a bias (second group), a stack of matrices, a tensor that enters the
loss only from step 2 (``late``), one that never does (``unused``) and a frozen one.
"""
import copy

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torchtitan.components.optimizer.utils import init_optim_state

from torch_impl import MARS, MARS_M, MARS_M_Efficient, MARSM
from theory_tests.support.checkpoint_checks import dcp_round_trip

F32, F64 = torch.float32, torch.float64
STEPS = 3


class Net(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        gen = torch.Generator().manual_seed(0)

        def p(*shape, grad=True):
            return nn.Parameter(torch.randn(*shape, generator=gen, dtype=dtype), requires_grad=grad)
        self.w, self.stack, self.late, self.unused = p(4, 3), p(2, 3, 2), p(3, 2), p(2, 2)
        self.b, self.frozen = p(4), p(3, grad=False)

    def loss(self, t):
        gen = torch.Generator().manual_seed(100 + t)
        x = torch.randn(3, 5, generator=gen, dtype=self.w.dtype)
        h = (self.w @ x + self.b[:, None]).tanh()
        loss = h.square().sum() + (self.stack @ x[:2]).sin().sum() + self.frozen.sum()
        if t >= 2:
            loss = loss + (self.late @ x[:2]).cos().sum()
        return loss

    def groups(self):
        return [dict(params=[self.w, self.stack, self.late, self.unused]),
                dict(params=[self.b, self.frozen], lr=0.02)]


def mars(**kw):
    options = dict(kw)
    stack_group = options.pop("stack_group", False)

    def make(net):
        groups = net.groups()
        if stack_group:  # the stack in a group of its own, as a stack
            groups.append(dict(params=[groups[0]["params"].pop(1)], matrix_batch_dims=1))
        return MARS(groups, **dict(dict(lr=0.01, gamma=0.1, weight_decay=0.01), **options))
    return make


def marsm(**kw):
    def make(net):
        groups = net.groups()
        groups.append(dict(params=[groups[0]["params"].pop(1)], matrix_batch_dims=1))
        return MARSM(groups, **dict(dict(lr=0.01, gamma=0.1, weight_decay=0.01,
                                         ns_dtype=net.w.dtype), **kw))
    return make


def authors_mars_m(cls, **kw):
    def make(net):
        return cls(lr=0.01, muon_params=[net.w, net.late, net.unused],
                   adamw_params=[net.b, net.stack, net.frozen], gamma=0.1, ns_dtype=net.w.dtype,
                   **kw)
    return make


# name: (make, dtype, loop) -- loop "approx", "closure" (exact) or "authors" (exact, the
# authors' update_previous_grad / update_last_grad loop)
CASES = {
    "mars-adamw-f64": (mars(foreach=False), F64, "approx"),
    "mars-adamw-f32-amsgrad-1d-foreach": (mars(amsgrad=True, optimize_1d=True, foreach=True,
                                               maximize=True, lr=torch.tensor(0.01),
                                               betas=(torch.tensor(0.9), 0.99)), F32, "approx"),
    "mars-adamw-f32-bf16-state": (mars(state_dtype=torch.bfloat16, clip_scope="global"),
                                  F32, "approx"),
    "mars-adamw-f64-exact-closure": (mars(is_approx=False), F64, "closure"),
    "mars-lion-f64-exact-authors": (mars(is_approx=False, mars_type="mars-lion"), F64, "authors"),
    "mars-lion-f64-global": (mars(mars_type="mars-lion", clip_scope="global"), F64, "approx"),
    "mars-lion-f32-1d-foreach": (mars(mars_type="mars-lion", optimize_1d=True, foreach=True),
                                 F32, "approx"),
    "mars-shampoo-f64-stack": (mars(mars_type="mars-shampoo", ns_dtype=F64, stack_group=True,
                                    shape_layout="in_out"), F64, "approx"),
    "mars-shampoo-f32-1d-amsgrad-svd": (mars(mars_type="mars-shampoo", optimize_1d=True,
                                             amsgrad=True, orthogonalizer="svd",
                                             weight_decay_1d_source="group", lr_1d=0.02),
                                        F32, "approx"),
    "mars-adamw-f32-compiled": (mars(compiled=True), F32, "approx"),
    "marsm-f64": (marsm(), F64, "approx"),
    "marsm-f32-foreach-noclip": (marsm(foreach=True, clip_c=False, maximize=True), F32, "approx"),
    "marsm-f64-efficient": (marsm(efficient=True), F64, "approx"),
    "marsm-f64-exact-closure": (marsm(is_approx=False), F64, "closure"),
    "MARS_M-f64-exact-authors": (authors_mars_m(MARS_M, is_approx=False), F64, "authors"),
    "MARS_M_Efficient-f32": (authors_mars_m(MARS_M_Efficient), F32, "approx"),
}
# compiled=True (one compilation, ~3 s) only in (a): init_state creates the state before
# the step, whatever runs the step, so (b)-(e) take the eager cases.
EAGER = [name for name in CASES if "compiled" not in name]
# The cases whose init step changes nothing (no counter enters their updates): Lion on
# every tensor has no bias correction.
COUNTER_FREE = {"mars-lion-f32-1d-foreach"}


def build(name):
    make, dtype, _ = CASES[name]
    net = Net(dtype)
    return net, make(net)


def one_step(name, net, opt, t):
    loop = CASES[name][2]

    def closure():
        opt.zero_grad(set_to_none=True)
        loss = net.loss(t)
        loss.backward()
        return loss
    if loop == "closure":
        opt.step(closure)
        return
    if loop == "authors":  # grad f(x_t, xi_{t+1}) kept, the step on xi_t, then handed over
        opt.zero_grad(set_to_none=True)
        net.loss(t + 1).backward()
        opt.update_previous_grad()
    closure()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if loop == "authors":
        opt.update_last_grad()


def run(name, net, opt, steps, start=0):
    for t in range(start, start + steps):
        one_step(name, net, opt, t)


def params_of(net):
    return list(net.parameters())


def assert_same_run(net_a, opt_a, net_b, opt_b):
    """Parameters equal bit for bit; every state entry the two optimizers both hold equal bit
    for bit (dtype included); an entry only one of them holds is init_state's, for a
    parameter that has not needed it yet (never given a gradient, or not since), and still
    its initial value: 0 (counter 0)."""
    for p, q in zip(params_of(net_a), params_of(net_b)):
        assert p.dtype == q.dtype and torch.equal(p, q)
        sa, sb = opt_a.state.get(p, {}), opt_b.state.get(q, {})
        for key in sa.keys() | sb.keys():
            if key in sa and key in sb:
                assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key
            else:
                assert not (sa[key] if key in sa else sb[key]).any(), key


def state_copy(opt):
    return copy.deepcopy(opt.state_dict())


def assert_equal_state_dicts(a, b):
    assert a.keys() == b.keys()
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys()
        for key, value in a["state"][i].items():
            other = b["state"][i][key]
            assert value.dtype == other.dtype and torch.equal(value, other), (i, key)
    assert len(a["param_groups"]) == len(b["param_groups"])
    for ga, gb in zip(a["param_groups"], b["param_groups"]):
        assert ga.keys() == gb.keys()
        for key in ga:
            if torch.is_tensor(ga[key]):
                assert torch.equal(ga[key], gb[key]), key
            else:
                assert ga[key] == gb[key], key


@pytest.mark.parametrize("name", list(CASES))
def test_init_state_then_steps_is_the_fresh_run(name):
    """(a) init_state() then N steps = N steps from fresh, bit for bit; a second call is a
    no-op; the tensors that never got a gradient keep zeros and counter 0."""
    net_a, opt_a = build(name)
    net_b, opt_b = build(name)
    opt_b.init_state()
    opt_b.init_state()
    run(name, net_a, opt_a, STEPS)
    run(name, net_b, opt_b, STEPS)
    assert_same_run(net_a, opt_a, net_b, opt_b)
    assert opt_b.state[net_b.late]["step"] == STEPS - 2  # entered at step 2, as in opt_a
    assert opt_b.state.get(net_b.unused) and not opt_a.state.get(net_a.unused)
    assert not opt_b.state.get(net_b.frozen)  # (exact mode's closure loop leaves {} there)


@pytest.mark.parametrize("name", EAGER)
def test_init_state_is_the_first_steps_state_with_counters_at_zero(name):
    """(b) keys, shapes, dtypes and devices of the state a first step creates (every
    parameter given a gradient, so every one gets state), values 0, counters 0 (the step's
    counter dtype); parameters and gradients untouched.  Exact mode's previous_grad (the
    authors' loop's) is left to that loop; its prev_param (the closure loop's x_{t-1}) is
    created in both exact loops, zeros like the parameter, so checkpoint templates name it
    (test_a_template_resumed_exact_closure_loop_keeps_its_previous_iterate)."""
    net_a, opt_a = build(name)
    gen = torch.Generator().manual_seed(7)
    for p in params_of(net_a):
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
    if CASES[name][2] == "closure":
        opt_a.step(lambda: sum(p.sum() for p in params_of(net_a) if p.requires_grad).backward())
    else:
        if CASES[name][2] == "authors":
            opt_a.update_previous_grad()
        opt_a.step()
    first = opt_a.state_dict()

    net_b, opt_b = build(name)
    for p in params_of(net_b):
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
    before = [(p.detach().clone(), p.grad, None if p.grad is None else p.grad.clone())
              for p in params_of(net_b)]
    opt_b.init_state()
    for p, (value, grad, grad_value) in zip(params_of(net_b), before):
        assert torch.equal(p, value) and p.grad is grad
        assert grad is None or torch.equal(grad, grad_value)
    init = opt_b.state_dict()
    first["state"] = {i: st for i, st in first["state"].items() if st}  # exact mode leaves {}
    assert_equal_state_dicts(dict(init, state={}), dict(first, state={}))  # param_groups
    assert init["state"].keys() == first["state"].keys()
    exact = CASES[name][2] != "approx"
    packed = [p for g in opt_b.param_groups for p in g["params"]]
    for i, st in init["state"].items():
        keys = set(first["state"][i]) - {"prev_param", "previous_grad"}
        keys |= {"prev_param"} if exact else set()
        assert set(st) == keys, (i, set(st), keys)
        for key, value in st.items():
            ref = packed[i] if key == "prev_param" else first["state"][i][key]
            assert (value.shape, value.dtype, value.device) == (ref.shape, ref.dtype, ref.device)
            assert not value.any(), (i, key)
        assert st["step"].device.type == "cpu" and st["step"].dtype == torch.float32


@pytest.mark.parametrize("name", EAGER)
def test_torchtitan_init_optim_state_after_init_state_changes_nothing(name):
    """(c) after init_state(), torchtitan's init_optim_state leaves state and param_groups
    bit for bit and the trajectory is the fresh one; without init_state() it is not (it
    advances the counters), and in exact mode it raises (its step has no closure)."""
    net_a, opt_a = build(name)
    run(name, net_a, opt_a, STEPS)

    net_b, opt_b = build(name)
    opt_b.init_state()
    before = state_copy(opt_b)
    init_optim_state(opt_b)
    assert_equal_state_dicts(before, opt_b.state_dict())
    assert all(p.grad is None for p in params_of(net_b))
    run(name, net_b, opt_b, STEPS)
    assert_same_run(net_a, opt_a, net_b, opt_b)

    net_c, opt_c = build(name)
    if CASES[name][2] != "approx":
        with pytest.raises(RuntimeError, match="exact mode"):
            init_optim_state(opt_c)
        return
    init_optim_state(opt_c)
    assert all(st["step"] == 1 for st in opt_c.state.values())
    run(name, net_c, opt_c, STEPS)
    diff = max((p - q).abs().max().item() for p, q in zip(params_of(net_a), params_of(net_c)))
    if name in COUNTER_FREE:
        assert diff == 0.0
    else:
        assert diff > 0.0


@pytest.mark.parametrize("name", ["mars-adamw-f64", "mars-shampoo-f32-1d-amsgrad-svd",
                                  "mars-adamw-f64-exact-closure", "marsm-f64",
                                  "MARS_M-f64-exact-authors"])
def test_dcp_get_state_dict_after_init_state_leaves_the_run_unchanged(name):
    """(d) DCP's get_state_dict (one process, no process group needed) runs its own init step
    on an empty state: after init_state() it is a no-op (the trajectory is the fresh one);
    without, it advances the counters."""
    net_a, opt_a = build(name)
    run(name, net_a, opt_a, STEPS)
    net_b, opt_b = build(name)
    opt_b.init_state()
    before = state_copy(opt_b)
    _, optim_sd = get_state_dict(net_b, opt_b)
    assert_equal_state_dicts(before, opt_b.state_dict())
    assert len(optim_sd["state"]) == len(before["state"])
    run(name, net_b, opt_b, STEPS)
    assert_same_run(net_a, opt_a, net_b, opt_b)
    if CASES[name][2] == "approx":
        net_c, opt_c = build(name)
        get_state_dict(net_c, opt_c)
        assert all(st["step"] == 1 for st in opt_c.state.values())


@pytest.mark.parametrize("name", ["mars-adamw-f64", "mars-adamw-f32-bf16-state",
                                  "mars-lion-f64-exact-authors", "mars-adamw-f64-exact-closure",
                                  "marsm-f64-efficient", "MARS_M-f64-exact-authors"])
def test_state_dict_round_trip_after_init_state_continues_bit_identically(name):
    """(e) saved after init_state() and k steps (k = 0, 2), loaded into a fresh optimizer (on
    the same parameters' copy) that also called init_state(): the continuation is the
    uninterrupted run's, bit for bit."""
    for k in (0, 2):
        net_a, opt_a = build(name)
        opt_a.init_state()
        run(name, net_a, opt_a, k)
        saved = state_copy(opt_a)
        net_b, opt_b = build(name)
        with torch.no_grad():
            for p, q in zip(params_of(net_b), params_of(net_a)):
                p.copy_(q)
        opt_b.init_state()
        opt_b.load_state_dict(saved)
        run(name, net_a, opt_a, 2, start=k)
        run(name, net_b, opt_b, 2, start=k)
        assert_same_run(net_a, opt_a, net_b, opt_b)


@pytest.mark.parametrize("cls_name", ["MARS", "MARSM"])
def test_init_state_leaves_existing_state_untouched(cls_name):
    """A parameter that already has state keeps it: the same tensors, the same values,
    even where a step would now convert it (MARS: the group's state_dtype changed since);
    only parameters without state get it."""
    name = "mars-adamw-f64" if cls_name == "MARS" else "marsm-f64"
    net, opt = build(name)
    run(name, net, opt, 2)  # late and unused have no state yet
    if cls_name == "MARS":
        opt.param_groups[0]["state_dtype"] = F32
    held = {p: dict(st) for p, st in opt.state.items() if st}
    values = state_copy(opt)
    opt.init_state()
    for p, st in held.items():
        assert opt.state[p].keys() == st.keys()
        assert all(opt.state[p][key] is value for key, value in st.items())
    after = opt.state_dict()
    for i, st in values["state"].items():
        for key, value in st.items():
            assert after["state"][i][key].dtype == value.dtype
            assert torch.equal(after["state"][i][key], value)
    assert opt.state.get(net.late) and opt.state.get(net.unused)
    assert not opt.state.get(net.frozen)
    assert opt.state[net.late]["step"] == 0


@pytest.mark.parametrize("name", ["mars-adamw-f64-exact-closure", "marsm-f64-exact-closure",
                                  "MARS_M-f64-exact-authors"])
def test_a_template_resumed_exact_loop_keeps_its_previous_iterate(name, tmp_path):
    """(f) DCP's own flow: ``get_state_dict`` -> ``dcp.save`` after k steps (k = 0, 2), then a
    fresh job's ``init_state()``, its ``get_state_dict`` as the template, ``dcp.load`` into
    it and ``set_state_dict``: the continuation is the uninterrupted run bit for bit. DCP
    loads only the names the template has, so the closure loop's x_{t-1} (``prev_param``)
    comes back only because init_state() names it; without it the resumed loop skipped its
    re-evaluation at x_{t-1} and ran differently (5e-3 after 3 more steps, measured)."""
    for k in (0, 2):
        net_a, opt_a = build(name)
        opt_a.init_state()
        run(name, net_a, opt_a, k)
        net_b, opt_b = build(name)
        with torch.no_grad():
            for p in params_of(net_b):
                p.add_(1.0)  # the fresh job's own weights: the checkpoint must bring them
        opt_b.init_state()
        dcp_round_trip(net_a, opt_a, net_b, opt_b, str(tmp_path / f"k{k}"))
        if k and CASES[name][2] == "closure":
            assert all(torch.equal(opt_b.state[q]["prev_param"], opt_a.state[p]["prev_param"])
                       for p, q in zip(params_of(net_a), params_of(net_b))
                       if "prev_param" in opt_a.state.get(p, {}))
        run(name, net_a, opt_a, 3, start=k)
        run(name, net_b, opt_b, 3, start=k)
        assert_same_run(net_a, opt_a, net_b, opt_b)
