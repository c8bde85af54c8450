"""A preconditioner (MKOR, K-FAC) and copies (issue 21): it refuses to be copied or pickled
(``TypeError`` pointing to ``state_dict``, and that alternative continues bit-identically),
while the model alone copies and pickles (EMA, SWA, ``torch.save``) and its copy carries only
inert hooks. Each claim is checked against the run without the feature, in float64, bit for
bit."""
import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel

from torch_impl.baselines import KFAC
from torch_impl.kronecker.capture.hooks import InertHook
from torch_impl.mkor import MKOR
from theory_tests.support.checkpoint_checks import assert_same

f64 = torch.float64


KINDS = ["mkor", "kfac", "mkor_module"]


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _make(kind, model):
    """Statistics captured at steps 0, 2, 4, ... (inv_freq=2), float64 factors."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if kind == "kfac":
        return KFAC(model, opt, inv_freq=2, factor_freq=2)
    return MKOR(model, opt, inv_freq=2, factor_dtype="float64",
                grad_hook="module" if kind == "mkor_module" else "tensor")


def _loss(model, t):
    g = torch.Generator().manual_seed(t)
    x, y = torch.randn(5, 4, generator=g, dtype=f64), torch.randn(5, 3, generator=g, dtype=f64)
    return ((model(x) - y) ** 2).mean()


def _train_step(model, pre, t):
    _loss(model, t).backward()
    pre.step()
    pre.zero_grad()


def _pending(pre):
    """Layers holding captured statistics for the next step."""
    return [l.name for l in pre._layers if pre._capture.stats(l.name) is not None]


def _hooks(model):
    """Every hook on the model's modules (forward, pre, backward)."""
    out = []
    for module in model.modules():
        for table in (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks):
            out.extend(table.values())
    return out


def _to_bytes(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


COPIES = {"deepcopy": copy.deepcopy, "copy": copy.copy, "pickle": pickle.dumps,
          "torch.save": _to_bytes,
          "deepcopy (model, opt)": lambda pre: copy.deepcopy((pre.model, pre)),
          "pickle (model, opt)": lambda pre: pickle.dumps((pre.model, pre))}


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("kind", ["mkor", "kfac"])
def test_copying_or_pickling_the_preconditioner_is_refused(kind, how):
    """A TypeError at once, raised by the preconditioner itself (not an AttributeError from
    half-built state), saying why and pointing to state_dict / load_state_dict."""
    model = _net()
    pre = _make(kind, model)
    with pytest.raises(TypeError) as info:
        COPIES[how](pre)
    message = str(info.value)
    name = type(pre).__name__
    assert f"{name} holds hooks on its model and cannot be copied or pickled" in message
    assert f"{name.lower()}.state_dict()" in message and "load_state_dict" in message
    assert info.value.__context__ is None and info.value.__cause__ is None
    assert info.traceback[-1].path.name == "optimizer.py"
    assert pre.hooks_registered  # nothing was touched
    _train_step(model, pre, 0)


@pytest.mark.parametrize("kind", ["mkor", "kfac"])
def test_the_documented_alternative_continues_bit_identically(kind):
    """state_dict (saved with torch.save) -> a new preconditioner on copy.deepcopy(model) ->
    load_state_dict: the copy then trains exactly as the original, both running interleaved,
    4 steps (2 with capture), parameters and preconditioner state bit for bit."""
    model = _net()
    pre = _make(kind, model)
    for t in range(3):
        _train_step(model, pre, t)
    saved = io.BytesIO(_to_bytes(pre.state_dict()))
    twin = copy.deepcopy(model)
    twin_pre = _make(kind, twin)
    twin_pre.load_state_dict(torch.load(saved))
    for t in range(3, 7):
        _train_step(model, pre, t)
        _train_step(twin, twin_pre, t)
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q)
        assert_same(pre.preconditioner_state_dict(), twin_pre.preconditioner_state_dict())
        assert_same(pre.optimizer.state_dict()["state"], twin_pre.optimizer.state_dict()["state"])


def _run_with_copies(kind, copies):
    """3 steps (capture at 0 and 2); with ``copies`` a deep copy of the model runs a
    train-mode forward + backward before and after the original's, every step."""
    model = _net()
    pre = _make(kind, model)
    for t in range(3):
        if copies:
            twin = copy.deepcopy(model)
            assert twin.training and all(isinstance(h, InertHook) for h in _hooks(twin))
            _loss(twin, 100 + t).backward()
        _loss(model, t).backward()
        if copies:
            _loss(twin, 200 + t).backward()
        pre.step()
        pre.zero_grad()
    return [p.detach().clone() for p in model.parameters()], pre.preconditioner_state_dict()


@pytest.mark.parametrize("kind", KINDS)
def test_a_deep_copy_of_the_model_never_feeds_the_original(kind):
    """EMA-style deepcopy(model) mid-training: the copy carries only inert hooks, and its
    train-mode forward + backward on capture steps leaves the original's factors and
    parameters bit-identical to a run without the copy."""
    assert_same(_run_with_copies(kind, copies=True), _run_with_copies(kind, copies=False))


@pytest.mark.parametrize("kind", KINDS)
def test_a_pickled_model_loads_and_trains_with_a_new_preconditioner(kind):
    """pickle and torch.save of a hooked model work; the loaded model (inert hooks only)
    trains with a new preconditioner bit-identically to a fresh model with the same weights,
    and never reaches the original's statistics."""
    model = _net()
    pre = _make(kind, model)
    for t in range(2):
        _train_step(model, pre, t)
    loaded = [pickle.loads(pickle.dumps(model)),
              torch.load(io.BytesIO(_to_bytes(model)), weights_only=False)]
    fresh = _net()
    fresh.load_state_dict(model.state_dict())
    runs = []
    for m in loaded + [fresh]:
        assert all(isinstance(h, InertHook) for h in _hooks(m)) and m is not model
        new = _make(kind, m)
        for t in range(2, 6):
            _train_step(m, new, t)
        runs.append(([p.detach().clone() for p in m.parameters()],
                     new.preconditioner_state_dict()))
        assert _pending(pre) == []
    assert_same(runs[0], runs[2])
    assert_same(runs[1], runs[2])


@pytest.mark.parametrize("kind", ["mkor", "kfac"])
def test_swa_averaged_model_with_a_preconditioner_attached(kind):
    """torch.optim.swa_utils.AveragedModel deep-copies the hooked model: update_parameters
    averages the iterates, and the averaged model's train-mode forward + backward on a
    capture step feeds nothing to the original, whose next step is as without SWA."""
    def run(swa_on):
        model = _net()
        pre = _make(kind, model)
        swa = AveragedModel(model) if swa_on else None
        iterates = []
        for t in range(4):
            _train_step(model, pre, t)
            iterates.append([p.detach().clone() for p in model.parameters()])
            if swa_on:
                swa.update_parameters(model)
        assert pre.factor_update_due()
        if swa_on:
            for avg, *its in zip(swa.module.parameters(), *iterates):
                assert torch.allclose(avg, torch.stack(its).mean(0), rtol=1e-14, atol=1e-15)
            swa.train()
            _loss(swa, 50).backward()
            assert _pending(pre) == []
        _train_step(model, pre, 4)
        return [p.detach().clone() for p in model.parameters()], pre.preconditioner_state_dict()
    assert_same(run(True), run(False))


class _WithLoss(nn.Module):
    """A model whose output carries its loss (as transformers models return)."""

    def __init__(self):
        super().__init__()
        self.net = _net()

    def forward(self, x):
        return {"loss": (self.net(x) ** 2).mean()}


def test_a_copied_model_does_not_tap_the_original_mkor_h_losses():
    """MKOR-H's loss tap is a model hook too: a copy's (deepcopy, pickle) output loss never
    reaches the original's feed."""
    model = _WithLoss()
    pre = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.05), hybrid_switch="loss_rate",
               factor_dtype="float64")
    x = torch.randn(5, 4, dtype=f64)
    twin = copy.deepcopy(model)
    twin(x)["loss"].backward()
    assert pre._hybrid.feed.tapped == []
    model(x)["loss"].backward()
    assert len(pre._hybrid.feed.tapped) == 1
    pickle.loads(pickle.dumps(model))(x)["loss"].backward()
    assert len(pre._hybrid.feed.tapped) == 1
