"""The composition matrix's rows of issue 29: models on which a mask found by how the model
was called, or by which dimension happens to match, trains wrongly in silence.

* :func:`tiny_clip`: ``CLIPModel``, two towers. The text is as long as the vision tower has
  tokens (2 x 2 patches + the class token = 5), so the text mask has the vision rows' shape
  and must not reach them.
* :func:`tiny_xlnet`: ``XLNetLMHeadModel`` transposes its inputs: its feed-forward rows are
  laid out (T, B). Its batches have B = T = 4, so the (B, T) mask fits them transposed.
* :func:`tiny_encdec`: ``EncoderDecoderModel`` (BERT -> BERT of another width): the encoder's
  output reaches the cross-attention through ``enc_to_dec_proj``; encoder and decoder are
  both 8 long, so the decoder's mask fits the cross-attention keys and values.
* :class:`BertWrapper`: a user's module holding a ``BertModel``, called with the whole dict
  batch (``model(batch)``): the mask enters the inner model, not the top-level call.
* the positional call: ``BertForMaskedLM`` called ``model(input_ids, attention_mask,
  labels=...)`` (:func:`positional_loss`).

Each model has a loss function ``loss(model, batch, per_sample)`` (how the matrix calls it)
and a rule saying what each layer's rows are (:mod:`composition_rows`), written from the
model's documented structure, never from shapes.
"""
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import (BertConfig, BertModel, CLIPConfig, CLIPModel, EncoderDecoderConfig,
                          EncoderDecoderModel, XLNetConfig, XLNetLMHeadModel)
from transformers.modeling_outputs import CausalLMOutput

from theory_tests.support.composition_rows import (ENCODER, NOT_TOKENS, PICKED, SHIFTED_DECODER,
                                                   TokenRows)
from theory_tests.support.hf_cases import VOCAB, lm_batch

f64 = torch.float64

# -- CLIP: two towers --------------------------------------------------------------------------
CLIP_SEQ = 5                       # = the vision tower's tokens: 2 x 2 patches + class token
CLIP_LENGTHS = [5, 3, 2, 4]
CLIP_EOS = 3                       # not 2: transformers' legacy argmax pooling reads id 2


def tiny_clip(seed=0, dtype=f64):
    """CLIPModel: text and vision towers of hidden 32, 2 layers, 2 heads; 8 x 8 images in
    4 x 4 patches; projection 16. The text's pooled row is its first ``CLIP_EOS`` token."""
    torch.manual_seed(seed)
    config = CLIPConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=8,
                         eos_token_id=CLIP_EOS, pad_token_id=1, bos_token_id=0,
                         attention_dropout=0.0),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=8, patch_size=4,
                           attention_dropout=0.0),
        projection_dim=16)
    return CLIPModel(config).to(dtype).train()


def clip_batch(t, size=4, padded=False, pad_seed=0, dtype=f64):
    """{input_ids, attention_mask, pixel_values}: random text (ids >= 4) of ``CLIP_SEQ``
    tokens, right-padded to ``CLIP_LENGTHS`` when ``padded``, each row's last real token
    ``CLIP_EOS`` (the pooled row), and 8 x 8 images."""
    lengths = (CLIP_LENGTHS * 2)[:size] if padded else [CLIP_SEQ] * size
    batch = lm_batch(t, batch=size, seq=CLIP_SEQ, lengths=lengths, pad_seed=pad_seed + t)
    ids = batch["input_ids"] % (VOCAB - 4) + 4
    ids[torch.arange(size), torch.tensor(lengths) - 1] = CLIP_EOS
    g = torch.Generator().manual_seed(700 + t)
    return {"input_ids": ids, "attention_mask": batch["attention_mask"],
            "pixel_values": torch.randn(size, 3, 8, 8, generator=g).to(dtype)}


def clip_loss(model, batch, per_sample=False):
    """CLIP's contrastive loss; ``per_sample``: minus the mean matching-pair logit, a mean
    over samples (the contrastive loss of a half batch is not half of the batch's, so the
    runs that split a batch -- accelerate, DDP -- and their references use this one)."""
    if not per_sample:
        return model(**batch, return_loss=True).loss
    return -model(**batch).logits_per_text.diagonal().mean()


def clip_rows(name):
    """The text tower's rows are text tokens; the vision tower's are image patches, its
    projection reads the class token (a select: one row per sample); the text projection
    reads each row's end-of-text token, picked by an index."""
    if name.startswith("text_model."):
        return TokenRows(ENCODER)
    return PICKED if name == "text_projection" else NOT_TOKENS


# -- XLNet: sequence-first rows ----------------------------------------------------------------
XLNET_SEQ = 4                      # = the matrix's batch of 4: B = T
XLNET_LENGTHS = [4, 2, 3, 1]


def tiny_xlnet(seed=0, dtype=f64):
    """XLNetLMHeadModel, d_model 32, 2 layers, 2 heads, inner 64; its attention projections
    are einsum parameters (not layers), its head is tied to the embedding (skipped): the
    preconditioned layers are the feed-forward Linears."""
    torch.manual_seed(seed)
    config = XLNetConfig(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=2, d_inner=64,
                         dropout=0.0, pad_token_id=0)
    return XLNetLMHeadModel(config).to(dtype).train()


def xlnet_batch(t, size=4, padded=False, pad_seed=0, dtype=f64):
    lengths = (XLNET_LENGTHS * 2)[:size] if padded else None
    return lm_batch(t, batch=size, seq=XLNET_SEQ, lengths=lengths, pad_seed=pad_seed + t)


def xlnet_rows(name):
    """XLNetModel transposes ``input_ids`` to (T, B) and its layers keep that layout."""
    return TokenRows(ENCODER, seq_first=".ff." in name)


# -- EncoderDecoderModel with a projection -----------------------------------------------------
def tiny_encdec(seed=0, dtype=f64):
    """EncoderDecoderModel: a BERT encoder of hidden 32 and a BERT decoder (cross-attention)
    of hidden 16, so the encoder's output reaches the cross-attention through the Linear
    ``enc_to_dec_proj``; 1 layer each, pad id 0, decoder start id 1 (not the pad id: from
    labels alone the model masks its decoder's inputs where they equal the pad id, and a
    start token equal to it would mask out position 0, a real row)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, num_hidden_layers=1, num_attention_heads=2,
                  max_position_embeddings=32, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, pad_token_id=0)
    encoder = BertConfig(hidden_size=32, intermediate_size=64, **common)
    decoder = BertConfig(hidden_size=16, intermediate_size=32, is_decoder=True,
                         add_cross_attention=True, **common)
    config = EncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id = 1, 0
    return EncoderDecoderModel(config=config).to(dtype).train()


def encdec_loss(model, batch, per_sample=False):
    """``model(**batch).loss``; transformers warns at every call given both labels and
    ``decoder_input_ids`` that it no longer needs the latter (silenced)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning,
                                message=".*introduces a better way to train encoder-decoder")
        return model(**batch).loss


def encdec_rows(name):
    """The encoder, its projection and the cross-attention's keys / values read encoder
    tokens, the encoder's pooler its class token (unused: no gradient); the decoder's other
    layers (its tied head is skipped) read decoder tokens, masked as the model masks them
    (``SHIFTED_DECODER``)."""
    if name.startswith("encoder.pooler."):
        return NOT_TOKENS
    if name.startswith("encoder.") or name == "enc_to_dec_proj" or (
            ".crossattention.self.key" in name or ".crossattention.self.value" in name):
        return TokenRows(ENCODER)
    return TokenRows(SHIFTED_DECODER)


# -- a wrapper fed a dict batch ----------------------------------------------------------------
class BertWrapper(nn.Module):
    """A user's module: a ``BertModel`` (hidden 32, 2 layers, no pooler) and an untied
    Linear head over the vocabulary, called with the whole batch as one dict; returns an
    object with ``.loss`` (the mean token cross-entropy, -100 ignored)."""

    def __init__(self):
        super().__init__()
        self.encoder = BertModel(BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, pad_token_id=0), add_pooling_layer=False)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, batch):
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
        logits = self.head(self.encoder(**inputs).last_hidden_state)
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                               ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)


def tiny_bert_wrapper(seed=0, dtype=f64):
    torch.manual_seed(seed)
    return BertWrapper().to(dtype).train()


def wrapper_loss(model, batch, per_sample=False):
    return model(batch).loss


# -- the positional call -----------------------------------------------------------------------
def positional_loss(model, batch, per_sample=False):
    """``model(input_ids, attention_mask, labels=...)``: the mask passed by position."""
    return model(batch["input_ids"], batch["attention_mask"], labels=batch["labels"]).loss
