r"""Where token masks enter a model, and the call they belong to (never a shape).

A token mask (B, T) comes with the tensors it describes. It *enters* the model at a module
whose forward takes the mask parameter (``token_mask``, ``attention_mask`` by default): the
top-level model, and every module inside it with that parameter (BERT inside a user's
wrapper fed a dict batch, each tower of CLIP, the encoder and decoder stacks of T5). Each
such call is bound to its forward's signature, so a mask passed by position is a mask, and
its 2-D mask tags the call's token inputs for :mod:`.row_provenance`, which follows them
through the model's operations to every layer's rows:

* the inputs a mask describes are the call's ``input_ids``, ``inputs_embeds``,
  ``token_type_ids`` and ``position_ids`` (transformers' convention) when its forward has
  any of them; a forward with none of them (a user's ``forward(x, attention_mask)``) has
  its mask describe every other tensor argument whose first two dimensions are the mask's
  (B, T): the contract of the keyword. A tensor already tagged keeps its tag;
* a forward with ``decoder_attention_mask`` (an encoder-decoder model) also has a decoder
  mask, ``decoder_attention_mask``, else ``labels != -100``; it tags ``decoder_input_ids``
  / ``decoder_inputs_embeds``, and when the model builds the decoder's inputs itself (by
  shifting the labels) the decoder stack (``get_decoder()``) called without a mask of its
  own gets it for its token inputs;
* ``masked(mask)`` gives the mask by hand: it describes the top-level call's tensor
  arguments whose batch and position dimensions are (0, 1), or (1, 0) for a model with
  ``batch_first=False`` (``nn.Transformer*``, ``nn.MultiheadAttention``) or when asked.

The masks of one forward call of the model are kept in a :class:`CallContext`, made by the
model's forward pre-hook and looked up again when a checkpoint recomputes part of that
call during the backward pass (:mod:`.calls`).
"""
import inspect

import torch

from .row_provenance import RowTracker, token_tag

__all__ = ["CallContext", "MaskEntries"]

#: transformers' names of the inputs a call's attention mask describes
TOKEN_INPUTS = ("input_ids", "inputs_embeds", "token_type_ids", "position_ids")
DECODER_INPUTS = ("decoder_input_ids", "decoder_inputs_embeds", "decoder_position_ids")


def _as_bool(mask):
    return mask if mask.dtype == torch.bool else mask != 0


def _two_d(value):
    return value if isinstance(value, torch.Tensor) and value.dim() == 2 else None


class CallContext:
    """One forward call of the model: its masks (by ``src`` number), the row tracker that
    follows them (started by the first mask), and the layouts of the layers that ran
    without grad (the first pass of a reentrant checkpoint, replayed by the recompute)."""

    __slots__ = ("masks", "tracker", "with_grad", "regions", "nested", "replay", "cache",
                 "_ids", "decoder_src", "notes", "decoder_unmasked", "in_forward")

    def __init__(self):
        self.masks = []
        self.tracker = None
        self.with_grad = True   # the call ran with grad enabled
        self.regions = False    # a hooked layer ran without grad inside it (reentrant)
        self.nested = False     # ... inside one of its recomputes (a nested region)
        self.replay = {}        # {layer name: [RowsMask of each grad-free call]}
        self.cache = {}         # rows_mask's layouts, shared by the call's layers
        self._ids = {}          # id(mask) -> src
        self.decoder_src = {}   # id(decoder stack) -> src of the decoder mask for it
        self.notes = []         # masks that could not be tied to an input, and why
        self.decoder_unmasked = set()  # id(decoder stack) of calls that gave it no mask
        self.in_forward = False  # the model's forward is running (the tracker may be entered)

    def add_mask(self, mask):
        """The src number of ``mask`` (a (B, T) tensor, nonzero = real) in this call; the
        row tracker is made with the first mask and entered once the model's forward runs
        (never in a hook dynamo resumes tracing after: :meth:`~.capture.Capture.tracking`)."""
        key = id(mask)
        if key in self._ids and self.masks[self._ids[key]][1] is mask:
            return self._ids[key]
        self.masks.append((_as_bool(mask), mask))
        self._ids[key] = len(self.masks) - 1
        if self.tracker is None:
            self.tracker = RowTracker()
        if self.in_forward:
            self.tracker.enter()
        return len(self.masks) - 1

    def mask(self, src):
        return self.masks[src][0]

    def bool_masks(self):
        return [m for m, _ in self.masks]

    def tag(self, t, src, batch_dim=0, seq_dim=1, name="an input"):
        """Tag ``t`` as indexing mask ``src`` along ``batch_dim`` and ``seq_dim``, after
        checking that those dimensions are the mask's (B, T); a tagged tensor keeps its
        tag."""
        if not isinstance(t, torch.Tensor) or self.tracker.tag_of(t) is not None:
            return
        shape = tuple(self.mask(src).shape)
        if t.dim() < 2 or (t.shape[batch_dim], t.shape[seq_dim]) != shape:
            self.notes.append(f"{name} of shape {tuple(t.shape)} does not have the mask's "
                              f"{shape} at dimensions ({batch_dim}, {seq_dim}): not tagged")
            return
        self.tracker.set_tag(t, token_tag(src, t.dim(), batch_dim, seq_dim, shape))

    def close(self):
        """Leave the row tracker (the model's forward returned)."""
        if self.tracker is not None:
            self.tracker.leave()


class _Entry:
    """A module where masks enter: its forward's signature and what it names."""

    __slots__ = ("signature", "named", "decoder", "decoder_stack")

    def __init__(self, signature, decoder_stack):
        self.signature = signature
        params = signature.parameters
        self.named = [n for n in TOKEN_INPUTS if n in params]
        self.decoder = "decoder_attention_mask" in params
        self.decoder_stack = decoder_stack


def _signature(module):
    try:
        return inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None


def _bound(signature, args, kwargs):
    """{parameter name: value} of one call (``**kwargs`` entries included), or None."""
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError:
        return None
    return _values(signature, bound)


def _values(signature, bound):
    values = dict(bound.arguments)
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD and isinstance(values.get(name), dict):
            values.update(values.pop(name))
    return values


def _decoder_stack(module):
    decoder = getattr(module, "get_decoder", None)
    try:
        stack = decoder() if callable(decoder) else None
    except Exception:  # noqa: BLE001 - a model without a decoder stack
        return None
    return stack if isinstance(stack, torch.nn.Module) else None


class MaskEntries:
    """The modules of ``model`` where masks enter (module docstring), found once from the
    forwards' signatures; :meth:`enter` tags one call's token inputs in its context."""

    def __init__(self, model, mask_kwarg):
        self.mask_kwarg = mask_kwarg
        self.entries = {}
        if mask_kwarg is None:
            return
        decoder_stacks = set()
        for module in model.modules():
            signature = _signature(module)
            if signature is None:
                continue
            if mask_kwarg in signature.parameters or module is model:
                self.entries[id(module)] = (module, _Entry(signature, False))
            if "decoder_attention_mask" in signature.parameters:
                decoder = _decoder_stack(module)
                if decoder is not None:
                    decoder_stacks.add(id(decoder))
        for module, entry in self.entries.values():
            entry.decoder_stack = id(module) in decoder_stacks

    def modules(self):
        return [module for module, _ in self.entries.values()]

    def enter(self, ctx, module, args, kwargs):
        """A call of an entry module inside ``ctx``: its masks tag its token inputs.
        Returns None, or (args, kwargs) to call the module with instead: a token input
        tagged by another call's mask gets a fresh alias here (below)."""
        found = self.entries.get(id(module))
        if found is None:
            return None
        entry = found[1]
        try:
            bound = entry.signature.bind_partial(*args, **kwargs)
        except TypeError:
            return None
        values = _values(entry.signature, bound)
        mask = _two_d(values.get(self.mask_kwarg))
        src = None
        if mask is not None:
            src = ctx.add_mask(mask)
        elif entry.decoder_stack and id(module) in ctx.decoder_src:
            src = ctx.decoder_src[id(module)]  # the decoder stack of a call that has its mask
        replaced = (self._own_inputs(ctx, entry, bound, src, args, kwargs)
                    if ctx.tracker is not None else None)
        if replaced is not None:
            values = _bound(entry.signature, *replaced)
        if src is not None:
            self._tag_inputs(ctx, entry, values, src, TOKEN_INPUTS)
        if entry.decoder:
            dec = _two_d(values.get("decoder_attention_mask"))
            if dec is None:
                labels = _two_d(values.get("labels"))
                dec = labels != -100 if labels is not None else None
            stack = _decoder_stack(module)
            if dec is None and stack is not None:
                ctx.decoder_unmasked.add(id(stack))
            if dec is not None:
                dec_src = ctx.add_mask(dec)
                for name in DECODER_INPUTS:
                    if name in values:
                        ctx.tag(values[name], dec_src, name=name)
                if stack is not None:
                    ctx.decoder_src[id(stack)] = dec_src
        return replaced

    def _own_inputs(self, ctx, entry, bound, src, args, kwargs):
        """A mask describes the token inputs *of the model it is given to*: a model's
        ``input_ids`` / ``inputs_embeds`` that already carry another mask's tag (the same
        ids passed to an encoder with its mask and to a decoder without one, or to an inner
        model called without the mask) are replaced, for this call, by an alias without it
        (``view_as``: the same memory and autograd history). Returns the new binding, or
        None when nothing needed replacing."""
        given = bound.arguments.get(self.mask_kwarg)
        if "input_ids" not in entry.named or (isinstance(given, torch.Tensor) and src is None):
            return None  # not a model taking tokens, or a mask it got in another form
        names = [n for n in ("input_ids", "inputs_embeds") if n in entry.named]
        changed = False
        for name in names:
            value = bound.arguments.get(name)
            if not isinstance(value, torch.Tensor) or name == self.mask_kwarg:
                continue
            tag = ctx.tracker.tag_of(value)
            if tag is None:
                continue
            srcs = {a[1] for e in tag if e is not None for a in e
                    if a[0] == "t" and a[2] == 1}  # the masks of its positions
            if srcs and srcs != {src}:
                alias = value.view_as(value)
                ctx.tracker.set_tag(alias, None)
                if name in kwargs:
                    kwargs = dict(kwargs, **{name: alias})
                else:
                    position = list(entry.signature.parameters).index(name)
                    args = args[:position] + (alias,) + args[position + 1:]
                changed = True
        return (args, kwargs) if changed else None

    def _tag_inputs(self, ctx, entry, values, src, names):
        if entry.named:
            for name in entry.named:
                if isinstance(values.get(name), torch.Tensor):
                    ctx.tag(values[name], src, name=name)
            return
        mask = ctx.mask(src)
        for name, value in values.items():
            if name == self.mask_kwarg or not isinstance(value, torch.Tensor):
                continue
            if value is mask or value.dim() < 2 or tuple(value.shape[:2]) != tuple(mask.shape):
                continue
            ctx.tag(value, src, name=name)


def _batch_first(model):
    """The layout a model documents for its inputs: its own ``batch_first`` flag, or for
    torch's transformer modules (which pass theirs to their attention) their attention's;
    else batch-first."""
    flag = getattr(model, "batch_first", None)
    if isinstance(flag, bool):
        return flag
    if type(model).__module__.startswith("torch.nn.modules.transformer"):
        for module in model.modules():
            if isinstance(module, torch.nn.MultiheadAttention):
                return module.batch_first
    return True


def tag_explicit(ctx, mask, model, args, kwargs, batch_first=None):
    """``masked(mask)``: the mask describes the top-level call's tensor arguments (one level
    into lists, tuples and dicts) whose (batch, position) dimensions are the mask's; the
    layout is (0, 1), or (1, 0) when ``batch_first`` is False (default: the model's own
    ``batch_first`` attribute, else True)."""
    if batch_first is None:
        batch_first = _batch_first(model)
    dims = (0, 1) if batch_first else (1, 0)
    src = ctx.add_mask(mask)
    shape = tuple(ctx.mask(src).shape)
    values = list(args) + list(kwargs.values())
    flat = []
    for v in values:
        if isinstance(v, (list, tuple)):
            flat.extend(v)
        elif isinstance(v, dict):
            flat.extend(v.values())
        else:
            flat.append(v)
    for v in flat:
        if isinstance(v, torch.Tensor) and v is not mask and v.dim() >= 2 and (
                v.shape[dims[0]], v.shape[dims[1]]) == shape:
            ctx.tag(v, src, *dims, name="an argument")
    return src
