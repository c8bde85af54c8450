"""The example torchtitan configs (``torch_impl/examples/torchtitan_configs.py``) as torchtitan
reads them: ``ConfigManager`` (what ``torchtitan.train`` runs) resolves each by module path and
name and applies command-line overrides; each one's optimizer config builds our container on
torchtitan's llama3 debug model and trains a step; MARS-M's two groups split the parameters
as Muon does (the blocks' matrices, the rest)."""
import warnings

import pytest
import torch
from torchtitan.config import ConfigManager
from torchtitan.trainer import Trainer

from torch_impl import KFAC, MARS, MARSM, MKOR
from torch_impl.examples import torchtitan_configs
from torch_impl.integrations.torchtitan import Optimizers
from theory_tests.support.torchtitan_cases import debug_model, lm_step, tokens

MODULE = "torch_impl.examples.torchtitan_configs"
DEBUG = {"llama3_debugmodel_mars": MARS, "llama3_debugmodel_mars_m": MARSM,
         "llama3_debugmodel_mkor": MKOR, "llama3_debugmodel_kfac": KFAC}


def _parse(name, *overrides):
    return ConfigManager().parse_args(["--module", MODULE, "--config", name, *overrides])


# K-FAC's first step decomposes the 2048-wide head's factors (~7 s here): -m slow (CI runs it)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n.endswith("kfac")
                                  else n for n in DEBUG])
def test_torchtitan_resolves_each_config_and_it_trains(name):
    config = _parse(name)
    assert isinstance(config, Trainer.Config) and isinstance(config.optimizer, Optimizers.Config)
    model = debug_model()
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MKOR's / K-FAC's notes on the skipped layers
        opts = config.optimizer.build(model_parts=[model])
        (opt,) = opts.optimizers
        assert isinstance(opt, DEBUG[name])
        loss = lm_step(model, opts, tokens(0, 2))
    assert torch.isfinite(loss)
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_command_line_overrides_reach_the_container():
    config = _parse("llama3_debugmodel_mkor", "--optimizer.implementation", "for-loop")
    assert config.optimizer.implementation == "for-loop"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (opt,) = config.optimizer.build(model_parts=[debug_model()]).optimizers
    assert all(g["foreach"] is False for g in opt.param_groups)
    assert opt.options.inv_freq == 10


def test_mars_m_splits_the_parameters_as_muon_does():
    model = debug_model()
    (opt,) = _parse("llama3_debugmodel_mars_m").optimizer.build(model_parts=[model]).optimizers
    rules = {n: g["rule"] for g in opt.param_groups for n in g["param_names"]}
    assert rules.keys() == {n for n, _ in model.named_parameters()}
    shapes = dict(model.named_parameters())
    for n, rule in rules.items():
        in_block = n.startswith("layers.") and shapes[n].ndim == 2
        assert rule == ("mars_m" if in_block else "adamw"), n
    assert {"tok_embeddings.weight", "lm_head.weight"} <= {n for n, r in rules.items()
                                                           if r == "adamw"}


def test_the_8b_configs_name_our_optimizers():
    """Built without a model (8B parameters): the configs resolve and say what they say."""
    mars_m = _parse("llama3_8b_mars_m").optimizer
    assert [g.optimizer_name for g in mars_m.param_groups] == ["MARSM", "MARSM"]
    mkor = _parse("llama3_8b_mkor").optimizer
    assert mkor.optimizer_factory_kwargs_by_name["MKOR"]["backbone"] == "AdamW"
    assert mkor.implementation == "foreach"
    assert set(torchtitan_configs.__all__) >= set(DEBUG)


EP_CONFIGS = {"qwen3_moe_debug_ep_mkor": "MKOR", "qwen3_moe_debug_ep_kfac": "KFAC",
              "qwen3_moe_debug_ep_mars_m": "MARSM"}


def _ep_config_job(rank, world, name):
    from theory_tests.support import torchtitan_ep as T
    config = _parse(name)
    T.configure()
    ep = config.parallelism.expert_parallel_degree
    model = T.ep_model("qwen3", ep)
    T.parallelize(model, "qwen3", T.parallel_dims(world, ep))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opts = config.optimizer.build(model_parts=[model])
        before = [p.detach().to_local().clone() for p in model.parameters()]
        loss = T.lm_step(model, opts, T.tokens(0, 4)[rank * 2:(rank + 1) * 2], world)
    (opt,) = opts.optimizers
    moved = all(not torch.equal(p.detach().to_local(), q)
                for p, q in zip(model.parameters(), before))
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [(g.get("matrix_batch_dims"), sorted(names[id(p)] for p in g["params"]))
              for g in opt.param_groups]
    stacks = [l.name for l in getattr(opt, "_layers", []) if l.expert_shard is not None]
    return ep, type(opt).__name__, bool(torch.isfinite(loss)), moved, groups, stacks


@pytest.mark.parametrize("name", [n if n.endswith("mkor") else pytest.param(
    n, marks=pytest.mark.slow) for n in EP_CONFIGS])  # CI's slow run takes the other two
def test_the_ep_configs_train_under_expert_parallelism(name):
    """The qwen3 MoE configs with expert parallelism (issue 48) as torchtitan resolves them: EP
    degree 2, and on 2 gloo ranks with torchtitan's EP path (the test-sized qwen3 of
    ``theory_tests/support/torchtitan_ep.py``, the debug model's FQNs) their optimizer trains a
    step: MKOR and K-FAC precondition every stack on the rank holding its experts; MARS-M gives
    exactly the expert stacks ``matrix_batch_dims=1``."""
    from theory_tests.support.distributed_harness import run
    for ep, kind, finite, moved, groups, stacks in run(_ep_config_job, 2, name, timeout=300):
        assert ep == 2 and kind == EP_CONFIGS[name] and finite and moved
        if kind == "MARSM":
            batched = [n for dims, ns in groups if dims == 1 for n in ns]
            assert len(batched) == 6 and all("inner_experts" in n for n in batched)
        else:
            assert len(stacks) == 6
