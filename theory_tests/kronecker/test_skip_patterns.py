"""``skip_modules`` are the names a user writes (issue 45 item 4): a fused experts module's name
skips all its projections, a projection's name only it, and a pattern that matches nothing is
an error naming it, raised before anything is hooked."""
import pytest
import torch
import torch.nn as nn

from torch_impl import KFAC, MKOR

transformers = pytest.importorskip("transformers")

UP, DOWN = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"


def _phimoe():
    from transformers.models.phimoe import PhimoeConfig, PhimoeForCausalLM
    config = PhimoeConfig(vocab_size=64, hidden_size=16, intermediate_size=12,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                          num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    return PhimoeForCausalLM(config).double()


def _pre(kind, model, skip):
    return kind(model, torch.optim.SGD(model.parameters(), lr=1e-2), skip_modules=skip)


@pytest.mark.parametrize("kind", [MKOR, KFAC])
@pytest.mark.parametrize("pattern", ["model.layers.0.mlp.experts", "*.experts"])
def test_the_experts_module_name_skips_every_projection(kind, pattern):
    pre = _pre(kind, _phimoe(), [pattern])
    for name in (UP, DOWN):
        assert name not in pre.preconditioned_modules
        assert pre.skip_reasons[name] == f"skipped by the skip_modules pattern {pattern!r}"
    assert "model.layers.0.self_attn.q_proj" in pre.preconditioned_modules


@pytest.mark.parametrize("kind", [MKOR, KFAC])
def test_a_projection_name_skips_that_projection_alone(kind):
    pre = _pre(kind, _phimoe(), ["*.experts.down_proj"])
    assert UP in pre.preconditioned_modules and DOWN not in pre.preconditioned_modules


def _hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
               for m in model.modules())


@pytest.mark.parametrize("kind", [MKOR, KFAC])
def test_a_pattern_matching_nothing_is_an_error_naming_it_before_any_hook(kind):
    model = _phimoe()
    with pytest.raises(ValueError, match=r"skip_modules: 'lm_haed' \(near names: 'lm_head'\) "
                                         r"matches no module"):
        _pre(kind, model, ["lm_head", "lm_haed"])
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp' \(it names "
                                         r"'model\.layers\.0\.mlp', which holds no parameters "
                                         r"itself; 'model\.layers\.0\.mlp\.\*' names"):
        _pre(kind, model, ["model.layers.0.mlp"])
    assert _hooks(model) == 0


@pytest.mark.parametrize("kind", [MKOR, KFAC])
def test_one_string_is_one_pattern(kind):
    model = nn.ModuleDict({"body": nn.Linear(3, 4), "head": nn.Linear(4, 2)})
    pre = _pre(kind, model, "head")  # not the patterns 'h', 'e', 'a', 'd'
    assert pre.preconditioned_modules == ["body"]
    with pytest.raises(ValueError, match="skip_modules: expected"):
        _pre(kind, model, [2])
