"""Optimizer step hooks on a preconditioner (issue 30, item 5): the decision, tested.

MKOR and K-FAC are ``torch.optim.Optimizer`` objects whose ``step`` runs their backbone's
``step``: two optimizers step, so a *global* hook (``torch.optim.optimizer.
register_optimizer_step_pre_hook`` / ``_post_hook``, "common to all optimizers") fires once for
each -- the preconditioner's, then the backbone's pre hook; the backbone's, then the
preconditioner's post hook -- as it does for torch's own wrapper,
``torch.distributed.optim.ZeroRedundancyOptimizer``, whose ``step`` steps its local optimizer.
A hook tells the two apart by its ``optimizer`` argument.  A hook registered on the
preconditioner itself (``register_step_pre_hook``) fires once per step; one on the backbone
fires once per backbone step.  A step skipped for an overflowing GradScaler step runs the
preconditioner's hooks only: the backbone does not step.
"""
import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from torch_impl import KFAC, LAMB, MKOR


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def _make(kind, model):
    backbone = torch.optim.SGD(model.parameters(), lr=0.05)
    return (MKOR if kind == "mkor" else KFAC)(model, backbone), backbone


def _train_step(model, opt):
    opt.zero_grad()
    model(torch.randn(8, 4, generator=torch.Generator().manual_seed(1))).square().mean().backward()
    opt.step()


@pytest.fixture
def global_log():
    log = []
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: log.append(("pre", o))),
               register_optimizer_step_post_hook(lambda o, a, k: log.append(("post", o)))]
    yield log
    for handle in handles:
        handle.remove()


@pytest.mark.parametrize("kind", ["mkor", "kfac"])
def test_a_global_hook_fires_for_the_preconditioner_then_its_backbone(kind, global_log):
    model = _model()
    opt, backbone = _make(kind, model)
    for _ in range(2):
        _train_step(model, opt)
    assert global_log == [("pre", opt), ("pre", backbone), ("post", backbone), ("post", opt)] * 2


@pytest.mark.parametrize("kind", ["mkor", "kfac"])
def test_a_hook_on_the_preconditioner_fires_once_per_step(kind):
    model = _model()
    opt, backbone = _make(kind, model)
    log = []
    opt.register_step_pre_hook(lambda o, a, k: log.append(("pre", o)))
    opt.register_step_post_hook(lambda o, a, k: log.append(("post", o)))
    backbone.register_step_post_hook(lambda o, a, k: log.append(("backbone", o)))
    for _ in range(3):
        _train_step(model, opt)
    assert log == [("pre", opt), ("backbone", backbone), ("post", opt)] * 3


def test_the_torch_wrapper_precedent_fires_twice_too(global_log):
    """torch's ZeroRedundancyOptimizer (one gloo rank) steps its local optimizer inside its
    own step: a global hook sees both, as it sees MKOR and its backbone."""
    import os
    import tempfile

    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1)
        try:
            model = _model()
            zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD,
                                           lr=0.05)
            _train_step(model, zero)
        finally:
            dist.destroy_process_group()
    assert [kind for kind, _ in global_log] == ["pre", "pre", "post", "post"]
    assert global_log[0][1] is zero and global_log[1][1] is zero.optim


def test_an_overflowing_grad_scaler_step_runs_the_preconditioners_hooks_only(global_log):
    model = _model()
    opt, backbone = _make("mkor", model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    opt.zero_grad()
    loss = model(torch.randn(8, 4)).square().mean()
    scaler.scale(loss * float("inf")).backward()
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert global_log == [("pre", opt), ("post", opt)]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_lamb_backbone_counts_as_one_optimizer_too(global_log):
    model = _model()
    opt = MKOR(model, LAMB(model.parameters(), lr=1e-3))
    _train_step(model, opt)
    assert [kind for kind, _ in global_log] == ["pre", "pre", "post", "post"]
