"""``nn.Linear`` subclasses at discovery (issue 45 item 4): a subclass that overrides ``forward``
may compute another product than x W^T + b, so it is refused with that reason unless its
product is declared (``LinearType(cls)`` registered, or a tested entry of
``_KNOWN_LINEAR_PRODUCTS``); never preconditioned and then crashed at step 1 (DeepSeek-V4's
grouped linear) or left without statistics (PhiMoE's router, which returns a tuple)."""
import importlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_impl import KFAC, MKOR
from torch_impl.kronecker.discovery import discover
from torch_impl.kronecker.layers import (_KNOWN_LINEAR_PRODUCTS, LinearType,
                                         register_layer_type, unregister_layer_type)

transformers = pytest.importorskip("transformers")

f64 = torch.float64


class Scaled(nn.Linear):
    """Another product: the hooks' output gradient is not the product's."""

    def forward(self, x):
        return 3.0 * super().forward(x)


class Initialised(nn.Linear):
    """Only the construction differs (transformers' EsmFoldLinear): nn.Linear's forward."""

    def __init__(self, d_in, d_out):
        super().__init__(d_in, d_out)
        nn.init.zeros_(self.bias)


class Declared(nn.Linear):
    def forward(self, x):
        return x @ self.weight.T + self.bias


class DeclaredThenScaled(Declared):
    def forward(self, x):
        return 2.0 * super().forward(x)


class InheritsDeclared(Declared):
    pass


def _pre(kind, model, **kwargs):
    return kind(model, torch.optim.SGD(model.parameters(), lr=1e-2), inv_freq=1, **kwargs)


def test_an_overriding_subclass_is_refused_and_a_constructor_only_one_kept():
    model = nn.Sequential(Scaled(3, 4), nn.Tanh(), Initialised(4, 2),
                          nn.MultiheadAttention(4, 2))
    found = discover(model)
    assert [layer.name for layer in found.layers] == ["2", "3.out_proj"]
    reason = found.skipped["0"]
    assert reason.startswith("nn.Linear subclass Scaled overrides forward")
    assert "not known to be x W^T + b" in reason and "LinearType(Scaled)" in reason


def test_a_declared_product_is_kept_and_a_subclass_overriding_it_again_is_not():
    with pytest.raises(TypeError, match="not an nn.Linear subclass"):
        LinearType(nn.Conv2d)
    model = nn.Sequential(Declared(3, 4), InheritsDeclared(4, 4), DeclaredThenScaled(4, 2))
    assert "overrides forward" in discover(model).skipped["0"]
    declared = register_layer_type(LinearType(Declared))
    try:
        found = discover(model)
    finally:
        unregister_layer_type(declared)
    assert [layer.name for layer in found.layers] == ["0", "1"]
    assert found.skipped["2"].startswith("nn.Linear subclass DeclaredThenScaled overrides")


@pytest.mark.parametrize("bias", [True, False])
def test_every_known_linear_product_computes_f_linear(bias):
    """Each entry names a class that exists, overrides forward, and computes F.linear."""
    assert _KNOWN_LINEAR_PRODUCTS
    for qualified in sorted(_KNOWN_LINEAR_PRODUCTS):
        module_name, _, cls_name = qualified.rpartition(".")
        cls = getattr(importlib.import_module(module_name), cls_name)
        assert issubclass(cls, nn.Linear) and "forward" in vars(cls)
        torch.manual_seed(0)
        layer = cls(5, 3, bias=bias).double()
        x = torch.randn(2, 4, 5, dtype=f64)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias),
                                   rtol=0, atol=1e-15)
        assert [found.name for found in discover(nn.Sequential(layer)).layers] == ["0"]


# -- the transformers 5.25 models of the issue ---------------------------------------------

def _phimoe():
    from transformers.models.phimoe import PhimoeConfig, PhimoeForCausalLM
    config = PhimoeConfig(vocab_size=64, hidden_size=16, intermediate_size=12,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                          num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32)
    config._experts_implementation = "eager"  # float64 (the grouped mm takes no doubles)
    torch.manual_seed(0)
    return PhimoeForCausalLM(config).double()


def _deepseek_v4():
    from transformers.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM
    config = DeepseekV4Config(
        vocab_size=64, hidden_size=16, moe_intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, q_lora_rank=8,
        num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
        max_position_embeddings=32, hc_mult=2, hc_sinkhorn_iters=2, sliding_window=4,
        o_groups=2, o_lora_rank=4, index_n_heads=2, index_head_dim=4, index_topk=4,
        num_nextn_predict_layers=0)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    return DeepseekV4ForCausalLM(config).double()


def _step_and_check(pre, model):
    """One step on a small batch: every preconditioned layer whose weight got a gradient
    captured its rows and passed the weight self-check (none is left without statistics);
    a layer the forward did not run (DeepSeek-V4's compressor on 8 tokens) has no gradient."""
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    pre.step()
    report = pre.capture_report()
    ran = 0
    for layer in pre._layers:
        row = report[layer.name]
        if layer.module.weight.grad is None:
            assert row["rows"] is None, layer.name
            continue
        ran += 1
        assert row["preconditioned"] and row["self_check"].get("weight") == "pass", \
            (layer.name, row)
    assert pre.steps == 1 and ran >= 5


@pytest.mark.parametrize("kind", [MKOR, KFAC])
def test_phimoe_router_is_refused_and_the_rest_steps(kind):
    model = _phimoe()
    pre = _pre(kind, model, self_check=1)
    router = "model.layers.0.mlp.router"
    assert router not in pre.preconditioned_modules
    assert pre.skip_reasons[router].startswith("nn.Linear subclass PhimoeTopKRouter overrides")
    assert "model.layers.0.mlp.experts.gate_up_proj" in pre.preconditioned_modules
    _step_and_check(pre, model)


@pytest.mark.parametrize("kind", [MKOR, KFAC])
def test_deepseek_v4_grouped_linear_is_refused_and_the_model_steps(kind):
    """DeepseekV4GroupedLinear multiplies each group of heads by its own block of W (a
    block-diagonal product): refused at discovery, where it used to raise at the first capture."""
    model = _deepseek_v4()
    pre = _pre(kind, model, self_check=1)
    grouped = "model.layers.0.self_attn.o_a_proj"
    assert grouped not in pre.preconditioned_modules
    assert pre.skip_reasons[grouped].startswith(
        "nn.Linear subclass DeepseekV4GroupedLinear overrides forward")
    assert {"model.layers.0.self_attn.o_b_proj", "model.layers.0.mlp.experts.down_proj",
            "lm_head"} <= set(pre.preconditioned_modules)
    _step_and_check(pre, model)


# -- the survey: transformers' own nn.Linear subclasses --------------------------------------

#: every class of transformers 5.25's models (``modeling_*.py``) and integrations written
#: ``class X(nn.Linear)``, and whether its body defines ``forward``, from reading them (the
#: README lists the refused ones)
SURVEY = {
    "models/llama4/modeling_llama4.py": {"Llama4Router": True},
    "models/ergo/modeling_ergo.py": {"ErgoLinearWithFP32Output": True},
    "models/dory/modeling_dory.py": {"DoryLMHead": True},
    "models/esm/modeling_esmfold.py": {"EsmFoldLinear": False},
    "models/deepseek_v4/modeling_deepseek_v4.py": {"DeepseekV4GroupedLinear": True},
    "models/phimoe/modeling_phimoe.py": {"PhimoeTopKRouter": True},
    "models/idefics/modeling_idefics.py": {"IdeficsDecoupledLinear": True},
    "models/ovis2_5/modeling_ovis2_5.py": {"Ovis2_5VisualEmbeddingProjection": True},
    "models/falcon/modeling_falcon.py": {"FalconLinear": True},
    "integrations/compressed_tensors.py": {"CompressedTensorsFP8Linear": True},
    "integrations/bitnet.py": {"AutoBitLinear": True},
    "integrations/fbgemm_fp8.py": {"FbgemmFp8Linear": True},
    "integrations/metal_quantization.py": {"MetalLinear": True},
    "integrations/gemma_quant.py": {"QuantizedLinear": True},
    "integrations/finegrained_fp8.py": {"FP8Linear": True},
}


def _scan(root):
    """{file: {class: defines forward}} of the ``class X(nn.Linear)`` classes under ``root``."""
    import re
    head = re.compile(r"^class (\w+)\((?:nn|torch\.nn)\.Linear\):", re.M)
    found = {}
    for path in sorted([*root.glob("models/*/modeling_*.py"), *root.glob("integrations/*.py")]):
        text = path.read_text(encoding="utf-8")
        for match in head.finditer(text):
            end = re.compile(r"^\S", re.M).search(text, match.end())
            body = text[match.end():end.start() if end else len(text)]
            found.setdefault(path.relative_to(root).as_posix(), {})[match.group(1)] = \
                "\n    def forward(" in body
    return found


def test_the_survey_of_transformers_linear_subclasses_is_current():
    """The classes the README names are all there is (re-survey when transformers moves on):
    every one that defines forward is refused by the rule, except the known products."""
    from pathlib import Path
    if transformers.__version__.split(".")[:2] != ["5", "25"]:
        pytest.skip(f"the survey is of transformers 5.25, not {transformers.__version__}")
    assert _scan(Path(transformers.__file__).parent) == SURVEY
    known = {q.rpartition(".")[2] for q in _KNOWN_LINEAR_PRODUCTS}
    assert known == {"FalconLinear"}
    assert all(f.startswith("models/falcon/") for f, classes in SURVEY.items()
               if known & set(classes))
