r"""Which token mask a layer's rows get, from where the layer sits (never from a shape).

A preconditioned layer whose rows are tokens must leave padded positions out of its
statistics. The mask that applies is a property of the layer's place in the model:

* an encoder-only or decoder-only model (BERT, GPT-2, Llama, ...): every layer reads the
  model's ``token_mask`` keyword (``attention_mask`` by default): source ``"tokens"``;
* an encoder-decoder model (``config.is_encoder_decoder`` with ``get_encoder()`` /
  ``get_decoder()``, e.g. T5, BART): layers inside the encoder read the encoder's
  ``attention_mask`` (source ``"encoder"``); layers inside the decoder read the decoder's
  mask (source ``"decoder"``: ``decoder_attention_mask``, or ``labels != -100`` when only
  labels say which decoder positions are real), except a decoder layer whose input *is*
  the encoder's output tensor (the keys and values of cross-attention), which reads the
  encoder's mask. That last test is by storage (the same memory as the encoder's output),
  so it also holds for the detached copy a reentrant checkpoint recomputes from.

The masks of one forward call of the model are kept in a :class:`CallContext`, made by
the model's forward pre-hook and looked up again when a checkpoint recomputes part of
that call during the backward pass (:mod:`.capture`). A layer whose rows do not have its
mask's leading shape (a pooler's (B, d) rows under a (B, T) mask, an MoE expert's routed
rows), or whose source has no mask in a call that has others, uses all its rows and is
reported with the reason (``unmasked_reasons`` of the preconditioner).
"""
import torch

__all__ = ["CallContext", "mask_sources", "storage_key"]


def storage_key(x):
    """Identifies the memory a tensor views: equal for a tensor and its ``detach()``."""
    return (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.stride())


def _as_bool(mask):
    return mask if mask.dtype == torch.bool else mask != 0


def _two_d(value):
    return value if isinstance(value, torch.Tensor) and value.dim() == 2 else None


class CallContext:
    """The token masks of one forward call of the model, by source, and the storage key of
    the encoder's output (set when the encoder returns)."""

    __slots__ = ("masks", "encoder_out", "with_grad", "regions", "nested")

    def __init__(self, masks):
        self.masks = masks
        self.encoder_out = None
        self.with_grad = True   # the call ran with grad enabled
        self.regions = False    # a hooked layer ran without grad inside it (reentrant)
        self.nested = False     # ... inside one of its recomputes (a nested region)

    @classmethod
    def from_call(cls, kwargs, mask_kwarg, encoder_decoder):
        """The masks a call's keywords give: ``mask_kwarg`` (tokens, or the encoder's), and
        for an encoder-decoder model the decoder's (``decoder_attention_mask``, else
        ``labels != -100``)."""
        masks = {}
        main = _two_d(kwargs.get(mask_kwarg)) if mask_kwarg else None
        if main is not None:
            masks["encoder" if encoder_decoder else "tokens"] = _as_bool(main)
        if encoder_decoder:
            decoder = _two_d(kwargs.get("decoder_attention_mask"))
            labels = _two_d(kwargs.get("labels"))
            if decoder is not None:
                masks["decoder"] = _as_bool(decoder)
            elif labels is not None:
                masks["decoder"] = labels != -100
        return cls(masks)

    @classmethod
    def explicit(cls, mask):
        """A mask set by hand (``masked(mask)``): every source reads it."""
        mask = _as_bool(mask)
        return cls({"tokens": mask, "encoder": mask, "decoder": mask})

    def source_of(self, layer_source, x):
        """The source a layer reads in this call: a decoder layer fed the encoder's output
        reads the encoder's mask."""
        if (layer_source == "decoder" and self.encoder_out is not None and x is not None
                and storage_key(x) == self.encoder_out):
            return "encoder"
        return layer_source

    def mask_for(self, source, lead):
        """(mask, reason): the mask for rows of leading shape ``lead`` from ``source``, or
        (None, why the rows are all used) when the call has masks but none fits; (None,
        None) when the call has no mask at all."""
        if not self.masks:
            return None, None
        mask = self.masks.get(source)
        if mask is None:
            given = ", ".join(sorted(self.masks))
            return None, (f"the call has a mask for {given} but none for its {source} rows "
                          "(pass decoder_attention_mask or labels)" if source == "decoder"
                          else f"the call has no {source} mask (it has {given})")
        if tuple(lead) != tuple(mask.shape):
            return None, (f"its rows have leading shape {tuple(lead)}, not the {source} "
                          f"mask's {tuple(mask.shape)} (not one row per token)")
        return mask, None


def mask_sources(model, layers):
    """({layer name: source}, encoder module or None) from the model's structure."""
    config = getattr(model, "config", None)
    encoder = decoder = None
    if getattr(config, "is_encoder_decoder", False) and hasattr(model, "get_encoder"):
        encoder = model.get_encoder()
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if encoder is None:
        return {layer.name: "tokens" for layer in layers}, None
    inside_encoder = {id(m) for m in encoder.modules()}
    inside_decoder = {id(m) for m in decoder.modules()} if decoder is not None else set()
    sources = {}
    for layer in layers:
        if id(layer.module) in inside_encoder:
            sources[layer.name] = "encoder"
        elif id(layer.module) in inside_decoder:
            sources[layer.name] = "decoder"
        else:  # e.g. the LM head: it reads the decoder's outputs
            sources[layer.name] = "decoder"
    return sources, encoder
