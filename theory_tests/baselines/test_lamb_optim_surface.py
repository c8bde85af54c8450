"""The torch.optim surface of LAMB (issue 21): a complex parameter is its real view (as
torch.optim.AdamW), ``maximize`` and ``foreach`` follow torch's conventions, ``fused`` /
``capturable`` / ``differentiable`` are accepted off and refused on, every hyperparameter is
validated in group dicts too, and a sparse gradient is refused before anything changes.
Each claim is checked against the run without the feature, in float64, bit for bit."""
import pytest
import torch

from torch_impl.baselines import LAMB
from torch_impl.baselines import lamb as lamb_module
from theory_tests.support.checkpoint_checks import assert_same

f64 = torch.float64


def _lamb_params(device="cpu"):
    """A matrix, a 1-D bias, a 0-dim scalar, a complex tensor and a parameter whose grad is
    None at some steps (so the step counts differ between tensors)."""
    g = torch.Generator().manual_seed(3)
    return [t.to(device).requires_grad_() for t in (
        torch.randn(4, 3, generator=g, dtype=f64), torch.randn(3, generator=g, dtype=f64),
        torch.randn((), generator=g, dtype=f64),
        torch.randn(2, 2, generator=g, dtype=torch.complex128),
        torch.randn(5, generator=g, dtype=f64))]


def _lamb_run(steps=4, groups=False, device="cpu", **kwargs):
    params = _lamb_params(device)
    if groups:  # two groups, the second with its own lr and weight decay
        arg = [{"params": params[:3]}, {"params": params[3:], "lr": 0.03, "weight_decay": 0.2}]
    else:
        arg = params
    opt = LAMB(arg, lr=0.05, betas=(0.8, 0.99), eps=1e-6, **kwargs)
    g = torch.Generator().manual_seed(4)
    for t in range(steps):
        for i, p in enumerate(params):
            grad = torch.randn(p.shape, generator=g, dtype=p.dtype).to(device)
            p.grad = None if (i == len(params) - 1 and t % 2 == 1) else grad
        opt.step()
    return params, opt


def test_lamb_on_a_complex_parameter_is_lamb_on_its_real_view():
    """3 steps with weight decay, float64: the complex parameter's real view, and its state's,
    equal (bit for bit) a real parameter holding view_as_real data stepped with view_as_real
    gradients (before the fix v took g*g, the complex square, 2e-2 away)."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 2, generator=g, dtype=torch.complex128)
    zc = z.clone().requires_grad_()
    zr = torch.view_as_real(z).clone().requires_grad_()
    kw = dict(lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    opt_c, opt_r = LAMB([zc], **kw), LAMB([zr], **kw)
    for _ in range(3):
        grad = torch.randn(3, 2, generator=g, dtype=torch.complex128)
        zc.grad, zr.grad = grad, torch.view_as_real(grad).clone()
        opt_c.step()
        opt_r.step()
        assert torch.equal(torch.view_as_real(zc.detach()), zr.detach())
    for key in ("exp_avg", "exp_avg_sq"):
        assert opt_c.state[zc][key].is_complex()
        assert torch.equal(torch.view_as_real(opt_c.state[zc][key]), opt_r.state[zr][key])


def _ascent_loss(params):
    """A smooth objective of every parameter but the last (whose grad stays None)."""
    w, b, s, z, _ = params
    return ((w.sum(0) * b).sin().sum() + (w ** 2).sum() * s + s ** 3
            + (z.abs() ** 2).sum() + torch.view_as_real(z).sum())


@pytest.mark.parametrize("foreach", [False, True])
def test_lamb_maximize_is_minimizing_the_negated_loss(foreach):
    """4 steps: maximize=True on the loss equals (bit for bit) minimizing -loss, with a 0-dim,
    a 1-D, a complex parameter and one whose grad is None (it stays untouched)."""
    runs = []
    for maximize in (True, False):
        params = _lamb_params()
        untouched = params[-1].detach().clone()
        opt = LAMB(params, lr=0.05, weight_decay=0.1, maximize=maximize, foreach=foreach)
        assert opt.param_groups[0]["maximize"] is maximize
        for _ in range(4):
            opt.zero_grad()
            loss = _ascent_loss(params)
            (loss if maximize else -loss).backward()
            assert params[-1].grad is None
            opt.step()
        assert torch.equal(params[-1].detach(), untouched)
        runs.append([p.detach().clone() for p in params])
    assert not torch.equal(runs[0][0], _lamb_params()[0].detach())  # it did move
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("groups", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_lamb_foreach_equals_the_loop(weight_decay, maximize, groups, monkeypatch):
    """foreach=True (torch._foreach_* over each group) equals foreach=False (the per-tensor
    loop) bit for bit over 4 steps: matrix, 1-D bias, 0-dim, complex, and a parameter whose
    grad is None every other step (different step counts in one group); state too. Each
    run takes its own path."""
    calls = []
    for name in ("_lamb_loop", "_lamb_foreach"):
        def spy(*args, _name=name, _fn=getattr(lamb_module, name)):
            calls.append(_name)
            return _fn(*args)
        monkeypatch.setattr(lamb_module, name, spy)
    (loop, opt_loop), (fe, opt_fe) = (
        _lamb_run(groups=groups, weight_decay=weight_decay, maximize=maximize, foreach=flag)
        for flag in (False, True))
    steps = 4 * (2 if groups else 1)
    assert calls == ["_lamb_loop"] * steps + ["_lamb_foreach"] * steps
    assert all(group["foreach"] is True for group in opt_fe.param_groups)
    for a, b in zip(loop, fe):
        assert torch.equal(a.detach(), b.detach())
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt_loop.state[a][key], opt_fe.state[b][key])
    assert int(opt_fe.state[fe[-1]]["step"]) == 2 and int(opt_fe.state[fe[0]]["step"]) == 4


def test_lamb_foreach_on_the_device(device):
    """foreach=None picks foreach exactly on CUDA; it equals the loop there within 1e-14 of
    each tensor's largest entry (CUDA's foreach norm may sum in another order), bit for bit
    on the CPU."""
    (a, opt), (b, _) = (_lamb_run(device=device, weight_decay=0.1, foreach=flag)
                        for flag in (None, False))
    assert LAMB._use_foreach(opt.param_groups[0], a) == (device.type == "cuda")
    for x, y in zip(a, b):
        x, y = torch.view_as_real(x.detach()) if x.is_complex() else x.detach(), (
            torch.view_as_real(y.detach()) if y.is_complex() else y.detach())
        assert torch.equal(x, y) if device.type == "cpu" else torch.allclose(
            x, y, rtol=0, atol=1e-14 * max(1.0, y.abs().max().item()))


def test_lamb_foreach_none_chooses_like_torch():
    """foreach=None is stored as None and picks the loop for CPU tensors (foreach only when
    every parameter is on CUDA), so it equals foreach=False here."""
    (a, opt), (b, _) = _lamb_run(foreach=None), _lamb_run(foreach=False)
    assert opt.defaults["foreach"] is None and opt.param_groups[0]["foreach"] is None
    assert not LAMB._use_foreach(opt.param_groups[0], a)
    for x, y in zip(a, b):
        assert torch.equal(x.detach(), y.detach())


def test_lamb_stores_the_torch_option_keywords():
    """The off values are accepted and stored in defaults and every group, as torch's
    optimizers store them; a state_dict saved without them (older LAMB) loads with them."""
    p = torch.zeros(2, requires_grad=True)
    opt = LAMB([p], fused=False, capturable=False, differentiable=False)
    expected = dict(maximize=False, foreach=None, capturable=False, differentiable=False,
                    fused=False)
    for where in (opt.defaults, opt.param_groups[0]):
        assert {k: where[k] for k in expected} == expected
    assert LAMB([p]).defaults["fused"] is None
    p.grad = torch.ones(2)
    opt.step()
    old = opt.state_dict()
    for key in expected:
        del old["param_groups"][0][key]
    fresh = LAMB([p])
    fresh.load_state_dict(old)
    assert {k: fresh.param_groups[0][k] for k in expected} == dict(expected, fused=None)
    fresh.step()


@pytest.mark.parametrize("name", ["fused", "capturable", "differentiable"])
def test_lamb_refuses_fused_capturable_differentiable(name):
    """True raises a ValueError naming the keyword: in the constructor, in an initial group
    dict and in add_param_group (which then adds nothing)."""
    p, q = (torch.zeros(2, requires_grad=True) for _ in range(2))
    with pytest.raises(ValueError, match=name):
        LAMB([p], **{name: True})
    with pytest.raises(ValueError, match=name):
        LAMB([{"params": [p], name: True}])
    opt = LAMB([p])
    with pytest.raises(ValueError, match=name):
        opt.add_param_group({"params": [q], name: True})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("group,name", [
    ({"lr": -1.0}, "lr"), ({"betas": (1.0, 0.9)}, "betas"), ({"betas": (0.9, -0.1)}, "betas"),
    ({"eps": -1.0}, "eps"), ({"weight_decay": -1.0}, "weight_decay"),
    ({"maximize": None}, "maximize"), ({"foreach": "yes"}, "foreach")])
def test_lamb_validates_group_dicts(group, name):
    """The constructor's checks apply to each group's own values: initial group dicts and
    add_param_group (which then adds nothing)."""
    p, q = (torch.zeros(2, requires_grad=True) for _ in range(2))
    with pytest.raises(ValueError, match=name):
        LAMB([{"params": [p], **group}])
    opt = LAMB([p])
    with pytest.raises(ValueError, match=name):
        opt.add_param_group({"params": [q], **group})
    assert len(opt.param_groups) == 1


def test_lamb_refuses_a_sparse_gradient_before_changing_anything():
    """A sparse gradient in the second group raises, and the first group's parameters and
    every state entry are as before the step."""
    p = torch.randn(3, dtype=f64, requires_grad=True)
    emb = torch.randn(4, 2, dtype=f64, requires_grad=True)
    opt = LAMB([{"params": [p]}, {"params": [emb]}], lr=0.1)
    p.grad = torch.ones(3, dtype=f64)
    opt.step()
    before = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
    p.grad = torch.ones(3, dtype=f64)
    emb.grad = torch.sparse_coo_tensor([[1]], torch.ones(1, 2, dtype=f64), (4, 2),
                                       check_invariants=True)
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert_same(before, (p.detach(), dict(opt.state[p])))
    assert len(opt.state[emb]) == 0
