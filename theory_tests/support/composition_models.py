"""The composition matrix's models, batches and cases (issue 20 item 5; issue 29's five rows are
built in :mod:`composition_mask_models`, issue 31's four rows with fused experts in
:mod:`composition_moe`).

Models (random weights, built offline from small configs, dropout 0, float64 unless a feature
needs otherwise; each builds in a few milliseconds): GPT-2, BERT (MLM) and ResNet from
:mod:`hf_cases`, and here Llama, T5, ViT, ALBERT (one shared layer group called three times
per forward) and an MoE. The MoE is transformers' ``SwitchTransformersForConditionalGeneration``:
in transformers 5.24 its experts are ``nn.Linear`` pairs (``wi``, ``wo``) called in a Python
loop over the experts that received tokens (an expert routed no token is not called), whereas
Mixtral / Qwen-MoE hold their experts as fused 3-D weights (the rows mixtral, qwen2_moe, aria,
gpt_oss). Its routers compute in float32 by
design ("selective precision"); the float64 models here set them to float64 so that comparisons
of runs are not limited by the router's rounding. :class:`HashMoE` is a small custom MoE whose
experts *are* called with 0 rows (a static loop over all experts, as transformers 4.x's Mixtral
loop and compile-friendly code do), for the zero-row checks. Also the batches, the
checkpointing of each model, the token mask each layer's rows prescribe, and :class:`Case`.
"""
import dataclasses
import functools
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import (AlbertConfig, AlbertForMaskedLM, LlamaConfig, LlamaForCausalLM,
                          SwitchTransformersConfig, SwitchTransformersForConditionalGeneration,
                          T5Config, T5ForConditionalGeneration, ViTConfig,
                          ViTForImageClassification)
from transformers.modeling_outputs import CausalLMOutput

from theory_tests.support import composition_mask_models as masks
from theory_tests.support import composition_moe as moe
from theory_tests.support.composition_rows import all_tokens, default_loss, seq2seq_rows, switch_rows
from theory_tests.support.hf_cases import SEQ, VOCAB, lm_batch, tiny_bert, tiny_gpt2, tiny_resnet


f64 = torch.float64


MODELS = ["gpt2", "bert", "llama", "t5", "vit", "albert", "resnet", "moe",
          # issue 29: masks a call's shape would get wrong (composition_mask_models)
          "clip", "xlnet", "encdec", "bert_wrapper", "bert_positional",
          # issue 31: fused experts, 3-D parameters preconditioned as stacks (composition_moe)
          *moe.FUSED]
FEATURES = ["plain", "ckpt_reentrant", "ckpt_nonreentrant", "padding", "compile", "lora",
            "accelerate", "ddp", "lightning_bf16"]
KINDS = ["mkor", "kfac"]

#: Cells of the matrix that have no meaningful run, with the reason (the table repeats them).
NOT_APPLICABLE = {
    ("vit", "padding"): "an image is a fixed grid of patches: there are no padded tokens and "
                        "ViTForImageClassification takes no attention mask",
    ("resnet", "padding"): "a convolutional network over a fixed-size image has no tokens "
                           "and no attention mask",
}

#: Relative tolerance on parameters (relative to the largest parameter change,
#: hf_cases.update_rel_err) for two float64 runs that compute the same function with sums
#: in a different order (micro-batches vs one batch, an all-reduce vs one process, compiled
#: vs eager kernels). A sum of n terms reassociated moves by at most 2 gamma_n = 2 n u of the
#: sum of magnitudes (u = 2^-53); here n <= 10^2 (vocabulary, rows, hidden sizes), so each
#: reduction agrees to ~2e-14 relative, and the chain of a forward, a backward and a step
#: compounds a few tens of them (~1e-12 per step). Three preconditioned steps may amplify
#: that by the factors' conditioning (taken as ~10; the measured cells stay below 2e-11):
#: ~1e-11, so 1e-10 leaves a 10x margin -- the bound
#: kronecker/test_hf_models.py uses for the same reason.
REORDER_TOL = 1e-10

LENGTHS = [8, 5, 3, 6]       # real tokens per row of a padded (encoder) batch of 4
DEC_LENGTHS = [4, 8, 6, 2]   # decoder real tokens: the same padded length, other positions


# -- models -----------------------------------------------------------------------------------
def tiny_llama(seed=0, dtype=f64, n_layer=2):
    """LlamaForCausalLM, hidden 32, 2 heads (1 KV head), intermediate 64, untied head."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=n_layer, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=32, attention_dropout=0.0, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(dtype).train()


def tiny_t5(seed=0, dtype=f64):
    """T5ForConditionalGeneration, d_model 32, one encoder and one decoder block, 2 heads,
    lm_head tied to the shared embedding (skipped as tied)."""
    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=1,
                   num_decoder_layers=1, num_heads=2, relative_attention_num_buckets=8,
                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return T5ForConditionalGeneration(cfg).to(dtype).train()


def tiny_vit(seed=0, dtype=f64):
    """ViTForImageClassification on 8x8 images, 4x4 patches (a Conv2d patch embedding),
    hidden 32, 2 layers, 5 labels."""
    torch.manual_seed(seed)
    cfg = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=32,
                    num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=5)
    return ViTForImageClassification(cfg).to(dtype).train()


def tiny_albert(seed=0, dtype=f64):
    """AlbertForMaskedLM with one layer group of one layer, used for all 3 hidden layers: every
    Linear of the group runs three times per forward (weight sharing)."""
    torch.manual_seed(seed)
    cfg = AlbertConfig(vocab_size=VOCAB, embedding_size=16, hidden_size=32,
                       num_hidden_layers=3, num_hidden_groups=1, inner_group_num=1,
                       num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       classifier_dropout_prob=0.0, pad_token_id=0)
    return AlbertForMaskedLM(cfg).to(dtype).train()


def tiny_moe(seed=0, dtype=f64):
    """SwitchTransformersForConditionalGeneration: one sparse encoder block and one sparse
    decoder block, 4 Linear experts each (top-1 routing, capacity = the sequence length, so
    no token is dropped), d_model 32. The routers are set to ``dtype`` (module docstring)."""
    torch.manual_seed(seed)
    cfg = SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_decoder_layers=1,
        num_heads=2, num_experts=4, expert_capacity=SEQ, num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1, relative_attention_num_buckets=8, dropout_rate=0.0,
        router_jitter_noise=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = SwitchTransformersForConditionalGeneration(cfg).to(dtype).train()
    for module in model.modules():
        if type(module).__name__ == "SwitchTransformersTop1Router":
            module.dtype = dtype
    return model


class ExpertRows:
    """Rows each expert receives, per step: ``rows[name][t]`` (absent: the expert was not
    called in step t), for a Switch model's expert ``wi`` Linears (by module name) and for
    fused experts, one entry per expert ``<experts module>[e]`` (the pairs routed to it; 0 when
    none). Set :attr:`step` before each step's forwards; :meth:`remove` the hooks."""

    def __init__(self, model):
        self.step, self.rows, self._handles = 0, {}, []
        for name, module in model.named_modules():
            if ".experts.expert_" in name and name.endswith(".wi"):
                self.rows[name] = {}
                self._handles.append(module.register_forward_pre_hook(self._hook(name)))
            elif moe.is_fused_experts(module):
                for e in range(module.num_experts):
                    self.rows[f"{name}[{e}]"] = {}
                self._handles.append(module.register_forward_pre_hook(self._fused_hook(name)))

    def _hook(self, name):
        def hook(module, args):
            per_step = self.rows[name]
            per_step[self.step] = per_step.get(self.step, 0) + args[0].shape[0]
        return hook

    def _fused_hook(self, name):
        def hook(module, args):
            counts = moe.expert_counts(args[1], module.num_experts).tolist()
            for e, n in enumerate(counts):
                per_step = self.rows[f"{name}[{e}]"]
                per_step[self.step] = per_step.get(self.step, 0) + n
        return hook

    def remove(self):
        for h in self._handles:
            h.remove()


class HashMoE(nn.Module):
    """A one-layer LM with a top-1 MoE block of 4 ``nn.Linear`` experts: a token goes to expert
    ``id % 4`` (hash routing, Roller et al. 2021, so the routing is known from the ids) with
    the gate probability of a learned ``router`` Linear. ``call_empty=True`` calls every
    expert, also with 0 rows (a static loop); ``False`` skips experts without tokens (the loop
    of transformers 5). Returns an object with ``.loss`` like a transformers model."""

    def __init__(self, d=16, n_experts=4, call_empty=True):
        super().__init__()
        self.call_empty = call_empty
        self.embed = nn.Embedding(VOCAB, d)
        self.router = nn.Linear(d, n_experts)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(n_experts))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids, labels, attention_mask=None):
        x = self.embed(input_ids)
        flat = x.reshape(-1, x.shape[-1])
        choice = input_ids.reshape(-1) % len(self.experts)
        gate = F.softmax(self.router(x), dim=-1).reshape(-1, len(self.experts))
        gate = gate.gather(1, choice[:, None])
        mixed = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().squeeze(1)
            if rows.numel() == 0 and not self.call_empty:
                continue
            mixed = mixed.index_add(0, rows, expert(flat[rows]) * gate[rows])
        logits = self.head(x + torch.tanh(mixed).reshape(x.shape))
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)


def hash_moe(seed=0, dtype=f64, call_empty=True):
    torch.manual_seed(seed)
    return HashMoE(call_empty=call_empty).to(dtype).train()


def hash_moe_batch(t, size=8, seq=SEQ, avoid_last_expert=(0, 4)):
    """{input_ids, labels} for :class:`HashMoE`; rows ``avoid_last_expert[0]`` up to (not
    including) ``avoid_last_expert[1]`` hold no token routed to the last expert (id % 4 == 3),
    every other row holds at least one. With 8 rows on 2 ranks, rank 0 gets rows 0-3: its
    last expert is called with 0 rows, rank 1's with some."""
    g = torch.Generator().manual_seed(500 + t)
    ids = torch.randint(1, VOCAB, (size, seq), generator=g)
    labels = torch.randint(0, VOCAB, (size, seq), generator=g)
    lo, hi = avoid_last_expert
    avoid = (torch.arange(size) >= lo) & (torch.arange(size) < hi)
    ids = torch.where(avoid[:, None] & (ids % 4 == 3), ids - 1, ids)
    ids[~avoid, 0] = 3 + 4 * t  # a token for the last expert in every other row
    return {"input_ids": ids, "labels": labels}


# -- batches ----------------------------------------------------------------------------------
def seq2seq_batch(seed, batch=4, seq=SEQ, enc_lengths=None, dec_lengths=None, pad_seed=None,
                  decoder_ids=True):
    """{input_ids, attention_mask, labels[, decoder_input_ids, decoder_attention_mask]} for an
    encoder-decoder model, encoder and decoder both ``seq`` long. ``enc_lengths`` /
    ``dec_lengths``: real tokens per row (right padding: attention mask 0, labels -100). The
    ids at padded positions (encoder and, with ``decoder_ids``, decoder) come from ``pad_seed``
    only, so two batches that differ in ``pad_seed`` differ only where the masks are 0. Without
    ``decoder_ids`` the model shifts the labels right itself (pad id 0 where labels are -100)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (batch, seq), generator=g)
    labels = torch.randint(2, VOCAB, (batch, seq), generator=g)
    positions = torch.arange(seq)
    enc_mask = torch.ones(batch, seq, dtype=torch.long)
    dec_mask = torch.ones(batch, seq, dtype=torch.long)
    if enc_lengths is not None:
        enc_mask = (positions < torch.tensor(enc_lengths)[:, None]).long()
    if dec_lengths is not None:
        dec_mask = (positions < torch.tensor(dec_lengths)[:, None]).long()
    gp = torch.Generator().manual_seed(1000 + (seed if pad_seed is None else pad_seed))
    pads = torch.randint(2, VOCAB, (2, batch, seq), generator=gp)
    ids = torch.where(enc_mask.bool(), ids, pads[0])
    labels = torch.where(dec_mask.bool(), labels, torch.full_like(labels, -100))
    out = {"input_ids": ids, "attention_mask": enc_mask, "labels": labels}
    if decoder_ids:
        shifted = torch.cat([torch.zeros(batch, 1, dtype=torch.long),
                             labels[:, :-1].clamp(min=0)], dim=1)
        out["decoder_input_ids"] = torch.where(dec_mask.bool(), shifted, pads[1])
        out["decoder_attention_mask"] = dec_mask
    return out


def image_batch(seed, batch=4, size=16, num_labels=10, dtype=f64):
    """{pixel_values (batch, 3, size, size), labels}."""
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(batch, 3, size, size, generator=g).to(dtype),
            "labels": torch.randint(0, num_labels, (batch,), generator=g)}


def _lm(t, size=4, padded=False, pad_seed=0, dtype=f64):
    lengths = (LENGTHS * 2)[:size] if padded else None
    return lm_batch(t, batch=size, lengths=lengths, pad_seed=pad_seed + t)


def _s2s(t, size=4, padded=False, pad_seed=0, dtype=f64, decoder_ids=True):
    if not padded:
        return seq2seq_batch(t, batch=size, decoder_ids=False)
    return seq2seq_batch(t, batch=size, enc_lengths=(LENGTHS * 2)[:size],
                         dec_lengths=(DEC_LENGTHS * 2)[:size], pad_seed=pad_seed + t,
                         decoder_ids=decoder_ids)


def _img(side, num_labels):
    """A batch builder of ``side`` x ``side`` images with ``num_labels`` classes."""
    def batch(t, size=4, padded=False, pad_seed=0, dtype=f64):
        assert not padded, "image batches have no padding"
        return image_batch(t, batch=size, size=side, num_labels=num_labels, dtype=dtype)
    return batch


# -- checkpointing ------------------------------------------------------------------------------
def _hf_checkpointing(model, use_reentrant):
    """transformers' own switch, as training scripts call it (5.24 deprecates the name in
    favour of ``activation_checkpointing_enable``; the warning is silenced)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning,
                                message=".*gradient_checkpointing.*deprecated")
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})


def _checkpoint_modules(modules, use_reentrant):
    """Wrap each module's ``forward`` in ``torch.utils.checkpoint.checkpoint`` (for models
    without transformers' gradient-checkpointing support). The module's ``__call__`` -- and
    so every hook on it -- stays outside the checkpoint, as transformers does."""
    for module in modules:
        inner = module.forward

        def forward(*args, _inner=inner, **kwargs):
            # keyword arguments bound first: the reentrant variant takes positional ones only
            return torch.utils.checkpoint.checkpoint(functools.partial(_inner, **kwargs), *args,
                                                     use_reentrant=use_reentrant)
        module.forward = forward


def _albert_checkpointing(model, use_reentrant):
    """transformers 5.24's ALBERT has no gradient-checkpointing support
    (``supports_gradient_checkpointing`` is False): each call of the shared layer group is
    checkpointed directly, so one module runs three times per forward inside checkpoints."""
    _checkpoint_modules(model.albert.encoder.albert_layer_groups, use_reentrant)


def _resnet_checkpointing(model, use_reentrant):
    """transformers' ResNet has no gradient-checkpointing support: its stages are checkpointed
    directly (BatchNorm running statistics are updated again by the recompute; they are
    buffers, not compared)."""
    _checkpoint_modules(model.resnet.encoder.stages, use_reentrant)


def _bn_eval(model):
    """BatchNorm in eval mode (running statistics): the loss becomes a mean of per-sample
    losses, so micro-batches and shards compute the same function as the whole batch."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.eval()
    return model


# -- the cases --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    """One row of the matrix. ``build(seed=0, dtype=f64)`` -> model in train mode;
    ``batch(t, size=4, padded=False, pad_seed=0, dtype=f64)`` -> the batch (with labels);
    ``checkpointing(model, use_reentrant)``; ``lora_targets`` for peft; ``per_sample(model)``
    makes the loss a per-sample mean where the model does not (BatchNorm); ``seq2seq``
    adds the padding column's labels-only run; ``loss(model, batch, per_sample)`` calls the
    model as its users do (default ``model(**batch).loss``; ``per_sample`` asks for a mean
    over samples where the model's own loss is not one); ``rows(name)`` says what a layer's
    rows are (:mod:`composition_rows`); ``shape_misleads``: a mask that merely fits a layer's
    rows' shape (``composition_rows.shape_coincidence``) is the wrong mask for some."""

    name: str
    build: object
    batch: object
    tokens: bool
    checkpointing: object
    lora_targets: tuple
    per_sample: object = None
    seq2seq: bool = False
    lora_kwargs: tuple = ()
    loss: object = default_loss
    rows: object = all_tokens
    shape_misleads: bool = False


CASES = {
    "gpt2": Case("gpt2", tiny_gpt2, _lm, True, _hf_checkpointing, ("c_attn",),
                 lora_kwargs=(("fan_in_fan_out", True),)),
    "bert": Case("bert", tiny_bert, _lm, True, _hf_checkpointing, ("query", "value")),
    "llama": Case("llama", tiny_llama, _lm, True, _hf_checkpointing, ("q_proj", "v_proj")),
    "t5": Case("t5", tiny_t5, _s2s, True, _hf_checkpointing, ("q", "v"), seq2seq=True,
               rows=seq2seq_rows),
    "vit": Case("vit", tiny_vit, _img(8, 5), False, _hf_checkpointing, ("q_proj", "v_proj")),
    "albert": Case("albert", tiny_albert, _lm, True, _albert_checkpointing,
                   ("query", "value")),
    "resnet": Case("resnet", lambda seed=0, dtype=f64: tiny_resnet(seed).to(dtype), _img(16, 10),
                   False, _resnet_checkpointing, (r".*layers\.0\.layer\.1\.convolution",),
                   per_sample=_bn_eval),
    "moe": Case("moe", tiny_moe, _s2s, True, _hf_checkpointing, ("q", "v", "wi"), seq2seq=True,
                rows=switch_rows),
    "clip": Case("clip", masks.tiny_clip, masks.clip_batch, True, _hf_checkpointing,
                 ("q_proj", "v_proj"), loss=masks.clip_loss, rows=masks.clip_rows,
                 shape_misleads=True),
    "xlnet": Case("xlnet", masks.tiny_xlnet, masks.xlnet_batch, True,
                  lambda model, reentrant: _checkpoint_modules(model.transformer.layer,
                                                               reentrant),
                  ("layer_1",), rows=masks.xlnet_rows, shape_misleads=True),
    "encdec": Case("encdec", masks.tiny_encdec, _s2s, True, _hf_checkpointing,
                   ("query", "value"), seq2seq=True, loss=masks.encdec_loss,
                   rows=masks.encdec_rows, shape_misleads=True),
    "bert_wrapper": Case("bert_wrapper", masks.tiny_bert_wrapper, _lm, True,
                         lambda model, reentrant: _hf_checkpointing(model.encoder, reentrant),
                         ("query", "value"), loss=masks.wrapper_loss),
    "bert_positional": Case("bert_positional", tiny_bert, _lm, True, _hf_checkpointing,
                            ("query", "value"), loss=masks.positional_loss),
    "mixtral": Case("mixtral", moe.tiny_mixtral, _lm, True, _hf_checkpointing,
                    ("q_proj", "v_proj"), rows=moe.mixtral_rows),
    "qwen2_moe": Case("qwen2_moe", moe.tiny_qwen2_moe, _lm, True, _hf_checkpointing,
                      ("q_proj", "v_proj"), rows=moe.qwen2_moe_rows),
    "aria": Case("aria", moe.tiny_aria, _lm, True, _hf_checkpointing, ("q_proj", "v_proj"),
                 rows=moe.aria_rows),
    "gpt_oss": Case("gpt_oss", moe.tiny_gpt_oss, _lm, True, _hf_checkpointing,
                    ("q_proj", "v_proj"), rows=moe.gpt_oss_rows),
}
