"""The functional API refuses lists it cannot describe a step of (issue 30, item 1).

``torch_impl.mars.functional.mars`` / ``.mars_m`` take parallel lists, as torch.optim's
functional forms do.  A call whose lists disagree in length, whose ``kinds`` name no route, or
whose route lacks a buffer it updates raises a ``ValueError`` naming the argument, before any
parameter, buffer or step counter changes -- where ``zip`` would have stepped the pairs it
kept (and advanced the other counters), and an unknown kind would have taken the AdamW rule.
torch's functional AdamW raises on mismatched lists too (the first test).
"""
import pytest
import torch
from torch.optim.adamw import adamw

from torch_impl.mars import functional
from torch_impl.mars import mars_equations
from torch_impl.mars import mars_m_equations

F64 = torch.float64
SHAPES = [(4, 3), (5, 2)]
MARS_HYPER = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, amsgrad=False,
                  gamma=0.025, lr_1d_factor=1.0, betas_1d=(0.9, 0.95), weight_decay_1d=0.1)
MARS_M_HYPER = dict(lr=0.01, weight_decay=0.1, momentum=0.95, gamma=0.025)


def _tensors(seed, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=F64) for s in shapes]


def _mars_lists(kinds=(mars_equations.ADAMW, mars_equations.ADAMW)):
    """params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, last_grads, state_steps, kinds
    of a call after one step (non-zero state, so that a write anywhere shows)."""
    n = len(SHAPES)
    lists = [_tensors(1), _tensors(2), _tensors(3), [t.abs() for t in _tensors(4)], [None] * n,
             _tensors(5), [torch.tensor(1.0) for _ in range(n)], list(kinds)]
    lists[3] = [v if k in (mars_equations.ADAMW, mars_equations.FALLBACK) else None
                for v, k in zip(lists[3], kinds)]
    return lists


def _mars_m_lists(kinds=(mars_m_equations.MATRIX, mars_m_equations.MATRIX)):
    n = len(SHAPES)
    return [_tensors(1), _tensors(2), _tensors(3), _tensors(4), _tensors(5),
            [t.abs() for t in _tensors(6)], [torch.tensor(1.0) for _ in range(n)], list(kinds)]


def _snapshot(lists):
    return [[t.clone() if torch.is_tensor(t) else t for t in column] for column in lists]


def _unchanged(lists, before):
    return all((a is None and b is None) or (torch.is_tensor(a) and torch.equal(a, b))
               or a == b for col, col0 in zip(lists, before) for a, b in zip(col, col0))


def test_torch_functional_adamw_refuses_a_missing_gradient():
    """The behaviour ours follows: torch's functional AdamW with 2 parameters, 1 gradient."""
    p, g, m, v = _tensors(1), _tensors(2), _tensors(3), _tensors(4)
    with pytest.raises((ValueError, RuntimeError, IndexError)):
        adamw(p, g[:1], m, v, [], [torch.tensor(1.0)] * 2, foreach=False, amsgrad=False,
              beta1=0.9, beta2=0.99, lr=0.01, weight_decay=0.0, eps=1e-8, maximize=False)


# (the column cut short, the message's argument) for each list of the call
MARS_COLUMNS = [(1, "grads"), (2, "exp_avgs"), (3, "exp_avg_sqs"), (5, "last_grads"),
                (6, "state_steps"), (7, "kinds")]
MARS_M_COLUMNS = [(1, "grads"), (2, "momentum_buffers"), (3, "last_grads"), (6, "state_steps"),
                  (7, "kinds")]


@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
@pytest.mark.parametrize("column, name", MARS_COLUMNS, ids=[n for _, n in MARS_COLUMNS])
def test_mars_refuses_lists_of_different_lengths_and_changes_nothing(column, name, foreach):
    lists = _mars_lists()
    before = _snapshot(lists)
    lists[column] = lists[column][:1]
    with pytest.raises(ValueError, match=rf"mars: {name} must have one entry per parameter"):
        functional.mars(*lists, foreach=foreach, **MARS_HYPER)
    assert _unchanged(lists, before)


@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
@pytest.mark.parametrize("column, name", MARS_M_COLUMNS, ids=[n for _, n in MARS_M_COLUMNS])
def test_mars_m_refuses_lists_of_different_lengths_and_changes_nothing(column, name, foreach):
    lists = _mars_m_lists()
    before = _snapshot(lists)
    lists[column] = lists[column][:1]
    with pytest.raises(ValueError, match=rf"mars_m: {name} must have one entry per parameter"):
        functional.mars_m(*lists, foreach=foreach, **MARS_M_HYPER)
    assert _unchanged(lists, before)


@pytest.mark.parametrize("kind", ["mars-lion", "Lion", "bogus", "mars-adamw", "ADAMW"])
@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
def test_mars_refuses_a_kind_that_names_no_route(kind, foreach):
    """A mars_type, another spelling, or a typo is not a route: refused, nothing changes
    (before: the AdamW rule ran for every one of them)."""
    lists = _mars_lists()
    lists[7][1] = kind
    before = _snapshot(lists)
    with pytest.raises(ValueError, match=r"kinds\[1\]: expected one of \('adamw', 'lion', "
                                         r"'shampoo', 'fallback'\)"):
        functional.mars(*lists, foreach=foreach, **MARS_HYPER)
    assert _unchanged(lists, before)


@pytest.mark.parametrize("kind", ["muon", "mars-m", "MARS_M", "efficient"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_mars_m_refuses_a_kind_that_names_no_route(kind, compiled):
    """(before: ``kinds=["muon"]`` left the parameter as it was and advanced its step)"""
    lists = _mars_m_lists()
    lists[7][0] = kind
    before = _snapshot(lists)
    with pytest.raises(ValueError, match=r"kinds\[0\]: expected one of \('mars_m', "
                                         r"'mars_m_efficient', 'adamw'\)"):
        functional.mars_m(*lists, compiled=compiled, **MARS_M_HYPER)
    assert _unchanged(lists, before)


@pytest.mark.parametrize("kind, column, name", [
    (mars_equations.ADAMW, 3, "exp_avg_sqs"), (mars_equations.FALLBACK, 3, "exp_avg_sqs"),
    (mars_equations.LION, 5, "last_grads"), (mars_equations.SHAMPOO, 2, "exp_avgs"),
    (mars_equations.ADAMW, 1, "grads")])
def test_mars_refuses_a_route_without_the_buffer_it_updates(kind, column, name):
    lists = _mars_lists((kind, kind))
    lists[column][0] = None
    before = _snapshot(lists)
    with pytest.raises(ValueError, match=rf"{name}\[0\]: route '{kind}' updates this buffer"):
        functional.mars(*lists, **MARS_HYPER)
    assert _unchanged(lists, before)


def test_mars_with_amsgrad_needs_the_maximum_buffer():
    lists = _mars_lists()
    with pytest.raises(ValueError, match=r"max_exp_avg_sqs\[0\]: route 'adamw' updates"):
        functional.mars(*lists, **{**MARS_HYPER, "amsgrad": True})


def test_a_misshapen_buffer_is_refused_before_anything_changes():
    lists = _mars_lists()
    lists[2][1] = lists[2][1].t().contiguous()  # (2, 5) for a (5, 2) parameter
    before = _snapshot(lists)
    with pytest.raises(ValueError, match=r"exp_avgs\[1\]: shape \(2, 5\) differs from its "
                                         r"parameter's \(5, 2\)"):
        functional.mars(*lists, **MARS_HYPER)
    assert _unchanged(lists, before)


def test_matrix_routes_refuse_a_tensor_that_is_not_a_matrix():
    lists = _mars_lists((mars_equations.SHAMPOO, mars_equations.SHAMPOO))
    for column in (0, 1, 2, 5):
        lists[column][0] = lists[column][0].flatten()
    with pytest.raises(ValueError, match=r"route 'shampoo' orthogonalises a matrix"):
        functional.mars(*lists, **MARS_HYPER)
    lists = _mars_m_lists((mars_m_equations.EFFICIENT, mars_m_equations.MATRIX))
    for column in (0, 1, 2, 3):
        lists[column][0] = lists[column][0].flatten()
    with pytest.raises(ValueError, match=r"route 'mars_m_efficient' orthogonalises a matrix"):
        functional.mars_m(*lists, **MARS_M_HYPER)


@pytest.mark.parametrize("counter", [1, torch.tensor([1.0, 1.0])], ids=["int", "two-element"])
def test_a_step_counter_that_is_not_a_cpu_tensor_is_refused(counter):
    lists = _mars_lists()
    lists[6][1] = counter
    with pytest.raises(ValueError, match=r"state_steps\[1\]: expected a one-element CPU tensor"):
        functional.mars(*lists, **MARS_HYPER)


@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
def test_valid_lists_still_step_every_route(foreach):
    """The checks let every well-formed call through: each route changes its parameter and
    advances its counter once."""
    kinds = (mars_equations.ADAMW, mars_equations.LION, mars_equations.SHAMPOO,
             mars_equations.FALLBACK)
    shapes = [(4, 3), (5, 2), (3, 3), (6,)]
    n = len(shapes)
    p, g = _tensors(1, shapes), _tensors(2, shapes)
    lists = [p, g, _tensors(3, shapes),
             [t.abs() if k in (mars_equations.ADAMW, mars_equations.FALLBACK) else None
              for t, k in zip(_tensors(4, shapes), kinds)],
             [None] * n, [t if k != mars_equations.FALLBACK else None
                          for t, k in zip(_tensors(5, shapes), kinds)],
             [torch.tensor(1.0) for _ in range(n)], list(kinds)]
    before = [t.clone() for t in p]
    functional.mars(*lists, foreach=foreach, ns_dtype=F64, **MARS_HYPER)
    assert all(not torch.equal(a, b) for a, b in zip(p, before))
    assert all(k.item() == 2.0 for k in lists[6])
