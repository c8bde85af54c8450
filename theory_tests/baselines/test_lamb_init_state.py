"""``LAMB.init_state()``: the first step's state up front (``step`` = 0), so that torchtitan's
``init_optim_state`` and DCP's ``get_state_dict``, which materialise an empty state with a
zero-gradient ``lr = 0`` step (advancing ``step``: the first real step would take k = 2 in the
bias corrections), do nothing.  Bit for bit (``torch.equal``), float64 and float32:

(a) ``init_state()`` then N steps equals N steps from fresh (parameters, every state tensor);
(b) the state is a first step's in keys, shapes, dtypes and devices, zeros, ``step`` = 0;
(c) torchtitan's ``init_optim_state`` after it changes nothing; without it, the run changes;
(d) DCP's ``get_state_dict`` (one process) likewise;
(e) a state dict saved after it loads into a fresh optimizer that called it too and
    continues bit-identically.
"""
import copy

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torchtitan.components.optimizer.utils import init_optim_state

from torch_impl import LAMB

F32, F64 = torch.float32, torch.float64
STEPS = 3


class Net(nn.Module):
    """A matrix, a bias (second group), a complex vector (with ``complex_``), a tensor that
    enters the loss from step 2, one that never does, and a frozen one."""

    def __init__(self, dtype, complex_=False):
        super().__init__()
        gen = torch.Generator().manual_seed(0)

        def p(*shape, grad=True, dt=dtype):
            return nn.Parameter(torch.randn(*shape, generator=gen, dtype=dt), requires_grad=grad)
        self.w, self.late, self.unused = p(4, 3), p(3), p(2, 2)
        self.b, self.frozen = p(4), p(3, grad=False)
        cdt = torch.complex128 if dtype == F64 else torch.complex64
        self.z = p(3, dt=cdt) if complex_ else None

    def loss(self, t):
        gen = torch.Generator().manual_seed(100 + t)
        x = torch.randn(3, 5, generator=gen, dtype=self.w.dtype)
        loss = (self.w @ x + self.b[:, None]).tanh().square().sum() + self.frozen.sum()
        if self.z is not None:
            loss = loss + (self.z * x[:, 0]).abs().square().sum()
        if t >= 2:
            loss = loss + (self.late @ x).sin().sum()
        return loss

    def groups(self):
        first = [self.w, self.late, self.unused] + ([self.z] if self.z is not None else [])
        return [dict(params=first), dict(params=[self.b, self.frozen], lr=0.02, weight_decay=0.0)]


CASES = {  # name: (dtype, complex, LAMB options)
    "f64-loop": (F64, False, dict(foreach=False)),
    "f32-foreach": (F32, False, dict(foreach=True)),
    "f64-complex-maximize-tensor-lr": (F64, True, dict(maximize=True, lr=torch.tensor(0.01),
                                                       betas=(torch.tensor(0.9), 0.99))),
    "f32-complex-foreach": (F32, True, dict(foreach=True)),
}


def build(name):
    dtype, complex_, options = CASES[name]
    net = Net(dtype, complex_)
    return net, LAMB(net.groups(), **dict(dict(lr=0.01, weight_decay=0.01), **options))


def run(net, opt, steps, start=0):
    for t in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        net.loss(t).backward()
        opt.step()
    opt.zero_grad(set_to_none=True)


def params_of(net):
    return list(net.parameters())


def assert_same_run(net_a, opt_a, net_b, opt_b):
    """Parameters bit for bit; state entries both hold bit for bit; an entry only one holds
    (init_state's, of a tensor never given a gradient) still 0."""
    for p, q in zip(params_of(net_a), params_of(net_b)):
        assert p.dtype == q.dtype and torch.equal(p, q)
        sa, sb = opt_a.state.get(p, {}), opt_b.state.get(q, {})
        for key in sa.keys() | sb.keys():
            if key in sa and key in sb:
                assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key
            else:
                assert not (sa[key] if key in sa else sb[key]).any(), key


def assert_equal_state_dicts(a, b):
    assert a["state"].keys() == b["state"].keys()
    for i, st in a["state"].items():
        assert st.keys() == b["state"][i].keys()
        for key, value in st.items():
            assert value.dtype == b["state"][i][key].dtype
            assert torch.equal(value, b["state"][i][key]), (i, key)
    for ga, gb in zip(a["param_groups"], b["param_groups"], strict=True):
        assert ga.keys() == gb.keys()
        for key in ga:
            same = torch.equal(ga[key], gb[key]) if torch.is_tensor(ga[key]) else ga[key] == gb[key]
            assert same, key


@pytest.mark.parametrize("name", list(CASES))
def test_init_state_then_steps_is_the_fresh_run(name):
    """(a), and idempotence: a second call changes nothing."""
    net_a, opt_a = build(name)
    net_b, opt_b = build(name)
    opt_b.init_state()
    held = {p: dict(st) for p, st in opt_b.state.items()}
    opt_b.init_state()
    assert all(opt_b.state[p][k] is v for p, st in held.items() for k, v in st.items())
    run(net_a, opt_a, STEPS)
    run(net_b, opt_b, STEPS)
    assert_same_run(net_a, opt_a, net_b, opt_b)
    assert opt_b.state[net_b.late]["step"] == STEPS - 2
    assert opt_b.state.get(net_b.unused) and not opt_a.state.get(net_a.unused)
    assert not opt_b.state.get(net_b.frozen)


@pytest.mark.parametrize("name", list(CASES))
def test_init_state_is_the_first_steps_state_with_step_zero(name):
    """(b): every parameter given a gradient for the reference first step; init_state leaves
    parameters and gradients as they were."""
    gen = torch.Generator().manual_seed(7)
    net_a, opt_a = build(name)
    for p in params_of(net_a):
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
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
    assert_equal_state_dicts(dict(init, state={}), dict(first, state={}))
    assert init["state"].keys() == first["state"].keys()
    for i, st in init["state"].items():
        assert st.keys() == first["state"][i].keys()
        for key, value in st.items():
            ref = first["state"][i][key]
            assert (value.shape, value.dtype, value.device) == (ref.shape, ref.dtype, ref.device)
            assert not value.any(), (i, key)


@pytest.mark.parametrize("name", list(CASES))
def test_torchtitan_init_optim_state_after_init_state_changes_nothing(name):
    """(c) with init_state(): state and param_groups bit for bit, the fresh trajectory;
    without: the counters advance and the trajectory changes."""
    net_a, opt_a = build(name)
    run(net_a, opt_a, STEPS)
    net_b, opt_b = build(name)
    opt_b.init_state()
    before = copy.deepcopy(opt_b.state_dict())
    init_optim_state(opt_b)
    assert_equal_state_dicts(before, opt_b.state_dict())
    run(net_b, opt_b, STEPS)
    assert_same_run(net_a, opt_a, net_b, opt_b)
    net_c, opt_c = build(name)
    init_optim_state(opt_c)
    assert all(st["step"] == 1 for st in opt_c.state.values())
    run(net_c, opt_c, STEPS)
    assert max((p - q).abs().max().item() for p, q in zip(params_of(net_a), params_of(net_c))) > 0


@pytest.mark.parametrize("name", ["f64-loop", "f32-complex-foreach"])
def test_dcp_get_state_dict_after_init_state_leaves_the_run_unchanged(name):
    """(d) one process, no process group."""
    net_a, opt_a = build(name)
    run(net_a, opt_a, STEPS)
    net_b, opt_b = build(name)
    opt_b.init_state()
    before = copy.deepcopy(opt_b.state_dict())
    get_state_dict(net_b, opt_b)
    assert_equal_state_dicts(before, opt_b.state_dict())
    run(net_b, opt_b, STEPS)
    assert_same_run(net_a, opt_a, net_b, opt_b)
    net_c, opt_c = build(name)
    get_state_dict(net_c, opt_c)
    assert all(st["step"] == 1 for st in opt_c.state.values())


@pytest.mark.parametrize("name", ["f64-loop", "f64-complex-maximize-tensor-lr"])
def test_state_dict_round_trip_after_init_state_continues_bit_identically(name):
    """(e) saved after init_state() and k = 0, 2 steps; loaded into a fresh optimizer that
    called init_state() too; both continue 2 steps, bit for bit."""
    for k in (0, 2):
        net_a, opt_a = build(name)
        opt_a.init_state()
        run(net_a, opt_a, k)
        saved = copy.deepcopy(opt_a.state_dict())
        net_b, opt_b = build(name)
        with torch.no_grad():
            for p, q in zip(params_of(net_b), params_of(net_a)):
                p.copy_(q)
        opt_b.init_state()
        opt_b.load_state_dict(saved)
        run(net_a, opt_a, 2, start=k)
        run(net_b, opt_b, 2, start=k)
        assert_same_run(net_a, opt_a, net_b, opt_b)


def test_init_state_leaves_existing_state_untouched():
    """Parameters with state keep the same tensors and values; the others get state."""
    net, opt = build("f64-loop")
    run(net, opt, 2)  # late and unused have none yet
    held = {p: dict(st) for p, st in opt.state.items() if st}
    values = copy.deepcopy(opt.state_dict())
    opt.init_state()
    for p, st in held.items():
        assert opt.state[p].keys() == st.keys()
        assert all(opt.state[p][key] is value for key, value in st.items())
    after = opt.state_dict()
    for i, st in values["state"].items():
        assert all(torch.equal(after["state"][i][key], value) for key, value in st.items())
    assert opt.state[net.late]["step"] == 0 and opt.state.get(net.unused)
    assert not opt.state.get(net.frozen)
