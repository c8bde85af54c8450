"""torchtitan (0.3) names MARS, MARS-M, LAMB, MKOR and K-FAC through our container
(``torch_impl/integrations/torchtitan.py``), on its llama3 debug model
(``theory_tests/support/torchtitan_cases.py``), with torchtitan's own checkpoint utilities:

* every name builds with its hyperparameters; ``implementation`` is honoured or refused;
* ``init_optim_state`` (torchtitan's zero-gradient, lr = 0 step) leaves every optimizer
  exactly as it was, and the run is the run without it;
* torchtitan's flat, FQN-keyed layout (``get_flat_optim_state_dict`` /
  ``load_flat_optim_state_dict``, what its checkpointer saves with DCP) carries MKOR's and
  K-FAC's factors: a run resumed from it (through ``torch.save``) equals the uninterrupted
  one bit for bit.

Saved on 2 FSDP2 ranks and resumed on 3: ``theory_tests/distributed/test_torchtitan_fsdp2.py``.
"""
import copy
import io
import warnings

import pytest
import torch
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.components.optimizer.utils import (get_flat_optim_state_dict, init_optim_state,
                                                   load_flat_optim_state_dict)

from torch_impl import KFAC, LAMB, MARS, MARSM, MKOR
from torch_impl.integrations.torchtitan import Optimizers
from theory_tests.support.checkpoint_checks import assert_same as _assert_same
from theory_tests.support.torchtitan_cases import (CONFIGS, config, debug_model, lm_step,
                                                   optimizer_name, tokens)

BATCH = 2
# the default suite runs a first-order and a preconditioner case; every case runs under -m slow
# (CI runs both: README)
FAST = ("MARS", "MKOR")
CASES = [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in CONFIGS]


def _build(case, seed=0, **kw):
    model = debug_model(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MKOR's notes on the skipped embedding and norms
        return model, config(case, **kw).build(model_parts=[model])


def _train(model, opts, steps):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in steps:
            lm_step(model, opts, tokens(t, BATCH))


def _snapshot(opts):
    """Every optimizer's state_dict, copied (no tensor shared with the optimizer; a deep copy,
    ~10x cheaper in CPU than the torch.save round trip it replaced on MKOR's state; what a
    torch.save keeps is checked by the flat layout test)."""
    return copy.deepcopy([o.state_dict() for o in opts])


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_every_name_builds_with_its_hyperparameters():
    expected = {"MARS": MARS, "MARSM": MARSM, "LAMB": LAMB, "MKOR": MKOR, "KFAC": KFAC,
                "AdamW": torch.optim.AdamW}
    for case in ("MARS", "MARSM", "LAMB", "MKOR", "KFAC", "AdamW"):
        model, opts = _build(case)
        (opt,) = opts.optimizers
        assert isinstance(opt, expected[case]) and isinstance(opts, OptimizersContainer)
        group_kwargs, factory_kwargs = CONFIGS[case]
        for key, value in group_kwargs.items():
            assert opt.param_groups[0][key] == value, (case, key)
        names = [n for n, p in model.named_parameters()]
        assert [n for g in opt.param_groups for n in g["param_names"]] == names
        if case in ("MKOR", "KFAC"):
            assert isinstance(opt.optimizer, torch.optim.AdamW)
            assert len(opt.inverse_factors() if case == "MKOR" else opt._state) == 31
            assert opt.options.inv_freq == 2 if case == "MKOR" else opt.inv_freq == 2


def test_mixed_groups_one_preconditioner_per_part_and_clear_refusals():
    model = debug_model()
    cfg = Optimizers.Config(
        implementation="for-loop",
        param_groups=[ParamGroupConfig(pattern=r"tok_embeddings|norm", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 1e-3}),
                      ParamGroupConfig(pattern=r".*", optimizer_name="MKOR",
                                       optimizer_kwargs={"lr": 1e-3})],
        optimizer_factory_kwargs_by_name={"MKOR": {"backbone": "MARS"}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opts = cfg.build(model_parts=[model])
    adamw, mkor = opts.optimizers
    assert isinstance(adamw, torch.optim.AdamW) and isinstance(mkor.optimizer, MARS)
    assert len(mkor.inverse_factors()) == 31  # the layers its groups hold
    assert mkor.param_groups[0]["foreach"] is False  # implementation="for-loop"
    two = Optimizers.Config(
        implementation="foreach",
        param_groups=[ParamGroupConfig(pattern=r"feed_forward", optimizer_name="KFAC",
                                       optimizer_kwargs={"lr": 1e-3}),
                      ParamGroupConfig(pattern=r".*", optimizer_name="MKOR",
                                       optimizer_kwargs={"lr": 1e-3})],
        optimizer_factory_kwargs_by_name={"MKOR": {"backbone": "AdamW"},
                                          "KFAC": {"backbone": "AdamW"}})
    with pytest.raises(ValueError, match="one preconditioner per model part"):
        two.build(model_parts=[debug_model()])
    bad = config("MKOR")
    bad.optimizer_factory_kwargs_by_name["MKOR"].pop("backbone")
    with pytest.raises(ValueError, match=r"\['backbone'\]"):
        bad.build(model_parts=[debug_model()])
    unknown = config("AdamW")
    unknown.param_groups[0].optimizer_name = "Shampoo"
    with pytest.raises(ValueError, match="'Shampoo': not one of"):
        unknown.build(model_parts=[debug_model()])


@pytest.mark.parametrize("case", ["MARS", pytest.param("MARSM", marks=pytest.mark.slow),
                                  pytest.param("LAMB", marks=pytest.mark.slow), "MKOR-MARS"])
def test_implementation_fused_is_refused_foreach_and_for_loop_are_honoured(case):
    for implementation in ("fused", "fused_opt_states_bf16"):
        with pytest.raises(ValueError, match=r"implementation=.*(no fused kernel|torchtitan's)"):
            config(case, implementation=implementation).build(model_parts=[debug_model()])
    for implementation, foreach in (("foreach", True), ("for-loop", False)):
        _, opts = _build(case, implementation=implementation)
        assert all(g["foreach"] is foreach for g in opts.optimizers[0].param_groups)
    cfg = config(case, implementation="fused")  # torchtitan's per-group override
    cfg.param_groups[0].optimizer_kwargs["fused"] = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg.build(model_parts=[debug_model()])


def test_torchtitans_own_adamw_keeps_fused():
    _, opts = _build("AdamW", implementation="fused")
    assert opts.optimizers[0].param_groups[0]["fused"] is True


@pytest.mark.parametrize("case", CASES)
def test_init_optim_state_leaves_every_optimizer_as_it_was(case):
    """Right after construction (state created, counters 0) and after two steps:
    torchtitan's ``init_optim_state`` and the container's ``state_dict()`` (which calls it)
    change no state, counter or factor, and the run equals the run without them."""
    model, opts = _build(case)
    plain_model, plain = _build(case)
    before = _snapshot(opts)
    for opt in opts.optimizers:
        init_optim_state(opt)
    opts.state_dict()
    _assert_same(before, _snapshot(opts))
    _train(model, opts, range(2))
    _train(plain_model, plain, range(2))
    middle = _snapshot(opts)
    opts.state_dict()
    _assert_same(middle, _snapshot(opts))
    _train(model, opts, range(2, 4))
    _train(plain_model, plain, range(2, 4))
    for a, b in zip(_params(model), _params(plain_model)):
        assert torch.equal(a, b)
    _assert_same(_snapshot(opts), _snapshot(plain))


def test_without_the_container_init_optim_state_counts_a_step():
    """What the container prevents: torchtitan's base container on torch's AdamW counts
    its init step (``step`` becomes 1 before any training)."""
    model = debug_model()
    base = OptimizersContainer(
        OptimizersContainer.Config(
            implementation="for-loop",
            param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                                           optimizer_kwargs={"lr": 1e-3})]),
        model_parts=[model])
    base.state_dict()
    steps = {float(s["step"]) for s in base.optimizers[0].state.values()}
    assert steps == {1.0}
    _, ours = _build("AdamW")
    ours.state_dict()
    assert {float(s["step"]) for s in ours.optimizers[0].state.values()} == {0.0}


@pytest.mark.parametrize("case", CASES)
def test_the_flat_fqn_layout_resumes_bit_for_bit(case):
    """Train 3 steps, save torchtitan's flat state dict (``torch.save``), load it into a
    container on a fresh model (another seed, its weights then loaded) and train 3 more:
    equal to 6 uninterrupted steps bit for bit. MKOR's / K-FAC's layers are in the flat dict
    under their weights' FQNs."""
    model, opts = _build(case)
    _train(model, opts, range(3))
    flat = opts.state_dict()
    _assert_same(flat, {k: v for o in opts.optimizers
                        for k, v in get_flat_optim_state_dict(o).items()})
    name = optimizer_name(case)
    if name in ("MKOR", "KFAC"):
        key = name.lower()
        pre = opts.optimizers[0]
        layers = {layer.name for layer in pre._layers}
        carried = {k.split(f".{key}.")[0][len("state."):] for k in flat if f".{key}." in k}
        released = case == "MKOR-H"  # switched at step 3: zero placeholders, same keys
        assert carried == {f"{n}.weight" for n in layers}, released
        assert any(f".{key}_run." in k for k in flat)
    buffer = io.BytesIO()
    torch.save(flat, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    resumed_model, resumed = _build(case, seed=1)
    resumed_model.load_state_dict(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "only the backbone's state was loaded"
        resumed.load_state_dict(saved)
    for o in resumed.optimizers:  # also through torchtitan's own function, per optimizer
        load_flat_optim_state_dict(o, saved)
    _assert_same(_snapshot(opts), _snapshot(resumed))
    _train(model, opts, range(3, 6))
    _train(resumed_model, resumed, range(3, 6))
    for a, b in zip(_params(model), _params(resumed_model)):
        assert torch.equal(a, b)
    _assert_same(_snapshot(opts), _snapshot(resumed))
