"""MKOR and K-FAC as torch.optim.Optimizers: the backbone's param groups and state, schedulers,
the combined state_dict and its hooks (the real-library loops are in kronecker/test_training_loops.py
and kronecker/test_grad_scaler.py)."""
import warnings

import pytest
import torch

from theory_tests.kronecker.test_semantics import KINDS, _make, _mlp, _step

# -- optimizer semantics ---------------------------------------------------------------------
@pytest.mark.parametrize("cls", KINDS)
def test_it_is_an_optimizer_over_the_backbones_groups(cls):
    model = _mlp()
    opt, pre = _make(cls, model)
    assert isinstance(pre, torch.optim.Optimizer)
    assert pre.param_groups is opt.param_groups
    _assert_state_reads_through(pre, opt)
    sched = torch.optim.lr_scheduler.StepLR(pre, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "scheduler before optimizer" warning
        for t in range(3):
            _step(model, pre, t)
            sched.step()
    assert opt.param_groups[0]["lr"] == 0.1 * 0.5 ** 3
    state = pre.state_dict()
    assert set(state) == {"state", "param_groups"}
    _assert_state_reads_through(pre, opt)
    opt.load_state_dict(opt.state_dict())  # a backbone reload rebinds its lists
    assert pre.param_groups is opt.param_groups


def _assert_state_reads_through(pre, opt):
    """``pre.state`` is the backbone's state (the same per-parameter dicts, written through)
    plus the preconditioner's entries: each layer's live state on its weight, the run's on the
    first parameter."""
    key = pre._state_key
    weights = {layer.module.weight: layer.name for layer in pre._layers}
    first = opt.param_groups[0]["params"][0]
    assert bool(pre.state) == bool(opt.state)
    for p in (p for g in opt.param_groups for p in g["params"]):
        entry = pre.state[p]
        if p in weights:
            live = pre._state[weights[p]]
            assert (key in entry) == bool(live)
            assert all(entry[key][k] is v for k, v in live.items())
        else:
            assert key not in entry
        assert (key + "_run" in entry) == (p is first)
        for name in opt.state.get(p, {}):
            assert entry[name] is opt.state[p][name]
    probe = next(iter(weights))
    pre.state[probe]["probe"] = 1.0  # a backbone key goes to the backbone
    assert opt.state[probe].pop("probe") == 1.0


@pytest.mark.parametrize("cls", KINDS)
def test_a_plain_backbone_checkpoint_loads_with_a_warning(cls):
    model = _mlp()
    opt, pre = _make(cls, model)
    _step(model, pre, 0)
    with pytest.warns(UserWarning, match="only the backbone"):
        pre.load_state_dict(opt.state_dict())


@pytest.mark.parametrize("cls", KINDS)
def test_state_dict_hooks_run_as_in_torch_optim(cls):
    """register_state_dict_{pre,post}_hook and register_load_state_dict_{pre,post}_hook (used
    by checkpointing tools) run around the combined state_dict, as for any torch optimizer."""
    model = _mlp()
    opt, pre = _make(cls, model)
    _step(model, pre, 0)
    calls = []
    pre.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    pre.register_state_dict_post_hook(lambda o, sd: dict(sd, tagged=True))
    pre.register_load_state_dict_pre_hook(lambda o, sd: calls.append(("load", "tagged" in sd)))
    pre.register_load_state_dict_post_hook(lambda o: calls.append("loaded"))
    state = pre.state_dict()
    assert state["tagged"] and any(pre._state_key in entry for entry in state["state"].values())
    pre.load_state_dict(state)
    assert calls == ["pre", ("load", True), "loaded"]
