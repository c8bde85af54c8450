"""``torch_impl.MARSM`` against the torch.optim contract (CONVENTIONS.md section 2): validation,
param groups and rules, schedulers, state and ``state_dict`` round trips (numeric steps and the
authors' checkpoints included), foreach parity, maximize, and no host synchronisation."""
import copy
import io

import pytest
import torch

from theory_tests.support.mars_property_helpers import (F64, assert_same_optimizer, clone_params, feed, make_params,
                                   spy_on_scalar_reads)
from torch_impl import MARS_M, MARS_M_Efficient, MARSM

SHAPES = [(6, 4), (5,), (3, 7), (2, 2, 2)]


def _grads(t, shapes=SHAPES, scale=1.0):
    gen = torch.Generator().manual_seed(200 + t)
    return [torch.randn(s, generator=gen, dtype=F64) * scale for s in shapes]


@pytest.mark.parametrize("kw,name", [
    (dict(lr=-1.0), "lr"), (dict(weight_decay=-0.1), "weight_decay"),
    (dict(momentum=1.0), "momentum"), (dict(momentum=-0.1), "momentum"),
    (dict(gamma=1.5), "gamma"), (dict(adamw_eps=-1e-8), "adamw_eps"),
    (dict(adamw_betas=(0.9, 1.0)), "adamw_betas"), (dict(adamw_betas=0.9), "adamw_betas"),
    (dict(ns_steps=0), "ns_steps"), (dict(ns_steps=2.0), "ns_steps"),
    (dict(clip_c="yes"), "clip_c"), (dict(is_approx=1), "is_approx"),
    (dict(rule="muon"), "rule"), (dict(ns_dtype=torch.int8), "ns_dtype"),
    (dict(foreach="yes"), "foreach"), (dict(efficient=True, is_approx=False), "efficient"),
    (dict(efficient=True, momentum=0.0), "momentum"), (dict(lr=torch.tensor([1.0, 2.0])), "lr"),
    (dict(shape_layout="rows"), "shape_layout"), (dict(maximize=None), "maximize"),
    (dict(compiled="group"), "compiled"),
])
def test_invalid_hyperparameter_raises_value_error_naming_it(kw, name):
    with pytest.raises(ValueError, match=name):
        MARSM(make_params([(3, 2)]), **kw)


def test_mars_m_rule_rejects_non_matrices_and_auto_routes_by_ndim():
    with pytest.raises(ValueError, match="rule"):
        MARSM([dict(params=make_params([(3,)]), rule="mars_m")])
    params = make_params(SHAPES)
    opt = MARSM(params)
    feed(opt, params, _grads(0))
    keys = [set(opt.state[p]) for p in params]
    matrix, backup = {"step", "momentum_buffer", "last_grad"}, {"step", "moment1", "moment2"}
    assert keys == [matrix, backup, matrix, backup]
    with pytest.raises(ValueError, match="is_approx"):
        MARSM([dict(params=make_params([(2, 2)])),
               dict(params=make_params([(2, 2)], 1), is_approx=False)])


def test_state_keys_efficient_and_exact():
    params = make_params([(4, 3)])
    opt = MARSM(params, efficient=True)
    feed(opt, params, _grads(0, [(4, 3)]))
    assert set(opt.state[params[0]]) == {"step", "momentum_buffer"}  # no last_grad (M18)


def test_authors_constructor_groups_and_keywords():
    w, b = make_params([(4, 3)]), make_params([(3,)], 1)
    opt = MARS_M(lr=6e-3, wd=1e-2, muon_params=w, adamw_params=b, momentum=0.9,
                 adamw_betas=(0.9, 0.95), gamma=0.025, clip_c=False, is_approx=True)
    assert [g["rule"] for g in opt.param_groups] == ["mars_m", "adamw"]
    g0 = opt.param_groups[0]
    assert (g0["lr"], g0["weight_decay"], g0["momentum"], opt.gamma) == (6e-3, 1e-2, 0.9, 0.025)
    eff = MARS_M_Efficient(muon_params=make_params([(4, 3)]), adamw_params=None)
    assert eff.param_groups[0]["efficient"] and len(eff.param_groups) == 1


def test_param_groups_rules_and_per_group_lr_with_a_scheduler():
    """A group at lr 1e-28 does not move; a StepLR on the other scales its steps."""
    frozen, live = make_params([(4, 3), (3,)], 2), make_params([(4, 3), (3,)], 3)
    opt = MARSM([dict(params=frozen, lr=1e-28), dict(params=live)], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    before = [p.detach().clone() for p in frozen]
    moves = []
    for t in range(3):
        x = [p.detach().clone() for p in live]
        feed(opt, frozen + live, _grads(t, [(4, 3), (3,)]) * 2)
        sched.step()
        moves.append((live[0] - x[0]).norm().item())
    assert all(torch.allclose(p, q, rtol=0, atol=1e-20) for p, q in zip(frozen, before))
    assert moves[2] < moves[0] * 0.5
    assert opt.param_groups[1]["lr"] == pytest.approx(0.1 * 0.5**3)


def test_tensor_lr_equals_float_lr():
    """A (CPU) tensor lr, as torch.optim.AdamW accepts, is read as its value each step."""
    a = make_params(SHAPES, 4)
    b = clone_params(a)
    opt_a, opt_b = MARSM(a, lr=0.01), MARSM(b, lr=torch.tensor(0.01, dtype=F64))
    for t in range(3):
        feed(opt_a, a, _grads(t))
        feed(opt_b, b, _grads(t))
    assert all(torch.equal(p, q) for p, q in zip(a, b))


@pytest.mark.parametrize("kw", [dict(), dict(efficient=True), dict(maximize=True),
                                dict(clip_c=False, gamma=0.5)],
                         ids=["default", "efficient", "maximize", "no-clip"])
def test_foreach_matches_single_tensor_bit_for_bit(kw):
    a = make_params(SHAPES + [(0, 3)], 5)
    b = clone_params(a)
    opt_a, opt_b = MARSM(a, foreach=False, **kw), MARSM(b, foreach=True, **kw)
    for t in range(5):
        grads = _grads(t, SHAPES + [(0, 3)], 3.0)
        if t == 2:
            grads[1] = None  # a parameter without a gradient this step
        feed(opt_a, a, grads)
        feed(opt_b, b, grads)
    assert_same_optimizer(a, opt_a, b, opt_b)


def test_maximize_equals_minimizing_the_negation():
    a = make_params(SHAPES, 6)
    b = clone_params(a)
    opt_a, opt_b = MARSM(a, maximize=True), MARSM(b)
    for t in range(3):
        feed(opt_a, a, _grads(t))
        feed(opt_b, b, [-g for g in _grads(t)])
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_step_without_gradients_is_a_no_op_and_sparse_raises():
    params = make_params(SHAPES)
    opt = MARSM(params)
    opt.step()
    assert not opt.state
    emb = torch.nn.Embedding(4, 3, sparse=True).double()
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        MARSM(emb.parameters()).step()


@pytest.mark.parametrize("kw", [dict(), dict(is_approx=False), dict(efficient=True)],
                         ids=["approx", "exact", "efficient"])
def test_state_dict_round_trip_continues_bit_identically(kw):
    """Prime, save (in memory and through torch.save), load into a fresh optimizer on cloned
    params, run both in lockstep: identical params and state; state_dict() after load equals
    the one loaded (no key gained)."""
    x = torch.linspace(-1, 1, 7, dtype=F64)

    def run(opt, params, steps):
        for t in range(steps):
            def closure():
                opt.zero_grad()
                loss = sum((p * (t + 1)).sin().sum() * x[i] for i, p in enumerate(params))
                loss.backward()
                return loss
            opt.step(closure)

    a = make_params(SHAPES, 7)
    opt_a = MARSM(a, lr=0.05, **kw)
    run(opt_a, a, 4)
    saved = copy.deepcopy(opt_a.state_dict())
    buffer = io.BytesIO()
    torch.save(opt_a.state_dict(), buffer)
    buffer.seek(0)
    b = clone_params(a)
    opt_b = MARSM(b, lr=0.05, **kw)
    opt_b.load_state_dict(torch.load(buffer))
    after = opt_b.state_dict()
    assert after["param_groups"] == saved["param_groups"]
    assert after["state"].keys() == saved["state"].keys()
    run(opt_a, a, 3)
    run(opt_b, b, 3)
    assert_same_optimizer(a, opt_a, b, opt_b)


def test_checkpoint_with_numeric_step_loads_and_continues():
    """The authors' backup keeps ``step`` as a Python int; older torch checkpoints too."""
    a = make_params(SHAPES, 8)
    opt_a = MARSM(a)
    for t in range(2):
        feed(opt_a, a, _grads(t))
    sd = copy.deepcopy(opt_a.state_dict())
    for st in sd["state"].values():
        st["step"] = int(st["step"].item())
    b = clone_params(a)
    opt_b = MARSM(b)
    opt_b.load_state_dict(sd)
    assert all(torch.is_tensor(st["step"]) for st in opt_b.state.values())
    for t in range(2, 4):
        feed(opt_a, a, _grads(t))
        feed(opt_b, b, _grads(t))
    assert_same_optimizer(a, opt_a, b, opt_b)


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("kw", [dict(), dict(efficient=True), dict(is_approx=False)],
                         ids=["approx", "efficient", "exact"])
def test_step_reads_only_cpu_step_counters(kw, foreach, monkeypatch):
    """Every tensor-to-Python read inside step() is a state['step'] counter (0-d, CPU)."""
    params = make_params(SHAPES, 9)
    opt = MARSM(params, foreach=foreach, **kw)

    def closure():
        opt.zero_grad()
        loss = sum(p.square().sum() * (i + 1) for i, p in enumerate(params))
        loss.backward()
        return loss
    opt.step(closure)
    reads = spy_on_scalar_reads(monkeypatch)
    opt.step(closure)
    monkeypatch.undo()
    counters = [opt.state[p]["step"] for p in params]
    assert reads and all(any(r is c for c in counters) for r in reads)


# ------------------------------------------------------------------ compiled=True

@pytest.mark.slow
def test_compiled_matches_the_eager_loop_float64():
    """``compiled=True`` runs the same equation functions under torch.compile: equal to the
    loop to a few ulps (Inductor may reassociate), for every matrix orientation and the
    backup, with and without the clip, and the efficient recursion."""
    import torch._dynamo
    shapes = [(6, 4), (5,), (3, 7), (7, 3), (2, 2, 2)]
    for kw in (dict(), dict(efficient=True, clip_c=False), dict(maximize=True, gamma=0.4)):
        torch._dynamo.reset()  # each configuration compiles its own variants
        a = make_params(shapes, 11)
        b = clone_params(a)
        opt_a = MARSM(a, lr=0.05, ns_dtype=F64, **kw)
        opt_b = MARSM(b, lr=0.05, ns_dtype=F64, compiled=True, **kw)
        for t in range(4):
            grads = _grads(t, shapes, 3.0)
            feed(opt_a, a, grads)
            feed(opt_b, b, grads)
        for p, q in zip(a, b):
            torch.testing.assert_close(q, p, rtol=1e-13, atol=1e-15)
            for key, value in opt_a.state[p].items():
                torch.testing.assert_close(opt_b.state[q][key], value, rtol=1e-13, atol=1e-15)
