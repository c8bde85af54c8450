"""Atomic refusals (issue 45 item 5): a step that refuses a hyperparameter changes nothing.

A group's hyperparameters are read at each step, and a scheduler or a user may have written
any of them since the constructor checked it.  Every optimizer ``torch_impl`` exports must
then check every group before it changes any: for each optimizer and each hyperparameter its
groups hold, the battery steps once (so every group has state and counters), writes a value
the step must refuse into the *last* group (alone, in a combination that is refused, or as a
change that the group's tensors no longer fit: ``matrix_batch_dims``), and expects a
``ValueError`` naming it, with every parameter, gradient, state tensor, step counter (CPU
tensors, and a preconditioner's own) and the backbone's state bit-identical to before the call.
Were a check made group by group while stepping, the first group would have stepped before
the last one's refusal (issue 45: MARS-M's ``matrix_batch_dims``, a parameter moved 4.6e-4 and
its counter 1 -> 2).

The subjects and values are ``theory_tests/support/atomic_cases.py``; the hyperparameters are
each optimizer's ``defaults`` keys, so an option added later fails
``test_every_hyperparameter_is_refused_or_exempt`` until the battery covers it.
"""
import copy
import inspect

import pytest
import torch

import torch_impl
from theory_tests.support.atomic_cases import BAD, SUBJECTS, UNCHECKED

def _cases():
    for name, keys in BAD.items():
        for key, entries in keys.items():
            for i, (update, pattern) in enumerate(entries):
                yield pytest.param(name, update, pattern, id=f"{name}-{key}-{i}")


def _assert_same(a, b, where="state"):
    """Bit for bit: tensors equal with the same dtype and shape; containers entry by entry."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} changed"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys changed"
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: length changed"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} -> {b!r}"


@pytest.mark.parametrize("name, update, pattern", list(_cases()))
def test_a_refused_group_changes_nothing_in_any_group(name, update, pattern):
    subject = SUBJECTS[name]
    opt, params, grads = subject.build()
    grads(0)
    opt.step()  # every group has state and counters now
    opt.param_groups[-1].update(update)
    grads(1)
    state, counters = copy.deepcopy(opt.state_dict()), subject.counters(opt)
    values, gradients = [p.detach().clone() for p in params], [p.grad.clone() for p in params]
    with pytest.raises(ValueError, match=pattern):
        opt.step()
    _assert_same(opt.state_dict(), state)
    _assert_same([p.detach() for p in params], values, "parameters")
    _assert_same([p.grad for p in params], gradients, "gradients")
    _assert_same(subject.counters(opt), counters, "counters")


def _exported_optimizers():
    return {name for name in torch_impl.__all__
            if inspect.isclass(getattr(torch_impl, name))
            and issubclass(getattr(torch_impl, name), torch.optim.Optimizer)}


def test_every_exported_optimizer_is_a_subject():
    assert set(SUBJECTS) == _exported_optimizers()
    assert set(BAD) == set(SUBJECTS) == set(UNCHECKED)


@pytest.mark.parametrize("name", sorted(SUBJECTS))
def test_every_hyperparameter_is_refused_or_exempt(name):
    """The keys every group holds (the constructor's defaults) against the battery's: each is
    refused in some value, or exempt with a reason -- never both, never neither."""
    opt, _, _ = SUBJECTS[name].build()
    keys = set(opt.defaults)
    refused, exempt = set(BAD[name]), set(UNCHECKED[name])
    assert not refused & exempt, refused & exempt
    assert keys == refused | exempt, dict(missing=keys - refused - exempt,
                                          unknown=(refused | exempt) - keys)
    assert all(isinstance(why, str) and why for why in UNCHECKED[name].values())


@pytest.mark.parametrize("name", ["MARS", "MARSM"])
def test_exact_mode_refuses_before_moving_to_the_previous_iterate(name):
    """Exact mode evaluates the closure at x_{t-1} before the update: the groups are checked
    before that, so a refused step neither calls the closure nor writes ``prev_param``."""
    params = [torch.nn.Parameter(torch.ones(3, 2, dtype=torch.float64)),
              torch.nn.Parameter(torch.ones(2, dtype=torch.float64))]
    cls = getattr(torch_impl, name)
    opt = cls([dict(params=params[:1]), dict(params=params[1:])], lr=1e-2, is_approx=False)
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = params[0].sum().square() + params[1].square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    opt.param_groups[-1]["lr"] = -1.0
    state, values, n = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params], \
        len(calls)
    with pytest.raises(ValueError, match=r"^lr: "):
        opt.step(closure)
    assert len(calls) == n
    _assert_same(opt.state_dict(), state)
    _assert_same([p.detach() for p in params], values, "parameters")


def test_a_foreign_backbones_check_groups_is_not_assumed_to_be_ours():
    """MKOR / K-FAC run this library's backbones' ``_check_groups`` before preconditioning;
    a method of that name on another class may do anything, so it is not called."""
    class Foreign(torch.optim.SGD):
        def _check_groups(self):
            raise AssertionError("called")
    for cls in (torch_impl.MKOR, torch_impl.KFAC):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        pre = cls(model, Foreign(model.parameters(), lr=0.1))
        model(torch.randn(4, 3)).square().sum().backward()
        pre.step()
