"""Hyperparameters as tensors, where ``torch.optim.AdamW`` takes them (issue 30, item 3).

AdamW takes ``lr`` and ``betas`` as one-element tensors (torch's advice for a compiled step
with a scheduler: the scheduler writes into the tensor, the graph reads it as data).  So do
``MARS`` (``lr``, ``betas``, ``betas_1d``), ``MARSM`` (``lr``, ``momentum`` -- its beta1 --,
``adamw_betas``) and ``LAMB`` (``lr``, ``betas``), and so ``MKOR(model, LAMB(lr=tensor))``.
An eager step reads them on the host (CPU tensors: no device sync) and runs bit for bit as
with the same numbers; ``torch.compile(opt.step)`` traces them as tensors, one graph for every
value a schedule writes.
"""
import pytest
import torch
from torch._dynamo.utils import counters

from theory_tests.support.mars_property_helpers import clone_params, feed, make_params
from torch_impl import LAMB, MARS, MARSM, MKOR

F32 = torch.float32
EPS32 = torch.finfo(F32).eps
SHAPES = [(4, 6), (4,)]  # a matrix and a bias: every optimizer's two routes
STEPS = 3


def _t(x):
    return torch.tensor(x)


# name -> (class, constructor keywords: TENSOR_KEYS among them are passed as tensors, a pair
# as a tuple of tensors like AdamW's betas)
CASES = {
    "mars-adamw": (MARS, dict(lr=0.02, betas=(0.9, 0.99), betas_1d=(0.8, 0.95))),
    "mars-adamw-global-clip": (MARS, dict(lr=0.02, betas=(0.9, 0.99), clip_scope="global",
                                          optimize_1d=True)),
    "mars-lion-1d": (MARS, dict(lr=0.02, betas=(0.9, 0.99), mars_type="mars-lion",
                                optimize_1d=True)),
    "mars-shampoo": (MARS, dict(lr=0.02, betas=(0.9, 0.99), mars_type="mars-shampoo",
                                ns_dtype=F32)),
    "mars-m": (MARSM, dict(lr=0.02, momentum=0.9, adamw_betas=(0.8, 0.95), ns_dtype=F32)),
    "mars-m-efficient": (MARSM, dict(lr=0.02, momentum=0.9, adamw_betas=(0.8, 0.95),
                                     ns_dtype=F32, efficient=True)),
    "lamb": (LAMB, dict(lr=0.02, betas=(0.9, 0.99))),
}
TENSOR_KEYS = ("lr", "betas", "betas_1d", "momentum", "adamw_betas")


def _r(x):
    """The number a float32 tensor of ``x`` holds (``torch.tensor(0.9).item()`` is
    0.89999998): the numbers run takes these, so both runs use the same values."""
    return tuple(_r(b) for b in x) if isinstance(x, tuple) else _t(x).item()


def _as_numbers(kw):
    return {k: _r(v) if k in TENSOR_KEYS else v for k, v in kw.items()}


def _as_tensors(kw):
    out = dict(kw)
    for key in TENSOR_KEYS:
        if key in out:
            v = out[key]
            out[key] = tuple(_t(b) for b in v) if isinstance(v, tuple) else _t(v)
    return out


def _schedule(t, group, tensors, keys):
    """A schedule on every tensor-able hyperparameter: written in place (``fill_``) for a
    tensor, assigned for a number -- the same values either way."""
    values = {"lr": 0.02 / (t + 2), "betas": (0.9 - 0.05 * t, 0.99 - 0.01 * t),
              "betas_1d": (0.8 - 0.05 * t, 0.95), "momentum": 0.9 - 0.05 * t,
              "adamw_betas": (0.8 - 0.05 * t, 0.95 - 0.01 * t)}
    for key, value in values.items():
        if key not in keys:  # the ones the test passed (others keep their defaults)
            continue
        if not tensors:
            group[key] = _r(value)
        elif isinstance(value, tuple):
            for b, v in zip(group[key], value):
                b.fill_(v)
        else:
            group[key].fill_(value)


def _grads(t, dtype=F32):
    gen = torch.Generator().manual_seed(70 + t)
    return [torch.randn(s, generator=gen, dtype=dtype) for s in SHAPES]


@pytest.mark.parametrize("dtype", [F32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
@pytest.mark.parametrize("name", CASES)
def test_tensor_hyperparameters_step_bit_for_bit_as_numbers(name, foreach, dtype):
    """(float32 tensors hold the hyperparameters in either parameter dtype)"""
    cls, kw = CASES[name]
    a = make_params(SHAPES, seed=5, dtype=dtype)
    b = clone_params(a)
    numbers = cls(a, foreach=foreach, **_as_numbers(kw))
    tensors = cls(b, foreach=foreach, **_as_tensors(kw))
    for t in range(STEPS):
        feed(numbers, a, _grads(t, dtype))
        feed(tensors, b, _grads(t, dtype))
        _schedule(t, numbers.param_groups[0], tensors=False, keys=kw)
        _schedule(t, tensors.param_groups[0], tensors=True, keys=kw)
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        for key, value in numbers.state[p].items():
            assert torch.equal(tensors.state[q][key], value), key


@pytest.mark.parametrize("name", CASES)
def test_compiled_step_with_scheduled_tensor_hyperparameters_does_not_recompile(name):
    """``torch.compile(opt.step)`` with every tensor hyperparameter rewritten after each step:
    one graph, no graph break, and the eager run with the same numbers to a few float32 ulps
    per step (the graph may fuse and reassociate; |update| <= lr O(1) << |p|)."""
    cls, kw = CASES[name]
    torch._dynamo.reset()
    counters.clear()
    a = make_params(SHAPES, seed=6, dtype=F32)
    b = clone_params(a)
    eager, compiled = cls(a, **_as_numbers(kw)), cls(b, **_as_tensors(kw))
    step = torch.compile(compiled.step, backend="aot_eager")
    for t in range(STEPS):
        feed(eager, a, _grads(t))
        for p, g in zip(b, _grads(t)):
            p.grad = g.clone()
        step()
        _schedule(t, eager.param_groups[0], tensors=False, keys=kw)
        _schedule(t, compiled.param_groups[0], tensors=True, keys=kw)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    scale = max(p.abs().max().item() for p in a)
    for p, q in zip(b, a):
        torch.testing.assert_close(p, q, rtol=0, atol=STEPS * 4 * EPS32 * max(1.0, scale))


def test_mkor_on_a_lamb_with_a_tensor_lr_steps_as_with_the_number():
    def run(lr):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
        opt = MKOR(model, LAMB(model.parameters(), lr=lr))
        for t in range(3):
            x = torch.randn(8, 6, generator=torch.Generator().manual_seed(t))
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        return [p.detach() for p in model.parameters()]
    assert all(torch.equal(p, q) for p, q in zip(run(_r(0.01)), run(_t(0.01))))


@pytest.mark.parametrize("cls, key, value, message", [
    (LAMB, "lr", _t(-1.0), r"lr: expected a value >= 0"),
    (LAMB, "betas", (_t(1.0), _t(0.9)), r"betas\[0\]: expected a value in \[0.0, 1.0\)"),
    (MARS, "betas", (_t(0.9), _t(1.5)), r"betas\[1\]: expected a value in"),
    (MARS, "betas_1d", (_t(-0.1), _t(0.9)), r"betas_1d\[0\]: expected a value in"),
    (MARSM, "momentum", _t(1.0), r"momentum: expected a value in"),
    (MARSM, "adamw_betas", (_t(0.9), _t(1.0)), r"adamw_betas\[1\]: expected a value in"),
    (LAMB, "lr", torch.tensor([1e-3, 1e-3]), r"lr: a tensor lr must be a one-element"),
    (MARS, "betas", (torch.tensor(1, dtype=torch.int64), _t(0.9)),
     r"betas\[0\]: a tensor betas\[0\] must be a one-element floating-point"),
    (MARSM, "momentum", torch.tensor(0.9, requires_grad=True), r"momentum: a tensor momentum"),
])
def test_a_tensor_hyperparameter_is_checked_as_its_number(cls, key, value, message):
    with pytest.raises(ValueError, match=message):
        cls([torch.nn.Parameter(torch.zeros(2, 2))], **{key: value})


def test_an_efficient_mars_m_with_a_tensor_momentum_of_zero_is_refused():
    with pytest.raises(ValueError, match=r"momentum: the efficient recursion"):
        MARSM([torch.nn.Parameter(torch.zeros(2, 2))], momentum=_t(0.0), efficient=True)
