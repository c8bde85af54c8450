"""A tensor without a gradient for a step: what g_prev is next (issue 30, item 5).

The rule, in both modes and both optimizers (``MARS``, ``MARSM``): a tensor that did not enter
a loss has gradient 0 in it.  The tensor itself sits the step out (as torch.optim skips a
parameter whose ``grad`` is ``None``: no update, no state change, no step count), and

* approx mode (M2), g_prev = g_{t-1} = grad f(x_{t-1}, xi_{t-1}): after a step the tensor
  sat out, g_prev = 0, so its next step is c = (1 + a) g (the recursion's start) -- before,
  it took the gradient of the last step it took part in, two or more steps back;
* exact mode (M1), g_prev = grad f(x_{t-1}, xi_t): 0 where the tensor had no gradient at
  x_{t-1}; the authors' loop (``update_previous_grad``) likewise stores 0 for a tensor
  without a gradient on the next batch (before, it kept the older one).

Each test computes the expected step independently, with the float64 oracle's equations.
"""
import numpy as np
import pytest
import torch

from reference.mars import mars_equations as R
from theory_tests.support.mars_property_helpers import feed, make_params
from torch_impl import MARS, MARSM

F64 = torch.float64
SHAPES = [(4, 3), (5, 2)]
HYPER = dict(lr=0.05, betas=(0.9, 0.99), gamma=0.1, weight_decay=0.01, eps=1e-8)


def _grads(t):
    gen = torch.Generator().manual_seed(90 + t)
    return [torch.randn(s, generator=gen, dtype=F64) for s in SHAPES]


def _np(t):
    return t.detach().numpy().copy()


def _backward_on(opt, a, b):
    """``backward(with_b)``: zero the gradients, then backward of |sum a|^2 (+ |sum b|^2 if
    ``with_b``, else b gets no gradient); returns the loss (a closure for exact mode)."""
    def backward(with_b):
        opt.zero_grad()
        loss = a.sum().square() + (b.sum().square() if with_b else 0.0)
        loss.backward()
        return loss
    return backward


def _sat_out(opt, params, t_out=1, steps=3):
    """Steps 0 .. t_out with the second tensor without a gradient at step ``t_out``; returns
    its parameter and state just before step t_out + 1 (the first step after)."""
    for t in range(t_out + 1):
        grads = _grads(t)
        if t == t_out:
            grads[1] = None
        feed(opt, params, grads)
    q = params[1]
    return _np(q), {k: v.clone() for k, v in opt.state[q].items()}


@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
def test_approx_mars_adamw_after_a_step_without_gradient_corrects_from_zero(foreach):
    params = make_params(SHAPES, seed=2)
    opt = MARS(params, foreach=foreach, **HYPER)
    before, state = _sat_out(opt, params)
    assert torch.equal(state["last_grad"], torch.zeros_like(state["last_grad"]))
    assert state["step"].item() == 1.0  # the step it sat out did not count
    g = _grads(2)
    feed(opt, params, g)
    beta1, beta2 = HYPER["betas"]
    c = R.clip_tensor(R.corrected_gradient(_np(g[1]), 0.0, HYPER["gamma"], beta1))
    m = R.momentum(_np(state["exp_avg"]), c, beta1)
    v = R.second_moment(_np(state["exp_avg_sq"]), c, beta2)
    expected = R.adamw_step(before, m, v, 2, HYPER["lr"], beta1, beta2, HYPER["eps"],
                            HYPER["weight_decay"])
    np.testing.assert_allclose(_np(params[1]), expected, rtol=0, atol=1e-13)


def test_approx_mars_lion_after_a_step_without_gradient_corrects_from_zero():
    params = make_params(SHAPES, seed=3)
    opt = MARS(params, mars_type="mars-lion", **HYPER)
    before, state = _sat_out(opt, params)
    g = _grads(2)
    feed(opt, params, g)
    beta1 = HYPER["betas"][0]
    c = R.clip_tensor(R.corrected_gradient(_np(g[1]), 0.0, HYPER["gamma"], beta1))
    m = R.momentum(_np(state["exp_avg"]), c, beta1)
    np.testing.assert_allclose(opt.state[params[1]]["exp_avg"].numpy(), m, rtol=0, atol=1e-15)
    np.testing.assert_allclose(_np(params[1]), R.lion_step(before, m, HYPER["lr"],
                                                           HYPER["weight_decay"]),
                               rtol=0, atol=1e-15)


@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
def test_approx_mars_m_after_a_step_without_gradient_corrects_from_zero(foreach):
    """MARS-M's momentum after the gap is that of c = (1 + a) g (compared on the buffer, the
    input of Newton-Schulz)."""
    params = make_params(SHAPES, seed=4)
    opt = MARSM(params, lr=0.05, momentum=0.9, gamma=0.1, ns_dtype=F64, foreach=foreach)
    _, state = _sat_out(opt, params)
    assert torch.equal(state["last_grad"], torch.zeros_like(state["last_grad"]))
    g = _grads(2)
    feed(opt, params, g)
    c = R.clip_tensor(R.corrected_gradient(_np(g[1]), 0.0, 0.1, 0.9))
    np.testing.assert_allclose(opt.state[params[1]]["momentum_buffer"].numpy(),
                               R.momentum(_np(state["momentum_buffer"]), c, 0.9),
                               rtol=0, atol=1e-15)


def test_the_tensor_that_sits_out_a_step_is_not_changed_by_it():
    params = make_params(SHAPES, seed=5)
    opt = MARS(params, **HYPER)
    feed(opt, params, _grads(0))
    q, before = params[1], params[1].detach().clone()
    state = {k: v.clone() for k, v in opt.state[q].items() if k != "last_grad"}
    feed(opt, params, [_grads(1)[0], None])
    assert torch.equal(q, before)
    assert all(torch.equal(opt.state[q][k], v) for k, v in state.items())


@pytest.mark.parametrize("cls", [MARS, MARSM])
def test_exact_mode_takes_zero_for_a_tensor_without_gradient_at_the_previous_iterate(cls):
    """Exact mode (closure): at step 3 the closure leaves b out of its first evaluation (at
    x_{t-1}) and keeps it in the second (at x_t), so b's g_prev is 0 -- the same rule."""
    a, b = make_params(SHAPES, seed=6)
    opt = cls([a, b], is_approx=False, lr=0.05, gamma=0.1, **(
        dict(betas=(0.9, 0.99), weight_decay=0.01) if cls is MARS else dict(momentum=0.9)))
    x = [torch.randn(s[1], generator=torch.Generator().manual_seed(i), dtype=F64)
         for i, s in enumerate(SHAPES)]

    def closure_for(leave_b_out_at_previous):
        calls = []

        def closure():
            calls.append(1)
            opt.zero_grad()
            loss = (a @ x[0]).square().sum()
            if not (leave_b_out_at_previous and len(calls) == 1):
                loss = loss + (b @ x[1]).sin().sum()
            loss.backward()
            return loss
        return closure

    opt.step(closure_for(False))
    opt.step(closure_for(False))
    before = {k: v.clone() for k, v in opt.state[b].items()}
    b0 = _np(b)
    opt.step(closure_for(True))
    g = np.outer(np.cos(b0 @ _np(x[1])), _np(x[1]))  # grad of sum(sin(b x)) at x_t
    c = R.clip_tensor(R.corrected_gradient(g, 0.0, 0.1, 0.9))
    if cls is MARSM:
        np.testing.assert_allclose(opt.state[b]["momentum_buffer"].numpy(),
                                   R.momentum(_np(before["momentum_buffer"]), c, 0.9),
                                   rtol=0, atol=1e-14)
        return
    m = R.momentum(_np(before["exp_avg"]), c, 0.9)
    v = R.second_moment(_np(before["exp_avg_sq"]), c, 0.99)
    np.testing.assert_allclose(_np(b), R.adamw_step(b0, m, v, 3, 0.05, 0.9, 0.99, 1e-8, 0.01),
                               rtol=0, atol=1e-13)


@pytest.mark.parametrize("cls", [MARS, MARSM])
def test_authors_loop_stores_zero_for_a_tensor_without_gradient_on_the_next_batch(cls):
    """``update_previous_grad`` on a batch the tensor is outside of: its g_prev is 0 (the
    previous_grad of the batch before is not carried on)."""
    a, b = make_params(SHAPES, seed=7)
    opt = cls([a, b], is_approx=False, lr=0.05)

    backward = _backward_on(opt, a, b)

    for with_b in (True, True):  # two rounds of the authors' loop with b in every batch
        backward(True)
        opt.update_previous_grad()
        backward(True)
        opt.step()
        opt.update_last_grad()
    assert not torch.equal(opt.state[b]["last_grad"], torch.zeros_like(b))
    backward(False)  # the next batch leaves b out
    opt.update_previous_grad()
    backward(True)
    opt.step()
    opt.update_last_grad()
    assert torch.equal(opt.state[b]["last_grad"], torch.zeros_like(b))


def test_authors_loop_after_closure_steps_stores_zero_for_a_tensor_without_gradient():
    """A tensor with a ``last_grad`` (closure steps so far) but no ``previous_grad`` yet, left
    out of the next batch in the authors' loop: a zero ``previous_grad`` is made for it."""
    a, b = make_params(SHAPES, seed=8)
    opt = MARS([a, b], is_approx=False, lr=0.05)

    backward = _backward_on(opt, a, b)

    for _ in range(2):
        opt.step(lambda: backward(True))
    assert "previous_grad" not in opt.state[b]
    assert not torch.equal(opt.state[b]["last_grad"], torch.zeros_like(b))
    backward(False)
    opt.update_previous_grad()
    backward(True)
    opt.step()
    opt.update_last_grad()
    assert torch.equal(opt.state[b]["last_grad"], torch.zeros_like(b))
