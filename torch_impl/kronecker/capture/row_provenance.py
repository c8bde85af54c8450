r"""Which token each row of a layer belongs to, followed from the model's own operations.

A token mask M (B, T) says which positions of the tensors it came with are real. A layer's
rows are some tensor deep inside the model: BERT's are (B, T) like the mask, XLNet's and
``nn.TransformerEncoderLayer(batch_first=False)``'s are (T, B), an MoE expert's are tokens
gathered by a router, a pooler's are one per sample, a vision tower's come from pixels no
mask describes, cross-attention keys and values come from the *encoder's* tokens through
any projection. None of that can be read off a shape (B may equal T; two towers may have
the same length). So the layout is followed from where the rows come: while a call with
masks runs (only on a step that captures statistics), :class:`RowTracker`, a
``TorchDispatchMode``, sees every ATen operation and carries, for each tensor dimension,
which positions of which mask it indexes.

**Tags.** A tensor's tag is one entry per dimension: ``None`` (indexes nothing of a mask)
or a tuple of *atoms*, row-major, whose lengths multiply to the dimension's size (a view
that merges (B, T) into B*T rows keeps both atoms in one dimension, and a view that splits
them again gets them back):

* ``("t", src, axis, start, step, length)``: positions ``start + step * i`` of axis
  ``axis`` (0: batch, 1: positions) of mask number ``src`` (for the batch axis, ``src`` is
  :func:`batch_key` (B): every mask of a call with B rows indexes the same samples);
* ``("f", length)``: a stretch that indexes nothing (a head dimension merged with the batch);
* ``("x", reason, length)``: lost: an operation the tracker cannot follow (advanced
  indexing, a sort, a concatenation along the tokens) produced it.

**Rules** (each exact for the operation it covers): views and copies (``view``, ``permute``,
``transpose``, ``expand``, ``slice``, ``select``, ``split``, ``clone``, casts) move the atoms
with the dimensions; pointwise operations (``torch.Tag.pointwise``) keep each output
position's tag, broadcasting from the right, and two operands that disagree on a
dimension lose it; matrix products keep the rows of the left operand, the columns of the
right and the batch of both; ``embedding`` gives the indices' tags; normalisation, softmax,
dropout, attention kernels (the query's tags) and recurrent layers keep them; a reduction
drops the dimension; a ``select`` keeps the picked position as a length-1 stretch (a
``stack`` of evenly spaced picks, a loop over time steps, gets the axis back). Every other operation that touches a tagged tensor
marks its outputs lost, with its name as the reason. Nothing is ever inferred from a shape.

:func:`rows_mask` turns the tags of a layer's rows into the rows' mask (or says why there is
none): every mask axis exactly once (the rows are tokens: the mask, permuted, sliced and
broadcast to the rows' layout), the batch axis only (one row per sample: all rows real),
no atom at all (the rows come from inputs no mask describes), or anything else (the rows
cannot be tied to a mask: all rows are used and the reason is reported).
"""
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

__all__ = ["RowTracker", "RowsMask", "batch_key", "rows_mask", "token_tag"]

aten = torch.ops.aten


def batch_key(size):
    """The batch axis is one for every mask of a call with the same B: an encoder's and a
    decoder's masks index the same samples, and an operation that combines their tensors
    at batch index b combines sample b of each."""
    return ("batch", size)


def token_tag(src, ndim, batch_dim=0, seq_dim=1, size=None):
    """The tag of a tensor whose ``batch_dim`` and ``seq_dim`` index mask ``src``'s batch and
    positions; ``size``: the mask's shape (B, T)."""
    entries = [None] * ndim
    entries[batch_dim] = (("t", batch_key(size[0]), 0, 0, 1, size[0]),)
    entries[seq_dim] = (("t", src, 1, 0, 1, size[1]),)
    return tuple(entries)


def _length(atom):
    return atom[-1]


def _lost(reason, length):
    return (("x", reason, length),)


def _lost_all(shape, reason):
    """Every dimension of an output lost (an operation the tracker cannot follow)."""
    return tuple(_lost(reason, n) for n in shape)


def _tagged(entry):
    return entry is not None and any(a[0] != "f" for a in entry)


# -- views -----------------------------------------------------------------------------------
def _atoms(tag, shape):
    """The tensor as a row-major list of atoms (untagged dimensions as fillers)."""
    out = []
    for entry, n in zip(tag, shape):
        if entry is None:
            out.append(("f", n))
        else:
            out.extend(entry)
    return out


def _split_atom(atom, first):
    """``atom`` cut into a leading part of length ``first`` and the rest, or None when the
    cut falls inside a tagged stretch in a way the layout does not allow (kept exact)."""
    n = _length(atom)
    rest = n // first
    if atom[0] == "f":
        return ("f", first), ("f", rest)
    if atom[0] == "x":
        return ("x", atom[1], first), ("x", atom[1], rest)
    _, src, axis, start, step, _ = atom
    # the leading index moves by `rest` positions: start + step * (rest * i + j)
    return ("t", src, axis, start, step * rest, first), ("t", src, axis, start, step, rest)


def _view(tag, old, new):
    """The tag of ``view(new)`` of a tensor of shape ``old``. Length-1 stretches of a mask
    (a batch of one) ride along with the next dimension, so a view never drops them."""
    if tuple(old) == tuple(new):
        return tag
    if 0 in new:
        return None
    atoms = [a for a in _atoms(tag, old) if _length(a) != 1 or a[0] != "f"]
    entries = []
    for n in new:
        entry, size = [], 1
        while atoms and _length(atoms[0]) == 1:
            entry.append(atoms.pop(0))
        while size < n:
            if not atoms:
                return None
            atom = atoms.pop(0)
            length = _length(atom)
            if size * length <= n:
                entry.append(atom)
                size *= length
                continue
            need = n // size
            if need * size != n or length % need:
                return _lost_all(new, "a view that splits a token dimension unevenly")
            head, tail = _split_atom(atom, need)
            entry.append(head)
            atoms.insert(0, tail)
            size *= need
        entries.append(entry)
    if atoms and entries:  # trailing length-1 stretches
        entries[-1].extend(atoms)
    return tuple(tuple(e) if any(a[0] != "f" for a in e) else None for e in entries)


def _attach(entries, pos, atoms, shape):
    """``entries`` (of a tensor of ``shape``) with the length-1 ``atoms`` of a removed
    dimension kept on a neighbour (they do not change its size)."""
    atoms = [a for a in atoms if a[0] != "f" and _length(a) == 1]
    if not atoms or not entries:
        return tuple(entries)
    entries = list(entries)
    pos = min(pos, len(entries) - 1)
    tagged = [i for i, e in enumerate(entries) if _tagged(e)]
    if tagged:  # ride with a dimension that indexes a mask (it survives products)
        pos = min(tagged, key=lambda i: abs(i - pos))
    rest = entries[pos] if entries[pos] is not None else (("f", shape[pos]),)
    entries[pos] = tuple(atoms) + rest
    return tuple(entries)


def _slice(entry, start, stop, step, size):
    if entry is None:
        return None
    start, stop, _ = slice(start, stop, step).indices(size)
    length = max(0, -(-(stop - start) // step))
    if len(entry) == 1 and entry[0][0] == "t":
        _, src, axis, a0, a_step, _ = entry[0]
        return (("t", src, axis, a0 + a_step * start, a_step * step, length),)
    if length == size:
        return entry
    if len(entry) == 1 and entry[0][0] == "x":
        return _lost(entry[0][1], length)
    return _lost("a slice across merged token dimensions", length)


def _dim(d, ndim):
    return d + ndim if d < 0 else d


# -- merging ---------------------------------------------------------------------------------
def _merge(entries, length):
    """One dimension's tag from several operands' at the same index (None ignored). The
    index is the same in every operand, so a known tag carries over an operand the tracker
    lost; two known tags that disagree (a (T, B) and a (B, T) operand) lose the dimension."""
    known, lost = None, None
    for entry in entries:
        if entry is None:
            continue
        if any(a[0] == "x" for a in entry):
            lost = lost or entry
        elif known is None:
            known = entry
        elif entry != known:
            return _lost("two operands index different token positions", length)
    return known if known is not None else lost


def _broadcast(tags_shapes, out_shape):
    """Pointwise: align from the right; an operand's size-1 dimension adds nothing."""
    nd = len(out_shape)
    out = []
    for i in range(nd):
        cands = []
        for tag, shape in tags_shapes:
            j = len(shape) - nd + i
            if j >= 0 and tag is not None and shape[j] == out_shape[i]:
                cands.append(tag[j])
        out.append(_merge(cands, out_shape[i]))
    return tuple(out)


# -- the rules -------------------------------------------------------------------------------
def _shape(t):
    return tuple(t.shape)


def _rule_keep(tags, args, kwargs, out):
    """Output 0 indexes what input 0 indexes: copies and casts; normalisation, softmax,
    dropout, ``tril``; attention kernels (each output row is its query's, input 0); writes
    into a copy of input 0 (``scatter``, ``index_put``, ...)."""
    return tags[0]


def _rule_view(tags, args, kwargs, out):
    return _view(tags[0], _shape(args[0]), _shape(out))


def _rule_permute(tags, args, kwargs, out):
    dims = [_dim(d, args[0].dim()) for d in args[1]]
    return tuple(tags[0][d] for d in dims)


def _rule_transpose(tags, args, kwargs, out):
    tag = list(tags[0])
    if len(tag) < 2:
        return tuple(tag)
    if len(args) == 1:  # t()
        return tuple(reversed(tag))
    a, b = _dim(args[1], len(tag)), _dim(args[2], len(tag))
    tag[a], tag[b] = tag[b], tag[a]
    return tuple(tag)


def _rule_expand(tags, args, kwargs, out):
    tag, old, new = tags[0], _shape(args[0]), _shape(out)
    lead = len(new) - len(old)
    return tuple([None] * lead + [tag[i] if old[i] == new[lead + i] else None
                                  for i in range(len(old))])


def _rule_unsqueeze(tags, args, kwargs, out):
    tag = list(tags[0])
    tag.insert(_dim(args[1], len(tag) + 1), None)
    return tuple(tag)


def _rule_squeeze(tags, args, kwargs, out):
    tag, shape = tags[0], _shape(args[0])
    if len(args) > 1:
        dims = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        dims = {_dim(d, len(shape)) for d in dims}
    else:
        dims = set(range(len(shape)))
    gone = {i for i in dims if shape[i] == 1}
    kept = tuple(e for i, e in enumerate(tag) if i not in gone)
    for i in sorted(gone):
        if tag[i] is not None:
            kept = _attach(kept, sum(1 for j in range(i) if j not in gone), tag[i],
                           _shape(out))
    return kept


def _rule_slice(tags, args, kwargs, out):
    tag, shape = list(tags[0]), _shape(args[0])
    dim = _dim(args[1] if len(args) > 1 else 0, len(shape))
    start = args[2] if len(args) > 2 else None
    stop = args[3] if len(args) > 3 else None
    step = args[4] if len(args) > 4 else 1
    tag[dim] = _slice(tag[dim], start, stop, step, shape[dim])
    return tuple(tag)


def _rule_select(tags, args, kwargs, out):
    """One index of a dimension: the position it picks stays as a length-1 stretch on a
    neighbouring dimension (a sample's rows, a first-token row), so that a ``stack`` of the
    picks along a new dimension (a recurrent loop over time steps) gets the axis back."""
    tag, shape = tags[0], _shape(args[0])
    dim = _dim(args[1], len(shape))
    kept = tuple(e for i, e in enumerate(tag) if i != dim)
    entry = tag[dim]
    if entry is not None and len(entry) == 1 and entry[0][0] == "t":
        _, src, axis, start, step, _ = entry[0]
        index = args[2] + shape[dim] if args[2] < 0 else args[2]
        kept = _attach(kept, dim, [("t", src, axis, start + step * index, 1, 1)], _shape(out))
    elif entry is not None and any(a[0] != "f" for a in entry):
        kept = _attach(kept, dim, [("x", "an index into merged token dimensions", 1)],
                       _shape(out))
    return kept


def _rule_split(tags, args, kwargs, out):
    tag, shape = list(tags[0]), _shape(args[0])
    dim = _dim(args[2] if len(args) > 2 else kwargs.get("dim", 0), len(shape))
    results, start = [], 0
    for piece in out:
        n = piece.shape[dim]
        t = list(tag)
        t[dim] = _slice(tag[dim], start, start + n, 1, shape[dim])
        results.append(tuple(t))
        start += n
    return results


def _rule_unbind(tags, args, kwargs, out):
    dim = args[1] if len(args) > 1 else 0
    return [_rule_select(tags, (args[0], dim, i), kwargs, o) for i, o in enumerate(out)]


def _rule_pointwise(tags, args, kwargs, out):
    pairs = [(tag, _shape(t)) for tag, t in zip(tags, _tensor_args(args, kwargs))]
    return _broadcast(pairs, _shape(out))


def _rule_mm(tags, args, kwargs, out):
    a, b = tags[0], tags[1]
    rows = a[0] if a is not None else None
    cols = b[1] if b is not None else None
    return (rows, cols)


def _rule_addmm(tags, args, kwargs, out):
    c, a, b = tags[0], tags[1], tags[2]
    rows = a[0] if a is not None else None
    cols = b[1] if b is not None else None
    if c is not None:
        return _broadcast([((rows, cols), _shape(out)), (c, _shape(args[0]))], _shape(out))
    return (rows, cols)


def _rule_bmm(tags, args, kwargs, out):
    a, b = tags[0], tags[1]
    n = out.shape[0]
    batch = _merge([a[0] if a is not None else None, b[0] if b is not None else None], n)
    return (batch, a[1] if a is not None else None, b[2] if b is not None else None)


def _rule_baddbmm(tags, args, kwargs, out):
    core = _rule_bmm(tags[1:], args[1:], kwargs, out)
    if tags[0] is not None:
        return _broadcast([(core, _shape(out)), (tags[0], _shape(args[0]))], _shape(out))
    return core


def _rule_embedding(tags, args, kwargs, out):
    indices = tags[1]
    return (tuple(indices) if indices is not None else (None,) * args[1].dim()) + (None,)


def _rule_reduce(tags, args, kwargs, out):
    tag, nd = tags[0], args[0].dim()
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(nd))
    if not isinstance(dims, (list, tuple)):
        dims = [dims]
    dims = {_dim(d, nd) for d in dims}
    keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if keep:
        return tuple(None if i in dims else e for i, e in enumerate(tag))
    return tuple(e for i, e in enumerate(tag) if i not in dims)


def _rule_norm(tags, args, kwargs, out):
    """``linalg_vector_norm(self, ord, dim, keepdim)``, ``norm(self, p, dim, keepdim)``."""
    return _rule_reduce(tags, (args[0],) + tuple(args[2:]), kwargs, out)


def _rule_pad(tags, args, kwargs, out):
    """``constant_pad_nd(self, pad)``: padding shifts the positions of a padded dimension."""
    tag, pad = list(tags[0]), list(args[1])
    for k in range(len(pad) // 2):
        dim = len(tag) - 1 - k
        if (pad[2 * k] or pad[2 * k + 1]) and tag[dim] is not None:
            tag[dim] = _lost("padding along token positions", out.shape[dim])
    return tuple(tag)




def _rule_cat(tags, args, kwargs, out):
    tensors = [t for t in args[0]]
    dim = _dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), out.dim())
    ins = [(tag, _shape(t)) for tag, t in zip(tags, tensors) if t.dim() == out.dim()]
    result = []
    for i in range(out.dim()):
        entries = [tag[i] if tag is not None else None for tag, _ in ins]
        if i == dim:
            result.append(None if all(e is None for e in entries) else
                          _lost("a concatenation along token positions", out.shape[i]))
        else:
            result.append(_merge(entries, out.shape[i]))
    return tuple(result)


def _pinned(entry):
    """(the length-1 tagged stretches of ``entry``, the rest)."""
    if entry is None:
        return (), None
    pins = tuple(a for a in entry if a[0] == "t" and _length(a) == 1)
    rest = tuple(a for a in entry if not (a[0] == "t" and _length(a) == 1))
    return pins, (rest if any(a[0] != "f" for a in rest) else None)


def _rule_stack(tags, args, kwargs, out):
    """The other dimensions merge; the new one indexes nothing, unless each operand is one
    pick of the same axis at evenly spaced positions (a loop over time steps): then it
    indexes those positions again."""
    dim = _dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), out.dim())
    rest = [i for i in range(out.dim()) if i != dim]
    result = [None] * out.dim()
    picks = []
    for tag in tags:
        pins = [p for e in (tag or ()) for p in _pinned(e)[0]]
        picks.append(pins[0] if len(pins) == 1 else None)
    recovered = None
    if len(tags) > 1 and all(p is not None for p in picks):
        srcs = {(p[1], p[2]) for p in picks}
        starts = [p[3] for p in picks]
        step = starts[1] - starts[0]
        if len(srcs) == 1 and step > 0 and all(b - a == step for a, b in zip(starts, starts[1:])):
            (src, axis), = srcs
            recovered = (("t", src, axis, starts[0], step, len(tags)),)
    for k, i in enumerate(rest):
        entries = [tag[k] if tag is not None else None for tag in tags]
        if recovered is not None:
            entries = [_pinned(e)[1] for e in entries]
        result[i] = _merge(entries, out.shape[i])
    result[dim] = recovered
    return tuple(result)


def _rule_index_select(tags, args, kwargs, out):
    tag = list(tags[0])
    dim = _dim(args[1], len(tag))
    if tag[dim] is not None:
        tag[dim] = _lost("rows picked by an index", out.shape[dim])
    return tuple(tag)


def _rule_gather(tags, args, kwargs, out):
    src, index = tags[0], tags[1] if len(tags) > 1 else None
    dim = _dim(args[1], out.dim())
    result = []
    for i in range(out.dim()):
        if i == dim:
            touched = (src is not None and src[i] is not None) or (
                index is not None and index[i] is not None)
            result.append(_lost("rows picked by an index", out.shape[i]) if touched else None)
        else:
            same = src is not None and args[0].shape[i] == out.shape[i]
            result.append(_merge([src[i] if same else None,
                                  index[i] if index is not None else None], out.shape[i]))
    return tuple(result)


def _rule_convolution(tags, args, kwargs, out):
    tag = tags[0]
    if tag is None:
        return None
    spatial = [_lost("a convolution along token positions", n) if e is not None else None
               for e, n in zip(tag[2:], out.shape[2:])]
    return (tag[0], None, *spatial)


def _rule_rnn(tags, args, kwargs, out):
    """``aten.lstm`` / ``gru`` / ``rnn_*`` (input, ...): output (*, *, H) keeps the input's
    batch and time dimensions (its own flag says which is which; both keep their places)."""
    tag = tags[0]
    return (tag[0], tag[1], None) if tag is not None and len(tag) == 3 else tag


def _rule_copy_(tags, args, kwargs, out):
    """``self.copy_(src)``: self's tag, or the source's if self had none."""
    if tags[0] is not None:
        return tags[0]
    if tags[1] is not None and _shape(args[1]) == _shape(args[0]):
        return tags[1]
    return None


_SAME = (aten.alias, aten.detach, aten.clone, aten._to_copy, aten.lift_fresh, aten.contiguous,
         aten.to, aten.resolve_conj, aten.resolve_neg, aten._conj, aten.view_as_real)
_VIEWS = (aten.view, aten._unsafe_view, aten.reshape, aten._reshape_alias, aten.flatten,
          aten.unflatten)
_FIRST = (aten.native_layer_norm, aten.native_group_norm, aten.native_batch_norm,
          aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training, aten.tril, aten.triu,
          aten._softmax, aten._log_softmax, aten._safe_softmax, aten.softmax, aten.log_softmax,
          aten.native_dropout, aten.dropout, aten.cumsum, aten.cumprod, aten._fused_rms_norm,
          aten.rms_norm, aten.layer_norm, aten.masked_fill, aten.masked_fill_, aten.where,
          aten.clamp, aten.clamp_min, aten.clamp_max, aten.bernoulli_, aten.uniform_,
          aten.normal_, aten.fill_, aten.zero_)
_ATTENTION = tuple(getattr(aten, name) for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_attention_math", "_scaled_dot_product_fused_attention_overrideable",
    "scaled_dot_product_attention", "_efficient_attention_forward", "_flash_attention_forward")
    if hasattr(aten, name))
_REDUCE = (aten.sum, aten.mean, aten.amax, aten.amin, aten.max, aten.min, aten.var, aten.std,
           aten.var_mean, aten.std_mean, aten.logsumexp, aten.prod, aten.any, aten.all,
           aten.argmax, aten.argmin, aten.count_nonzero)
_RNN = tuple(getattr(aten, name) for name in ("lstm", "gru", "rnn_tanh", "rnn_relu",
                                              "mkldnn_rnn_layer", "_thnn_fused_lstm_cell")
             if hasattr(aten, name))

RULES = {op: rule for ops, rule in ((_SAME + _FIRST + _ATTENTION, _rule_keep),
                                    (_VIEWS, _rule_view), (_REDUCE, _rule_reduce),
                                    (_RNN, _rule_rnn)) for op in ops}
RULES.update({
    aten.permute: _rule_permute, aten.transpose: _rule_transpose, aten.t: _rule_transpose,
    aten.expand: _rule_expand, aten.unsqueeze: _rule_unsqueeze, aten.squeeze: _rule_squeeze,
    aten.slice: _rule_slice, aten.select: _rule_select, aten.split: _rule_split,
    aten.split_with_sizes: _rule_split, aten.unsafe_split: _rule_split,
    aten.unsafe_split_with_sizes: _rule_split, aten.unbind: _rule_unbind,
    aten.mm: _rule_mm, aten.addmm: _rule_addmm, aten.bmm: _rule_bmm,
    aten.baddbmm: _rule_baddbmm, aten.embedding: _rule_embedding, aten.cat: _rule_cat,
    aten.stack: _rule_stack, aten.index_select: _rule_index_select, aten.gather: _rule_gather,
    aten.convolution: _rule_convolution, aten.copy_: _rule_copy_, aten.copy: _rule_copy_,
    aten.linalg_vector_norm: _rule_norm, aten.norm: _rule_norm, aten.constant_pad_nd: _rule_pad,
    aten.scatter: _rule_keep, aten.scatter_add: _rule_keep, aten.index_put: _rule_keep,
    aten.index_add: _rule_keep, aten.index_fill: _rule_keep, aten.index_copy: _rule_keep,
    aten.masked_scatter: _rule_keep,
})
# ops that produce a scalar or no tensor: nothing to carry
_NOTHING = {aten._local_scalar_dense, aten.nll_loss_forward, aten.nll_loss2d_forward,
            aten.is_nonzero, aten.equal, aten.allclose, aten.nonzero, aten.empty_like,
            aten.zeros_like, aten.ones_like, aten.full_like, aten.rand_like, aten.randn_like,
            aten.randint_like, aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full,
            aten.new_empty_strided, aten.scalar_tensor, aten._to_dense}
# ...nothing positional either: the outputs are fresh (their values index nothing)


def _tensor_args(args, kwargs):
    out = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


class RowTracker(TorchDispatchMode):
    """The dispatch mode that carries tags (module docstring) during one call with masks.

    ``tag_of(t)`` / ``set_tag(t, tag)`` read and write a tensor's tag; tensors are held
    weakly (a tag never keeps an activation alive: checkpointed regions stay cheap).
    """

    def __init__(self):
        super().__init__()
        self._tags = {}
        self.entered = False

    def tag_of(self, t):
        entry = self._tags.get(id(t))
        if entry is None:
            return None
        ref, tag = entry
        return tag if ref() is t else None

    def set_tag(self, t, tag):
        if tag is None or all(e is None for e in tag):
            self._tags.pop(id(t), None)
            return
        if len(tag) != t.dim():
            tag = _lost_all(tuple(t.shape), "a rule's output rank did not match")
        self._tags[id(t)] = (weakref.ref(t), tag)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = _tensor_args(args, kwargs)
        if not self._tags:
            return out
        tags = [self.tag_of(t) for t in tensors]
        if all(tag is None for tag in tags):
            return out
        packet = func.overloadpacket
        if packet in _NOTHING:
            return out
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if torch.Tag.pointwise in func.tags:
            rule = _rule_pointwise
        else:
            rule = RULES.get(packet)
            if rule is None and outs and args and outs[0] is args[0]:
                return out  # written in place: a tensor keeps the positions it had
        try:
            if rule is None:
                results = [_lost_all(tuple(o.shape), f"{packet.__name__} (not followed)")
                           if isinstance(o, torch.Tensor) else None for o in outs]
            elif rule in (_rule_split, _rule_unbind):
                results = rule(tags, args, kwargs, outs)
            else:
                results = [rule(tags, args, kwargs, outs[0])] + [None] * (len(outs) - 1)
        except (IndexError, TypeError, ValueError, ZeroDivisionError, AttributeError):
            reason = f"{packet.__name__} (its arguments were not understood)"
            results = [_lost_all(tuple(o.shape), reason) if isinstance(
                o, torch.Tensor) else None for o in outs]
        for o, tag in zip(outs, results):
            if isinstance(o, torch.Tensor):
                self.set_tag(o, None if tag is None else tuple(tag))
        return out

    # entering and leaving from module hooks (a pre-hook enters, a post-hook leaves)
    def enter(self):
        if not self.entered:
            self.__enter__()
            self.entered = True

    def leave(self):
        if self.entered:
            self.entered = False
            if _get_current_dispatch_mode() is not self:
                raise RuntimeError("MKOR/K-FAC: another TorchDispatchMode entered inside the "
                                   "model's forward is still active when it returns; the row "
                                   "tracker cannot be left in order")
            self.__exit__(None, None, None)


class RowsMask:
    """What :func:`rows_mask` found for one call's rows: ``mask`` (a bool tensor of the
    rows' leading shape, or None: all rows), ``source`` (a short word for the report:
    "tokens", "per sample", "none"), ``reason`` (why the rows could not be tied to a mask,
    or None) and ``key`` (equal for equal layouts)."""

    __slots__ = ("mask", "source", "reason", "key")

    def __init__(self, mask, source, reason=None, key=None):
        self.mask, self.source, self.reason, self.key = mask, source, reason, key


_NO_MASK = RowsMask(None, "none")


def rows_mask(entries, lead, masks, cache=None):
    """The mask of rows whose leading dimensions have tags ``entries`` and shape ``lead``.

    Args:
        entries: the tags of the rows' leading dimensions (None: untagged rows).
        lead: the rows' leading shape.
        masks: the call's masks, by ``src`` number ((B, T) bool tensors).
        cache: a dict reused across the layers of one call ({layout: mask}).
    """
    if entries is None:
        return _NO_MASK
    atoms = [(("f", n),) if e is None else e for e, n in zip(entries, lead)]
    flat = [a for entry in atoms for a in entry]
    lost = [a for a in flat if a[0] == "x"]
    if lost:
        return RowsMask(None, "untied", f"its rows pass through {lost[0][1]}")
    tagged = [a for a in flat if a[0] == "t"]
    if not tagged:
        return _NO_MASK
    seq = [a for a in tagged if a[2] == 1]
    batch = [a for a in tagged if a[2] == 0]
    if not seq:
        if len(batch) == 1:
            return RowsMask(None, "per sample")
        return RowsMask(None, "untied", "its rows index the batch more than once")
    if len({a[1] for a in seq}) > 1:
        return RowsMask(None, "untied", "its rows combine the positions of two token masks")
    src = seq[0][1]
    if len(seq) != 1 or len(batch) != 1:
        why = ("its rows index token positions but not samples" if not batch else
               "its rows index one token axis more than once")
        return RowsMask(None, "untied", why)
    if batch[0][1] != batch_key(masks[src].shape[0]):
        return RowsMask(None, "untied", "its rows' batch is not its positions' mask's")
    # the rows' shape is part of the key: (B, T) rows and the same tokens flattened to (B T)
    # (a MoE block's input) have the same atoms but not the same mask shape
    key = (src, tuple(flat), tuple(lead))
    if cache is not None and key in cache:
        return cache[key]
    mask = masks[src]
    shape = [_length(a) for a in flat]
    index = [None, None]
    for pos, atom in enumerate(flat):
        if atom[0] != "t":
            continue
        _, _, axis, start, step, length = atom
        view = [1] * len(flat)
        view[pos] = length
        index[axis] = (start + step * torch.arange(length, device=mask.device)).view(view)
    rows = mask[index[0], index[1]].expand(shape).reshape(tuple(lead))
    found = RowsMask(rows, "tokens", None, key)
    if cache is not None:
        cache[key] = found
    return found
