"""Tiny transformers models (random weights, built offline from small configs) and
batches shared by the Hugging Face / training-loop tests of MKOR and K-FAC.

Every model is built with dropout off, so two runs from the same seed see the same
function and a difference between runs can only come from the optimizer under test.
"""
import torch
import torch.nn as nn

from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel,
                          ResNetConfig, ResNetForImageClassification)
from transformers.pytorch_utils import Conv1D

from torch_impl.baselines import KFAC

from torch_impl.mkor import MKOR

VOCAB = 100
SEQ = 8

__all__ = ["VOCAB", "SEQ", "Conv1D", "tiny_gpt2", "tiny_bert", "tiny_resnet", "lm_batch",
           "image_batch", "snapshot", "max_rel_err", "update_rel_err", "is_identity", "linears",
           "PRECONDITIONERS", "wrap", "factors_of", "equal_factors"]


def tiny_gpt2(seed=0, dtype=torch.float64, n_layer=2, vocab=VOCAB, tie=True):
    """GPT2LMHeadModel, n_embd 32, 2 heads, dropout 0, ``lm_head`` tied to ``wte``."""
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab, n_embd=32, n_layer=n_layer, n_head=2, n_positions=32,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0, pad_token_id=0,
                     tie_word_embeddings=tie)
    return GPT2LMHeadModel(cfg).to(dtype).train()


def tiny_bert(seed=0, dtype=torch.float64):
    """BertForMaskedLM, hidden 32, 2 layers, 2 heads, intermediate 64, dropout 0 (decoder
    tied to the word embeddings)."""
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
    return BertForMaskedLM(cfg).to(dtype).train()


def tiny_resnet(seed=0, num_labels=10):
    torch.manual_seed(seed)
    cfg = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_channels=3,
                       num_labels=num_labels)
    return ResNetForImageClassification(cfg).train()


def lm_batch(seed, batch=4, seq=SEQ, lengths=None, pad_seed=None, dtype_mask=torch.long):
    """{input_ids, attention_mask, labels} of random tokens. ``lengths``: real tokens per
    row (right padding after them: attention_mask 0, labels -100); the padded positions'
    ids are drawn from ``pad_seed`` (default: the same stream), so two batches with the same
    ``seed`` and different ``pad_seed`` differ only where the mask is 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=dtype_mask)
    if lengths is not None:
        for row, n in enumerate(lengths):
            mask[row, n:] = 0
        gp = torch.Generator().manual_seed(1000 + (seed if pad_seed is None else pad_seed))
        pads = torch.randint(1, VOCAB, (batch, seq), generator=gp)
        ids = torch.where(mask.bool(), ids, pads)
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def image_batch(seed, batch=4, num_labels=10):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 3, 32, 32, generator=g),
            torch.randint(0, num_labels, (batch,), generator=g))


def snapshot(model):
    """{name: detached clone} of every parameter."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_rel_err(a, b):
    """max over tensors of ||a - b||_max / max(||b||_max, tiny) (dicts or lists)."""
    pairs = zip(a.values(), b.values()) if isinstance(a, dict) else zip(a, b)
    worst = 0.0
    for x, y in pairs:
        den = y.abs().max().clamp_min(1e-300)
        worst = max(worst, float((x - y).abs().max() / den))
    return worst


def update_rel_err(a, b, init):
    """max_n ||a_n - b_n||_max / max_n ||b_n - init_n||_max: the difference of two runs'
    parameters relative to the largest entry any parameter moved. (Per-tensor relative
    errors are meaningless for parameters that stay at rounding level, e.g. BERT's key
    biases: softmax is invariant to them, so their exact gradient is 0.)"""
    diff = max(float((a[n] - b[n]).abs().max()) for n in a)
    moved = max(float((b[n] - init[n]).abs().max()) for n in a)
    return diff / moved


def is_identity(J):
    return J is None or torch.equal(J, torch.eye(J.shape[0], dtype=J.dtype))


def linears(model):
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


PRECONDITIONERS = {"mkor": MKOR, "kfac": KFAC}


def wrap(kind, model, lr=0.05, inv_freq=1, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return PRECONDITIONERS[kind](model, opt, inv_freq=inv_freq, **kwargs)


def factors_of(pre):
    """The preconditioner's statistics: MKOR's inverse factors, K-FAC's factor EMAs."""
    raw = pre.inverse_factors() if isinstance(pre, MKOR) else pre.factors()
    return {n: tuple(None if t is None else t.clone() for t in pair) for n, pair in raw.items()}


def equal_factors(a, b):
    return a.keys() == b.keys() and all(
        (x is None and y is None) or torch.equal(x, y)
        for n in a for x, y in zip(a[n], b[n]))
