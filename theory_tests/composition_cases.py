"""The composition matrix's cases (issue 20 item 5): tiny real models x training-loop
features, each run under MKOR or K-FAC and compared with a reference run.

Models (random weights, built offline from small configs, dropout 0, float64 unless a feature
needs otherwise; each builds in a few milliseconds): GPT-2, BERT (MLM) and ResNet from
:mod:`hf_cases`, and here Llama, T5, ViT, ALBERT (one shared layer group called three times
per forward) and an MoE. The MoE is transformers' ``SwitchTransformersForConditionalGeneration``:
in transformers 5.24 its experts are ``nn.Linear`` pairs (``wi``, ``wo``) called in a Python
loop over the experts that received tokens (an expert routed no token is not called), whereas
Mixtral / Qwen-MoE hold their experts as fused 3-D weights. Its routers compute in float32 by
design ("selective precision"); the float64 models here set them to float64 so that comparisons
of runs are not limited by the router's rounding. :class:`HashMoE` is a small custom MoE whose
experts *are* called with 0 rows (a static loop over all experts, as transformers 4.x's Mixtral
loop and compile-friendly code do), for the zero-row checks.

:func:`run` trains a model for a few steps (SGD backbone with momentum, ``inv_freq=1``, MKOR
with ``factor_dtype="float64"``) under one loop feature and returns a :class:`Result`: the
final parameters and the preconditioner's statistics at every step. :class:`Observer` computes
the statistics independently of ``torch_impl.mkor.capture`` (its own forward hooks and
``retain_grad``), with a rounding bound derived from the rows it saw. :func:`ddp_job` is the
body of one gloo rank of the DDP cells.
"""
import contextlib
import dataclasses
import functools
import logging
import math
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import (AlbertConfig, AlbertForMaskedLM, LlamaConfig, LlamaForCausalLM,
                          SwitchTransformersConfig, SwitchTransformersForConditionalGeneration,
                          T5Config, T5ForConditionalGeneration, ViTConfig,
                          ViTForImageClassification)
from transformers.modeling_outputs import CausalLMOutput
from transformers.pytorch_utils import Conv1D

from torch_impl.mkor import KFAC, MKOR

from hf_cases import SEQ, VOCAB, lm_batch, snapshot, tiny_bert, tiny_gpt2, tiny_resnet

f64 = torch.float64

__all__ = ["MODELS", "FEATURES", "KINDS", "NOT_APPLICABLE", "CASES", "Case", "Result",
           "Observer", "HashMoE", "LENGTHS", "DEC_LENGTHS", "tiny_llama", "tiny_t5", "tiny_vit",
           "tiny_albert", "tiny_moe", "seq2seq_batch", "image_batch", "make_preconditioner",
           "run", "ddp_job", "compare", "counters_of", "ExpertRows", "hash_moe",
           "hash_moe_batch", "oracle_errors", "statistics_of", "describe", "max_abs_pairs",
           "max_rel_pairs", "REORDER_TOL"]

MODELS = ["gpt2", "bert", "llama", "t5", "vit", "albert", "resnet", "moe"]
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
#: test_mkor_hf_models.py uses for the same reason.
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
    """Rows each expert ``wi`` Linear of a Switch model receives, per step: ``rows[name][t]``
    (absent: the expert was not called in step t). Set :attr:`step` before each step's
    forwards; :meth:`remove` the hooks."""

    def __init__(self, model):
        self.step, self.rows, self._handles = 0, {}, []
        for name, module in model.named_modules():
            if ".experts.expert_" in name and name.endswith(".wi"):
                self.rows[name] = {}
                self._handles.append(module.register_forward_pre_hook(self._hook(name)))

    def _hook(self, name):
        def hook(module, args):
            per_step = self.rows[name]
            per_step[self.step] = per_step.get(self.step, 0) + args[0].shape[0]
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


# -- token masks of the independent computation ----------------------------------------------
def _decoder_mask(batch):
    if "decoder_attention_mask" in batch:
        return batch["decoder_attention_mask"].bool()
    return batch["labels"] != -100


def _token_mask(case, batch, name, lead):
    """The (B, T) mask that selects layer ``name``'s rows of leading shape ``lead`` in
    ``batch``, or None when the rows are not tokens of a masked sequence (images, a gathered
    expert input, a call without a mask). Encoder-decoder models: encoder layers and the
    cross-attention keys / values read encoder tokens (``attention_mask``); decoder
    self-attention, cross-attention queries / outputs, FFNs and the head read decoder tokens
    (``decoder_attention_mask``, else ``labels != -100``)."""
    if "attention_mask" not in batch:
        return None
    if case.seq2seq and not name.startswith("encoder.") and not (
            ".EncDecAttention.k" in name or ".EncDecAttention.v" in name):
        mask = _decoder_mask(batch)
    else:
        mask = batch["attention_mask"].bool()
    return mask if tuple(lead) == tuple(mask.shape) else None


# -- the cases --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    """One row of the matrix. ``build(seed=0, dtype=f64)`` -> model in train mode;
    ``batch(t, size=4, padded=False, pad_seed=0, dtype=f64)`` -> the forward's keyword
    arguments (with labels); ``checkpointing(model, use_reentrant)``; ``lora_targets`` for
    peft; ``per_sample(model)`` makes the loss a per-sample mean where it is not (BatchNorm);
    ``seq2seq`` for encoder-decoder masks."""

    name: str
    build: object
    batch: object
    tokens: bool
    checkpointing: object
    lora_targets: tuple
    per_sample: object = None
    seq2seq: bool = False
    lora_kwargs: tuple = ()


CASES = {
    "gpt2": Case("gpt2", tiny_gpt2, _lm, True, _hf_checkpointing, ("c_attn",),
                 lora_kwargs=(("fan_in_fan_out", True),)),
    "bert": Case("bert", tiny_bert, _lm, True, _hf_checkpointing, ("query", "value")),
    "llama": Case("llama", tiny_llama, _lm, True, _hf_checkpointing, ("q_proj", "v_proj")),
    "t5": Case("t5", tiny_t5, _s2s, True, _hf_checkpointing, ("q", "v"), seq2seq=True),
    "vit": Case("vit", tiny_vit, _img(8, 5), False, _hf_checkpointing, ("q_proj", "v_proj")),
    "albert": Case("albert", tiny_albert, _lm, True, _albert_checkpointing,
                   ("query", "value")),
    "resnet": Case("resnet", lambda seed=0, dtype=f64: tiny_resnet(seed).to(dtype), _img(16, 10),
                   False, _resnet_checkpointing, (r".*layers\.0\.layer\.1\.convolution",),
                   per_sample=_bn_eval),
    "moe": Case("moe", tiny_moe, _s2s, True, _hf_checkpointing, ("q", "v", "wi"), seq2seq=True),
}


# -- independent statistics --------------------------------------------------------------------
def _first_tensor(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def _gamma(n, dtype):
    u = torch.finfo(dtype).eps / 2
    return n * u / (1 - n * u)


class Observer:
    """The statistics of the preconditioned layers, computed without ``torch_impl``'s capture
    code: a forward hook per layer keeps a copy of its input and calls ``retain_grad()`` on
    its output; after the backward the rows are formed here (Linear / Conv1D: the input's and
    the output gradient's last dimension; Conv2d: ``F.unfold`` patches, L positions per
    sample) and, with ``case``'s token masks, padded rows are dropped. :meth:`step` turns the
    rows of every backward since the last call into the statistics of one factor update and
    a bound on the rounding difference from any other summation order:

    * MKOR (spec K3-K6): a_bar = mean over rows of [a | 1]; g_bar = sum over rows of g, / L
      for a convolution;
    * K-FAC (K19): A = mean over rows of [a|1][a|1]^T, G = N sum g g^T with N samples, then
      the EMA A <- beta A + (1 - beta) A_new (the first update takes A_new).

    Bounds: a sum of n terms computed in two orders differs by at most 2 gamma_n times the
    sum of the terms' magnitudes (gamma_n = n u / (1 - n u), u the unit roundoff), each
    division or scaling adds u of the result on either side, and the EMA carries the bound
    linearly. n counts every row a layer received (masked rows enter the capture code's sums
    as zeros) plus one per call (per-call partial sums are added).
    """

    def __init__(self, model, names, case=None, kind="mkor", decay=0.95):
        self.case, self.kind, self.decay = case, kind, decay
        self.modules = {n: model.get_submodule(n) for n in names}
        self.batch = None
        self.unmatched = set()     # layers whose rows did not match the batch's token mask
        self._calls = {n: [] for n in names}
        self._ema = {}
        self._handles = [m.register_forward_hook(self._hook(n), with_kwargs=True)
                         for n, m in self.modules.items()]

    def remove(self):
        for h in self._handles:
            h.remove()

    def _hook(self, name):
        def hook(module, args, kwargs, out):
            if not (module.training and torch.is_grad_enabled() and out.requires_grad):
                return
            out.retain_grad()
            self._calls[name].append((_first_tensor(args, kwargs).detach().clone(), out,
                                      self.batch))
        return hook

    def _rows(self, name, x, out, batch):
        module = self.modules[name]
        if isinstance(module, nn.Conv2d):
            assert module.padding_mode == "zeros" and not isinstance(module.padding, str)
            a = F.unfold(x, module.kernel_size, dilation=module.dilation,
                         padding=module.padding, stride=module.stride).transpose(1, 2)
            g = out.grad.flatten(2).transpose(1, 2)
            per_sample = a.shape[1]
        else:
            a, g, per_sample = x, out.grad, 1
        mask = None
        if self.case is not None and self.case.tokens and batch is not None:
            lead = a.shape[:-1]
            mask = _token_mask(self.case, batch, name, lead)
            if mask is None and "attention_mask" in batch:
                self.unmatched.add(name)
        total = a[..., 0].numel()
        a, g = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
        if mask is not None:
            keep = mask.reshape(-1)
            a, g = a[keep], g[keep]
        return a, g, per_sample, total

    def step(self):
        """{name: (stat_1, stat_2, bound_1, bound_2)}, and forget the rows. MKOR: (a_bar,
        g_bar, ...) of the layers called since the last call; K-FAC: the factor EMAs (A, G,
        ...) after this update of every layer updated so far (``KFAC.factors()``'s keys)."""
        out = {}
        for name, calls in self._calls.items():
            if not calls:
                continue
            module = self.modules[name]
            has_bias = module.bias is not None and module.bias.requires_grad
            parts = [self._rows(name, x, o, b) for x, o, b in calls]
            a = torch.cat([p[0] for p in parts])
            g = torch.cat([p[1] for p in parts])
            per_sample = parts[0][2]
            n_terms = sum(p[3] for p in parts) + len(parts)
            dtype = torch.promote_types(a.dtype, torch.float32)
            a, g = a.to(dtype), g.to(dtype)
            u, gam = torch.finfo(dtype).eps / 2, _gamma(n_terms, dtype)
            n = a.shape[0]
            if has_bias:
                a = torch.cat([a, torch.ones(n, 1, dtype=dtype)], dim=1)
            if self.kind == "mkor":
                a_bar = a.sum(0) / n
                g_bar = g.sum(0) / per_sample
                a_tol = 2 * gam * a.abs().sum(0) / n + 2 * u * a_bar.abs()
                g_tol = 2 * gam * g.abs().sum(0) / per_sample + 2 * u * g_bar.abs()
                out[name] = (a_bar, g_bar, a_tol, g_tol)
            else:
                samples = n / per_sample
                A_new = a.T @ a / n
                G_new = (g.T @ g) * samples
                A_tol = 2 * gam * (a.abs().T @ a.abs()) / n + 2 * u * A_new.abs()
                G_tol = 2 * gam * (g.abs().T @ g.abs()) * samples + 2 * u * G_new.abs()
                if name in self._ema:
                    A0, G0, At0, Gt0 = self._ema[name]
                    b = self.decay
                    A, G = b * A0 + (1 - b) * A_new, b * G0 + (1 - b) * G_new
                    A_tol = b * At0 + (1 - b) * A_tol + 4 * u * (b * A0.abs() + A_new.abs())
                    G_tol = b * Gt0 + (1 - b) * G_tol + 4 * u * (b * G0.abs() + G_new.abs())
                else:
                    A, G = A_new, G_new
                self._ema[name] = (A, G, A_tol, G_tol)
            calls.clear()
        if self.kind == "kfac":  # every layer: K-FAC's factors() lists all once decomposed
            out = {name: self._ema.get(name) or self._identity(name) for name in self.modules}
        return out

    def _identity(self, name):
        """K-FAC's initial factors (I, I), exact: bound 0."""
        module = self.modules[name]
        if isinstance(module, Conv1D):
            d_in, d_out = module.weight.shape
        else:
            d_out, d_in = module.weight.shape[0], module.weight[0].numel()
        d_in += int(module.bias is not None and module.bias.requires_grad)
        dtype = torch.promote_types(module.weight.dtype, torch.float32)
        A, G = torch.eye(d_in, dtype=dtype), torch.eye(d_out, dtype=dtype)
        return A, G, torch.zeros_like(A), torch.zeros_like(G)


def oracle_errors(steps_mine, steps_oracle):
    """(max abs difference, max of difference / bound, worst layer) between the
    preconditioner's statistics per step ({name: (x, y)}) and the Observer's
    ({name: (x, y, x_tol, y_tol)}); layers must match exactly (else inf)."""
    worst_abs, worst_ratio, where = 0.0, 0.0, None
    for t, (mine, ref) in enumerate(zip(steps_mine, steps_oracle)):
        if set(mine) != set(ref):
            return math.inf, math.inf, f"step {t}: layers {sorted(set(mine) ^ set(ref))}"
        for name, (x, y, xt, yt) in ref.items():
            for got, want, tol in ((mine[name][0], x, xt), (mine[name][1], y, yt)):
                diff = (got.to(want.dtype) - want).abs()
                ratio = float((diff / tol.clamp_min(torch.finfo(want.dtype).tiny)).max())
                if float(diff.max()) > worst_abs:
                    worst_abs = float(diff.max())
                if ratio > worst_ratio:
                    worst_ratio, where = ratio, f"step {t}: {name}"
    return worst_abs, worst_ratio, where


# -- runs -------------------------------------------------------------------------------------
PRECONDITIONERS = {"mkor": MKOR, "kfac": KFAC}


def make_preconditioner(kind, model, lr=0.05, **kwargs):
    """MKOR (factor_dtype float64) or K-FAC on an SGD backbone (momentum 0.9) over the
    trainable parameters, ``inv_freq=1``: a factor update at every step."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
    if kind == "mkor":
        kwargs.setdefault("factor_dtype", "float64")
    return PRECONDITIONERS[kind](model, opt, inv_freq=1, **kwargs)


def counters_of(pre):
    """The preconditioner's per-layer counters as Python ints."""
    return {name: {k: int(v) for k, v in c.items()} for name, c in pre.counters().items()}


def _clone_pairs(d):
    return {n: tuple(None if t is None else t.detach().clone() for t in pair)
            for n, pair in d.items()}


def statistics_of(pre):
    """MKOR's inverse factors / K-FAC's factor EMAs, cloned."""
    return _clone_pairs(pre.inverse_factors() if isinstance(pre, MKOR) else pre.factors())


@dataclasses.dataclass
class Result:
    """What :func:`run` returns. ``pending``: MKOR's ``pending_vectors()`` before every step
    (K-FAC: its factor EMAs after every step, the statistics it exposes); ``factors``:
    ``inverse_factors()`` / ``factors()`` after every step; ``oracle``: the
    :class:`Observer`'s statistics per step (when observed); ``params`` / ``init``: the
    parameters after the run / before it; ``pre`` / ``model``: the preconditioner and the
    (peft-wrapped) model; ``unmatched``: the layers whose rows the Observer could not match
    to a token mask (when observed)."""

    kind: str
    params: dict
    init: dict
    pending: list
    factors: list
    oracle: list
    names: list
    pre: object = None
    model: object = None
    unmatched: set = None

    def statistics(self):
        return self.pending if self.kind == "mkor" else self.factors


def _split(batch, micro):
    n = next(iter(batch.values())).shape[0]
    return [{k: v[i * n // micro:(i + 1) * n // micro] for k, v in batch.items()}
            for i in range(micro)]


class _Recorder:
    """Records the statistics around each step (shared by every loop)."""

    def __init__(self, kind, pre, observer=None):
        self.kind, self.pre, self.observer = kind, pre, observer
        self.pending, self.factors, self.oracle = [], [], []

    def before_step(self):
        if self.kind == "mkor":
            self.pending.append(_clone_pairs(self.pre.pending_vectors()))
        if self.observer is not None:
            self.oracle.append(self.observer.step())

    def after_step(self):
        self.factors.append(statistics_of(self.pre))
        if self.kind == "kfac":
            self.pending.append(self.factors[-1])


def run(case, feature, kind, batches, *, seed=0, dtype=f64, micro=1, per_sample=False,
        observe=False, pre_kwargs=None, compile_kwargs=None, lora_rank=2, timer=None):
    """Train ``case`` (a :class:`Case` or its name) on ``batches`` (one optimizer step each)
    with preconditioner ``kind`` under loop ``feature``; returns a :class:`Result`.

    Features: "plain" (forward, backward, step, zero_grad), "padding" (the same loop: the
    batches carry the padding),
    "ckpt_reentrant" / "ckpt_nonreentrant" (the case's gradient checkpointing),
    "compile" (``torch.compile(model)``; the preconditioner hooks the original model),
    "lora" (peft LoRA on ``case.lora_targets``, random A and B, dropout 0; the preconditioner
    sees the adapted model), "accelerate" (``Accelerator(gradient_accumulation_steps=micro)``
    around model and preconditioner, each batch split in ``micro`` micro-batches),
    "lightning_bf16" (a LightningModule trained by ``pl.Trainer(precision="bf16-mixed")``),
    "autocast_bf16" (the hand-written loop with the forward under
    ``torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)``, the context
    Lightning's bf16-mixed plugin enters: Lightning's reference). ``micro`` > 1 with "plain"
    accumulates loss / micro over micro-batches by hand. ``per_sample`` applies the case's
    ``per_sample`` (ResNet: BatchNorm in eval mode) for runs that split batches, and for their
    references. ``observe`` attaches an :class:`Observer`. ``timer`` (a list) receives each
    step's wall time.
    """
    case = CASES[case] if isinstance(case, str) else case
    model = case.build(seed=seed, dtype=dtype)
    if per_sample and case.per_sample is not None:
        case.per_sample(model)
    if feature in ("ckpt_reentrant", "ckpt_nonreentrant"):
        case.checkpointing(model, feature == "ckpt_reentrant")
    if feature == "lora":
        from peft import LoraConfig, get_peft_model
        targets = case.lora_targets
        config = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0,
                            init_lora_weights=False, bias="none",
                            target_modules=targets[0] if len(targets) == 1 and "*" in targets[0]
                            else list(targets), **dict(case.lora_kwargs))
        with warnings.catch_warnings():  # peft reads transformers' deprecated property
            warnings.filterwarnings("ignore", category=FutureWarning,
                                    message=".*gradient_checkpointing.*deprecated")
            model = get_peft_model(model, config)
    init = snapshot(model)
    pre = make_preconditioner(kind, model, **(pre_kwargs or {}))
    observer = (Observer(model, pre.preconditioned_modules, case, kind)
                if observe else None)
    rec = _Recorder(kind, pre, observer)

    if feature == "lightning_bf16":
        _lightning_bf16(model, pre, batches, rec, timer)
    elif feature == "accelerate":
        from accelerate import Accelerator
        acc = Accelerator(cpu=True, gradient_accumulation_steps=micro)
        model_p, pre_p = acc.prepare(model, pre)
        for batch in batches:
            t0 = time.perf_counter()
            for part in _split(batch, micro):
                with acc.accumulate(model_p):
                    if observer is not None:
                        observer.batch = part
                    acc.backward(model_p(**part).loss)
                    if acc.sync_gradients:
                        rec.before_step()
                    pre_p.step()
                    pre_p.zero_grad()
            rec.after_step()
            if timer is not None:
                timer.append(time.perf_counter() - t0)
    else:
        forward = model
        if feature == "compile":
            forward = torch.compile(model, **(compile_kwargs or {}))
        autocast = (torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)
                    if feature == "autocast_bf16" else contextlib.nullcontext())
        for batch in batches:
            t0 = time.perf_counter()
            for part in _split(batch, micro):
                if observer is not None:
                    observer.batch = part
                with autocast:
                    loss = forward(**part).loss
                (loss / micro).backward()
            rec.before_step()
            pre.step()
            pre.zero_grad()
            rec.after_step()
            if timer is not None:
                timer.append(time.perf_counter() - t0)
    if observer is not None:
        observer.remove()
    return Result(kind, snapshot(model), init, rec.pending, rec.factors, rec.oracle,
                  list(pre.preconditioned_modules), pre, model,
                  None if observer is None else set(observer.unmatched))


def _lightning_bf16(model, pre, batches, rec, timer):
    """``pl.Trainer(precision="bf16-mixed")`` on CPU, one step per batch. Lightning runs the
    training step under ``torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)``,
    calls ``zero_grad`` inside its closure (between forward and backward) and the closure
    inside ``pre.step``."""
    import pytorch_lightning as pl

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            self._t0 = time.perf_counter()
            if rec.observer is not None:
                rec.observer.batch = batch
            return self.model(**batch).loss

        def configure_optimizers(self):
            return pre

        def on_before_optimizer_step(self, optimizer):
            rec.before_step()

        def on_train_batch_end(self, outputs, batch, batch_idx):
            rec.after_step()
            if timer is not None:
                timer.append(time.perf_counter() - self._t0)

    trainer = pl.Trainer(max_steps=len(batches), accelerator="cpu", devices=1,
                         precision="bf16-mixed", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)
    quiet = logging.getLogger("pytorch_lightning")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Lit(), loader)
    finally:
        quiet.setLevel(level)


# -- distributed ------------------------------------------------------------------------------
def ddp_job(rank, world, case_name, kinds, steps, micro, model_fn=None, batch_fn=None):
    """One gloo rank of a DDP cell: each step, this rank's 1/world share of the global batch
    ``batch_fn(t)`` (default: the case's, ``world * micro * 2`` rows) in ``micro``
    micro-batches of loss / micro, all but the last under ``ddp.no_sync()``; then the
    preconditioner's step. ``DistributedDataParallel(find_unused_parameters=True)``: an expert
    without tokens on a rank has no gradient there. Runs every kind in ``kinds`` (a model
    each, built by ``model_fn(seed=0, dtype=f64)`` or the case's); returns per kind
    {params, factors (per step), counters (or the error reading them), expert_rows}."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    case = CASES.get(case_name)
    batch_fn = batch_fn or (lambda t: case.batch(t, size=world * micro * 2))
    out = {}
    for kind in kinds:
        model = (model_fn or case.build)(seed=0, dtype=f64)
        if case is not None and case.per_sample is not None:
            case.per_sample(model)
        experts = ExpertRows(model)
        ddp = DDP(model, find_unused_parameters=True)
        pre = make_preconditioner(kind, ddp)
        factors = []
        for t in range(steps):
            experts.step = t
            parts = _split(_split(batch_fn(t), world)[rank], micro)
            for i, part in enumerate(parts):
                with contextlib.nullcontext() if i == micro - 1 else ddp.no_sync():
                    (ddp(**part).loss / micro).backward()
            pre.step()
            pre.zero_grad()
            factors.append(statistics_of(pre))
        experts.remove()
        try:
            counters = counters_of(pre)
        except Exception as exc:  # noqa: BLE001 -- reported, asserted in the parent
            counters = f"{type(exc).__name__}: {exc}"
        out[kind] = {"params": snapshot(model), "factors": factors, "counters": counters,
                     "expert_rows": experts.rows}
    return out


# -- comparisons ------------------------------------------------------------------------------
def _worst_pairs(a, b, error):
    """max of ``error(x, y)`` over the tensors of two {name: (x, y)} dicts (inf if the names,
    a missing pair or the None-pattern differ)."""
    if set(a) != set(b):
        return math.inf
    worst = 0.0
    for name in a:
        if a[name] is None or b[name] is None:
            return math.inf
        for x, y in zip(a[name], b[name]):
            if (x is None) != (y is None):
                return math.inf
            if x is not None:
                worst = max(worst, error(x.double(), y.double()))
    return worst


def max_abs_pairs(a, b):
    """max |x - y| over the tensors of two {name: (x, y)} dicts."""
    return _worst_pairs(a, b, lambda x, y: float((x - y).abs().max()))


def max_rel_pairs(a, b):
    """max over entries of |x - y| / max(1, max|y|) per tensor, over two {name: (x, y)}
    dicts."""
    return _worst_pairs(a, b, lambda x, y: float((x - y).abs().max())
                        / max(1.0, float(y.abs().max())))


def compare(res, ref):
    """Numbers for the table: ``param_rel`` (hf_cases.update_rel_err: the largest parameter
    difference relative to the largest parameter change of the reference), ``params_equal``
    (bit-identical), ``stat_abs`` (max |difference| of the statistics over every step: MKOR's
    a_bar / g_bar, K-FAC's A / G), ``stats_equal``, ``factor_rel`` (factors after every step,
    relative to max(1, max|entry|) of each)."""
    from hf_cases import update_rel_err
    res_params = res["params"] if isinstance(res, dict) else res.params
    ref_params = ref["params"] if isinstance(ref, dict) else ref.params
    init = ref.init if not isinstance(ref, dict) else ref["init"]
    out = {"param_rel": update_rel_err(res_params, ref_params, init),
           "params_equal": all(torch.equal(res_params[n], ref_params[n]) for n in ref_params)}
    res_f = res["factors"] if isinstance(res, dict) else res.factors
    ref_f = ref["factors"] if isinstance(ref, dict) else ref.factors
    out["factor_rel"] = max((max_rel_pairs(x, y) for x, y in zip(res_f, ref_f)), default=0.0)
    if len(res_f) != len(ref_f):
        out["factor_rel"] = math.inf
    if not isinstance(res, dict) and not isinstance(ref, dict):
        stats = [max_abs_pairs(x, y) for x, y in zip(res.statistics(), ref.statistics())]
        out["stat_abs"] = max(stats, default=0.0)
        out["stats_equal"] = out["stat_abs"] == 0.0 and len(res.statistics()) == len(
            ref.statistics())
    out["factors_equal"] = out["factor_rel"] == 0.0
    return out


def describe(numbers):
    return ", ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in numbers.items())

