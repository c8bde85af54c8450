"""The torch.optim conformance points of ``torch_impl.MARS`` that torch's own optimizer tests
check (test_optim.py: state_dict after load, numeric ``step``, tensor lr), the amsgrad
combinations that cannot act, MARS-Shampoo's shape scale for weights stored transposed
(transformers' ``Conv1D``), and the authors' exact-mode API (``update_previous_grad`` /
``update_last_grad``, ``train_mars.py``'s loop)."""
import copy

import numpy as np
import pytest
import torch

from theory_tests.support.mars_harness import batches, grad_oracle, initial_params, run_torch, torch_loss
from theory_tests.support.mars_property_helpers import F64, MARS_TYPES, assert_same_optimizer, clone_params, feed, \
    make_params
from reference.mars.mars import MARSConfig, mars_trajectory
from reference.mars.mars_equations import shampoo_step, shape_scale
from torch_impl import MARS

SHAPES = [(5, 4), (6,), (3, 7)]


def _grads(t, shapes=SHAPES):
    gen = torch.Generator().manual_seed(300 + t)
    return [torch.randn(s, generator=gen, dtype=F64) * 2 for s in shapes]


def _primed(mars_type, steps=3, **kw):
    params = make_params(SHAPES, 1)
    opt = MARS(params, mars_type=mars_type, ns_dtype=F64, **kw)
    for t in range(steps):
        feed(opt, params, _grads(t))
    return params, opt


@pytest.mark.parametrize("mars_type", MARS_TYPES)
def test_state_dict_after_load_equals_the_one_loaded(mars_type):
    params, opt = _primed(mars_type)
    saved = copy.deepcopy(opt.state_dict())
    twin = MARS(clone_params(params), mars_type=mars_type, ns_dtype=F64)
    twin.load_state_dict(saved)
    again = twin.state_dict()
    assert again["param_groups"] == saved["param_groups"]  # no key gained (differentiable)
    assert again["state"].keys() == saved["state"].keys()
    for i, st in saved["state"].items():
        assert again["state"][i].keys() == st.keys()
        assert all(torch.equal(again["state"][i][k], v) for k, v in st.items())


@pytest.mark.parametrize("mars_type", MARS_TYPES)
def test_checkpoint_with_numeric_step_loads_and_continues(mars_type):
    params, opt = _primed(mars_type)
    sd = copy.deepcopy(opt.state_dict())
    for st in sd["state"].values():
        st["step"] = int(st["step"].item())  # older torch / other MARS ports
    b = clone_params(params)
    twin = MARS(b, mars_type=mars_type, ns_dtype=F64)
    twin.load_state_dict(sd)
    for t in range(3, 6):
        feed(opt, params, _grads(t))
        feed(twin, b, _grads(t))
    assert_same_optimizer(params, opt, b, twin)


@pytest.mark.parametrize("mars_type", MARS_TYPES)
def test_tensor_lr_equals_float_lr(mars_type):
    a = make_params(SHAPES, 2)
    b = clone_params(a)
    opt_a = MARS(a, lr=0.01, mars_type=mars_type, ns_dtype=F64)
    opt_b = MARS(b, lr=torch.tensor(0.01, dtype=F64), mars_type=mars_type, ns_dtype=F64)
    assert opt_b.param_groups[0]["lr_1d_factor"] == opt_a.param_groups[0]["lr_1d_factor"]
    for t in range(3):
        feed(opt_a, a, _grads(t))
        feed(opt_b, b, _grads(t))
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    with pytest.raises(ValueError, match="lr"):
        MARS(make_params([(2, 2)]), lr=torch.tensor([0.1, 0.2]))


@pytest.mark.parametrize("mars_type,optimize_1d", [("mars-lion", False), ("mars-lion", True),
                                                   ("mars-shampoo", False)])
def test_amsgrad_that_cannot_act_raises(mars_type, optimize_1d):
    with pytest.raises(ValueError, match="amsgrad"):
        MARS(make_params([(2, 2)]), mars_type=mars_type, optimize_1d=optimize_1d, amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):  # and per group
        MARS([dict(params=make_params([(2, 2)]), amsgrad=True)], mars_type=mars_type,
             optimize_1d=optimize_1d)


def test_amsgrad_acts_on_mars_shampoos_adamw_rule_with_optimize_1d():
    params, opt = _primed("mars-shampoo", amsgrad=True, optimize_1d=True)
    assert "max_exp_avg_sq" in opt.state[params[1]]          # the 1-D tensor: AdamW rule
    assert "max_exp_avg_sq" not in opt.state[params[0]]      # a matrix: Newton-Schulz


def test_shape_layout_in_out_gives_the_true_shape_scale():
    """A weight stored in x out (Conv1D) with ``shape_layout="in_out"`` steps exactly as the
    same weight stored out x in, transposed: s = sqrt(max(1, out/in)) from the true shape."""
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    layer = conv1d(12, 3).double()  # nf = 12 outputs, nx = 3 inputs: weight (3, 12)
    w = layer.weight
    assert tuple(w.shape) == (3, 12)
    wt = torch.nn.Parameter(w.detach().T.clone())  # the nn.Linear layout (12, 3)
    kw = dict(lr=0.01, mars_type="mars-shampoo", ns_dtype=F64, weight_decay=0.1)
    opt = MARS([dict(params=[w], shape_layout="in_out")], **kw)
    opt_t = MARS([wt], **kw)
    plain = torch.nn.Parameter(w.detach().clone())
    opt_plain = MARS([plain], **kw)
    for t in range(4):
        g = _grads(t, [(3, 12)])[0]
        feed(opt, [w], [g])
        feed(opt_t, [wt], [g.T])
        feed(opt_plain, [plain], [g])
    assert torch.equal(w.detach(), wt.detach().T)
    assert (w - plain).abs().max() > 1e-4  # s = 1 for the stored shape: the default differs


def test_reference_shampoo_step_scale_matches_the_port():
    rng = np.random.default_rng(0)
    p, m = rng.normal(size=(3, 12)), rng.normal(size=(3, 12))
    s_true = shape_scale((12, 3))
    expected = shampoo_step(p, m, 0.01, 0.95, 1e-8, 0.1, scale=s_true)
    param = torch.nn.Parameter(torch.tensor(p))
    opt = MARS([dict(params=[param], shape_layout="in_out")], lr=0.01, mars_type="mars-shampoo",
               ns_dtype=F64, weight_decay=0.1, clip_scope="none", gamma=0.0)
    opt.state[param]["exp_avg"] = torch.tensor(m) / 0.95  # g = 0: m_1 = 0.95 m_0 = m
    feed(opt, [param], [torch.zeros(3, 12, dtype=F64)])
    np.testing.assert_allclose(param.detach().numpy(), expected, rtol=0, atol=1e-14)


# ------------------------------------------------------------------ the authors' exact loop

@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("mars_type", MARS_TYPES)
def test_authors_exact_loop_equals_closure_exact_mode(mars_type, foreach):
    """``train_mars.py``: backward on the next batch at x_t, ``update_previous_grad``,
    zero_grad, backward on the current batch, ``step()``, zero_grad, ``update_last_grad``.
    Bit-identical to the closure form, and equal to the oracle's exact mode."""
    kw = dict(lr=1e-2, gamma=0.3, mars_type=mars_type, is_approx=False, ns_dtype=F64,
              foreach=foreach, clip_scope="tensor")
    n = 8
    xis = batches(n + 1)
    params = [torch.nn.Parameter(torch.tensor(x)) for x in initial_params()]
    opt = MARS(params, **kw)
    xs = [[p.detach().numpy().copy() for p in params]]
    for t in range(n):
        torch_loss(params, xis[t + 1]).backward()
        opt.update_previous_grad()
        opt.zero_grad(set_to_none=True)
        torch_loss(params, xis[t]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        opt.update_last_grad()
        xs.append([p.detach().numpy().copy() for p in params])
    closure_xs, _, _ = run_torch(lambda ps: MARS(ps, **kw), initial_params(), xis[:n])
    assert all(np.array_equal(a, b) for xa, xb in zip(xs, closure_xs) for a, b in zip(xa, xb))
    cfg = MARSConfig(lr=1e-2, gamma=0.3, mars_type=mars_type, is_approx=False)
    ref = mars_trajectory(initial_params(), grad_oracle, xis[:n], cfg)
    err = max(np.abs(a - b).max() for xa, xb in zip(xs, ref) for a, b in zip(xa, xb))
    assert err < 1e-12, err


def test_authors_api_is_a_no_op_in_approx_mode_and_tolerates_missing_previous_grad():
    params = make_params(SHAPES, 3)
    opt = MARS(params)
    for p, g in zip(params, _grads(0)):
        p.grad = g
    opt.update_previous_grad()
    assert not opt.state
    exact = MARS(params, is_approx=False, gamma=0.1)
    exact.update_last_grad()  # no previous_grad anywhere: nothing to do (the authors: KeyError)
    assert not exact.state
    assert exact.gamma == 0.1  # train_mars.py reads optimizer.gamma


# ------------------------------------------------------------------ the functional forms

def test_functional_mars_and_mars_m_equal_the_optimizers():
    """``torch_impl.mars.functional.mars`` / ``.mars_m`` on hand-built lists, like torch.optim's
    functional API, give the optimizers' iterates bit for bit (step() only gathers lists)."""
    from torch_impl.mars import functional
    from torch_impl import MARSM
    from torch_impl.mars import mars_equations
    from torch_impl.mars import mars_m_equations
    a = make_params(SHAPES, 4)
    b = clone_params(a)
    opt = MARS(a, lr=0.01, weight_decay=0.1)
    zeros = lambda: [torch.zeros_like(p) for p in b]  # noqa: E731
    m, v, last, steps = zeros(), zeros(), zeros(), [torch.tensor(0.0) for _ in b]
    kinds = [mars_equations.route(p.shape, "mars-adamw", False) for p in b]
    hp = {k: opt.param_groups[0][k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad",
                                              "gamma", "lr_1d_factor", "betas_1d",
                                              "weight_decay_1d")}
    for t in range(3):
        g = _grads(t)
        feed(opt, a, g)
        with torch.no_grad():  # as torch.optim's functional forms, called inside no_grad
            functional.mars(b, g, m, v, [None] * 3,
                            [x if k != mars_equations.FALLBACK else None
                             for x, k in zip(last, kinds)],
                            steps, kinds, foreach=False, **hp)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    c = make_params(SHAPES, 5)
    d = clone_params(c)
    opt_m = MARSM(c, lr=0.01)
    kinds = [mars_m_equations.MATRIX if p.ndim == 2 else mars_m_equations.BACKUP for p in d]
    buf, last, m1, m2 = zeros(), zeros(), zeros(), zeros()
    steps = [torch.tensor(0.0) for _ in d]
    for t in range(3):
        g = _grads(t)
        feed(opt_m, c, g)
        with torch.no_grad():
            functional.mars_m(d, g, buf, last, m1, m2, steps, kinds, lr=0.01, weight_decay=0.1,
                              momentum=0.95, gamma=0.025)
    assert all(torch.equal(p, q) for p, q in zip(c, d))
