"""What a layer's rows are, for the composition matrix's independent statistics: a case's
``rows(name)`` returns a :class:`TokenRows` (which mask selects them, in which layout),
:data:`NOT_TOKENS` or :data:`GATHERED`. Each rule is written from the model's documented
structure (which tower, which stack, which layout), never from which dimension matches: a
token layer whose rows do not have the prescribed mask's shape is an error of the rule.
"""
import dataclasses

import torch

ENCODER, DECODER, SHIFTED_DECODER = "attention_mask", "decoder", "shifted decoder"


@dataclasses.dataclass(frozen=True)
class TokenRows:
    """A layer whose rows are the tokens of one stream, laid out (B, T), or (T, B) when
    ``seq_first``. ``ENCODER``: ``attention_mask``. ``DECODER``: ``decoder_attention_mask``,
    else ``labels != -100``. ``SHIFTED_DECODER``: ``decoder_attention_mask``, else the mask
    ``EncoderDecoderModel`` builds itself from labels alone (its decoder's inputs are the
    labels shifted right after the start token, and its mask their non-pad positions: the
    start token and every position after a real label). ``flat``: the (B, T) tokens
    flattened batch-major to (B*T,) rows (an MoE block's ``hidden_states.view(-1, H)``; a
    fused experts module's routed pairs each take their token's entry)."""

    stream: str = ENCODER
    seq_first: bool = False
    only_if_fits: bool = False   # the mask wherever its shape happens to fit, else none
    flat: bool = False


def shape_coincidence(name):
    """The rule issue 29 removed: the top-level call's ``attention_mask``, batch-first,
    wherever its shape fits a layer's rows. On CLIP, XLNet and the EncoderDecoderModel of
    the matrix it fits rows it does not describe (``Case.shape_misleads``)."""
    return TokenRows(ENCODER, only_if_fits=True)


#: Rows that are not tokens of a masked sequence (image patches, pooled per-sample rows).
NOT_TOKENS = "not tokens"
#: Tokens gathered by a router: no (B, T) mask indexes them.
GATHERED = "gathered"
#: One row per sample picked from a masked stream by an index (CLIP's pooled end-of-text
#: token): every row is a real token's, and the capture, which does not follow index ops,
#: lists the layer as unmasked and uses all its rows -- the right rows here.
PICKED = "picked"


def all_tokens(name):
    """Every layer's rows are the (B, T) tokens of the one masked stream."""
    return TokenRows()


def seq2seq_rows(name):
    """Encoder-decoder models (T5, Switch): the encoder's layers and the cross-attention's keys
    and values read encoder tokens; everything else reads decoder tokens."""
    if name.startswith("encoder.") or ".EncDecAttention.k" in name or (
            ".EncDecAttention.v" in name):
        return TokenRows(ENCODER)
    return TokenRows(DECODER)


def switch_rows(name):
    """Switch Transformers: T5's streams, and the experts' rows are the tokens the router
    sent them."""
    return GATHERED if ".experts.expert_" in name else seq2seq_rows(name)


def default_loss(model, batch, per_sample=False):
    """How the matrix calls a transformers model: ``model(**batch).loss``."""
    return model(**batch).loss


def _unwrapped(name):
    """A layer's name in the model peft wrapped (``base_model.model.`` removed)."""
    return name.removeprefix("base_model.model.")


def _decoder_mask(batch, shifted=False):
    if "decoder_attention_mask" in batch:
        return batch["decoder_attention_mask"].bool()
    real = batch["labels"] != -100
    if shifted:
        return torch.cat([torch.ones_like(real[:, :1]), real[:, :-1]], dim=1)
    return real


def token_mask(rule, batch, name, lead):
    """The mask that selects layer ``name``'s rows of leading shape ``lead`` in ``batch`` by
    ``rule`` (a case's ``rows``), or None where its rows are not tokens of a masked stream
    (:data:`NOT_TOKENS`, :data:`GATHERED`, a batch without a mask). A token layer whose rows
    do not have the prescribed mask's shape raises: the rule is wrong, and a mask that merely
    fits would be a coincidence."""
    rows = rule(_unwrapped(name))
    if not isinstance(rows, TokenRows) or "attention_mask" not in batch:
        return None
    if rows.stream == ENCODER:
        mask = batch["attention_mask"].bool()
    else:
        mask = _decoder_mask(batch, shifted=rows.stream == SHIFTED_DECODER)
    mask = mask.T if rows.seq_first else mask
    mask = mask.reshape(-1) if rows.flat else mask
    if tuple(lead) != tuple(mask.shape):
        if rows.only_if_fits:
            return None
        raise AssertionError(f"{name}: rows {tuple(lead)} are not {rows} "
                             f"(mask {tuple(mask.shape)})")
    return mask


def listed_unmasked(rule, name):
    """Whether the capture must list token layer ``name`` in ``unmasked_reasons``: its rows
    are tokens no (B, T) mask indexes (:data:`GATHERED`, :data:`PICKED`)."""
    return rule(_unwrapped(name)) in (GATHERED, PICKED)
