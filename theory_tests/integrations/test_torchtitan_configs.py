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
