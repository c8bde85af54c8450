"""Tiny transformers 5.25 mixture-of-experts models built offline from their configs, in any
dtype and experts implementation (issue 45): the families whose experts forwards compute in
dtypes of their own.

* "mixtral", "qwen2_moe": the decorator's default layout; their class's own forward is the
  eager loop, and transformers' default implementation is ``grouped_mm``.
* "nemotron_h": no gate (``up_proj``, relu2), one MoE layer and one attention layer.
* "inkling2": a float32 SwiGLU softcap gate and a float32 accumulator in its own forward.
* "openai_privacy_filter": transposed storage with biases; its own forward casts rows,
  weights and biases to float32 and sums in float32 (a token classifier).

Built with ``_from_config(config, dtype=...)`` as ``from_pretrained(dtype=...)`` builds them,
so the modules a model keeps in float32 (``_keep_in_fp32_modules_strict``: NemotronH's and
Inkling2's router weights) stay float32 in a float64 model."""
import torch

from .moe_twin import fused_experts_modules

__all__ = ["FAMILIES", "tiny_moe", "experts_of", "loss_of", "distinct_ids"]

FAMILIES = ("mixtral", "qwen2_moe", "nemotron_h", "inkling2", "openai_privacy_filter")
VOCAB = 64
_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _config(family):
    import transformers
    common = dict(hidden_size=16, num_attention_heads=2, num_key_value_heads=2,
                  vocab_size=VOCAB, max_position_embeddings=32, num_experts_per_tok=2)
    if family == "mixtral":
        return (transformers.MixtralConfig(intermediate_size=12, num_local_experts=4,
                                           num_hidden_layers=1, **common),
                transformers.MixtralForCausalLM)
    if family == "qwen2_moe":
        return (transformers.Qwen2MoeConfig(intermediate_size=24, moe_intermediate_size=12,
                                            shared_expert_intermediate_size=12, num_experts=4,
                                            num_hidden_layers=1, **common),
                transformers.Qwen2MoeForCausalLM)
    if family == "nemotron_h":
        return (transformers.NemotronHConfig(
            layers_block_type=["moe", "full_attention"], head_dim=8, intermediate_size=12,
            n_routed_experts=4, moe_intermediate_size=12, moe_shared_expert_intermediate_size=12,
            n_group=1, topk_group=1, mamba_num_heads=2, mamba_head_dim=8, ssm_state_size=8,
            n_groups=1, **common, **_IDS), transformers.NemotronHForCausalLM)
    if family == "inkling2":
        return (transformers.Inkling2TextConfig(
            num_hidden_layers=2, head_dim=8, moe_intermediate_size=12, n_routed_experts=4,
            unpadded_vocab_size=VOCAB, swa_head_dim=8, swa_num_attention_heads=2,
            swa_num_key_value_heads=2, sliding_window_size=8, rel_extent=8, d_rel=4,
            **common, **_IDS), transformers.Inkling2ForCausalLM)
    if family == "openai_privacy_filter":
        return (transformers.OpenAIPrivacyFilterConfig(
            num_hidden_layers=2, num_local_experts=4, intermediate_size=12, head_dim=8,
            **common, **_IDS), transformers.OpenAIPrivacyFilterForTokenClassification)
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def tiny_moe(family, implementation=None, dtype=torch.float64, seed=0):
    """A seeded tiny model of ``family`` in ``dtype``, train mode, its experts run by
    ``implementation`` ("eager", "batched_mm", "grouped_mm"; None: transformers' default)."""
    config, cls = _config(family)
    if implementation is not None:
        config._experts_implementation = implementation
    torch.manual_seed(seed)
    return cls._from_config(config, dtype=dtype).train()


def experts_of(model):
    """[(name, module)] of the model's fused experts modules, in order."""
    return fused_experts_modules(model)


def distinct_ids(seed, batch=2, seq=8):
    """(batch, seq) token ids, no id twice: no two rows of the first layer are equal, so each
    row of an expert is told apart by its value."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(VOCAB, generator=g)[:batch * seq].reshape(batch, seq)


def loss_of(model, ids):
    """The model's own loss on ``ids``: next-token for the causal LMs, a token label (id
    parity) for the privacy filter."""
    if model.config.model_type == "openai_privacy_filter":
        return model(input_ids=ids, labels=ids % model.config.num_labels).loss
    return model(input_ids=ids, labels=ids, use_cache=False).loss
