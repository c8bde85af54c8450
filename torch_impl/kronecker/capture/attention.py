"""The rows of an ``nn.MultiheadAttention`` out-projection, a part of :class:`~.capture.Capture`.

``nn.MultiheadAttention`` never calls its ``out_proj`` module (it passes the weight to
``F.multi_head_attention_forward``), so an out-projection is captured through its parent: a
forward hook on the attention module reads the projection's input from the autograd node that
multiplies by ``out_proj.weight``, and the attention output's gradient supplies g. The rows
are then recorded as any layer's call (:meth:`~.capture.Capture.record`).
"""
import warnings

from .guards import _guarded
from .hooks import BoundHook

__all__ = ["AttentionOutRows", "find_matmul_input"]


def _reaches(fn, weight, depth=3):
    """Whether autograd node ``fn`` leads to ``weight``'s accumulator within ``depth``
    single-input hops (a transpose, plus an autocast copy under mixed precision)."""
    for _ in range(depth):
        if fn is None:
            return False
        if getattr(fn, "variable", None) is weight:
            return True
        nxt = [f for f, _ in getattr(fn, "next_functions", ()) if f is not None]
        if len(nxt) != 1:
            return False
        fn = nxt[0]
    return getattr(fn, "variable", None) is weight


def find_matmul_input(output, weight, max_nodes=64):
    """The input y of the matmul y @ weight.T that produced ``output`` (autograd walk).

    Looks for an ``addmm`` / ``mm`` node one of whose operands comes from ``weight``'s
    accumulator, and returns its saved left operand.
    """
    frontier, seen = [output.grad_fn], set()
    while frontier and len(seen) < max_nodes:
        node = frontier.pop(0)
        if node is None or node in seen:
            continue
        seen.add(node)
        children = [fn for fn, _ in node.next_functions if fn is not None]
        if any(_reaches(fn, weight) for fn in children):
            saved = getattr(node, "_saved_mat1", None)
            if saved is None:
                saved = getattr(node, "_saved_self", None)
            if saved is not None and saved.dim() == 2 and saved.shape[-1] == weight.shape[1]:
                return saved
        frontier.extend(children)
    return None


def _rows(layer, y, out):
    """(input rows, function grad -> rows) of an MHA out-projection, both with leading
    shape (B, T) for a batched input: F.multi_head_attention_forward multiplies the
    (T*B, E) rows in (T, B) order."""
    parent = layer.parent
    if out.dim() != 3:
        return y, lambda g: g
    B, T = (out.shape[0], out.shape[1]) if parent.batch_first else (out.shape[1],
                                                                    out.shape[0])
    rows = y.reshape(T, B, -1).transpose(0, 1)
    if parent.batch_first:
        return rows, lambda g: g
    return rows, lambda g: g.transpose(0, 1)


def _tags(parent, out):
    """The tags of an MHA out-projection's (B, T) rows: its output's (the queries'),
    in (B, T) order."""
    def tags_of(tracker):
        tag = tracker.tag_of(out)
        if tag is None or len(tag) != 3:
            return None if tag is None else tag[:-1]
        return (tag[0], tag[1]) if parent.batch_first else (tag[1], tag[0])
    return tags_of


class AttentionOutRows:
    """The hooks of every MHA out-projection layer of ``capture`` (module docstring)."""

    def __init__(self, capture):
        self.capture = capture
        self._warned = set()  # layers already warned about (once each)

    def hooks(self, layer):
        """[(target module, kind, hook)] for the out-projection ``layer`` (on its parent)."""
        capture = self.capture
        weight = layer.module.weight

        def mha_hook(parent, args, kwargs, output):
            state = capture.active(parent)
            if state is None or state == "eval":
                if state == "eval":
                    capture.eval_seen.add(layer.name)
                return
            out = output[0] if isinstance(output, tuple) else output
            tags_of = _tags(parent, out)
            if state == "first pass":
                lead = ((out.shape[0], out.shape[1]) if parent.batch_first
                        else (out.shape[1], out.shape[0])) if out.dim() == 3 else out.shape[:1]
                capture.calls.first_pass(layer, tags_of, lead)
                return
            y = find_matmul_input(out, weight) if out.grad_fn is not None else None
            if y is None:  # no autograd record of the projection: nothing to capture
                if layer.name not in self._warned:
                    self._warned.add(layer.name)
                    warnings.warn(f"MKOR: could not find the input of {layer.name} in "
                                  "the autograd graph of its attention module; this "
                                  "layer keeps its current factors (it is listed in "
                                  "preconditioned_modules)", RuntimeWarning)
                return
            rows, grad_rows = _rows(layer, y, out)
            capture.record(layer, lambda: rows, tags_of, out, grad_rows)

        hooks = [(layer.parent, "forward", _guarded(layer, mha_hook))]
        if capture.grad_hook == "module":
            hooks.append((layer.parent, "backward", BoundHook(capture.module_backward, layer)))
        return hooks
