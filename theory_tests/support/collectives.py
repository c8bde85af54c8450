"""Count the collectives a block of code issues on this rank: every c10d entry point that moves
a tensor (``torch.distributed.*``) and every functional collective (``_c10d_functional`` ops,
what DTensor's redistributions and ``full_tensor`` run), with the elements each moves.

``with Collectives() as seen: ...`` then ``seen.calls`` is [(name, elements)] and
``seen.shapes`` the shapes of the tensors each call moved; nested calls (a c10d function
implemented by another) are counted once, at the outermost entry.
"""
import functools

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Collectives"]

_C10D = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
         "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
         "broadcast", "broadcast_object_list", "reduce", "gather", "scatter", "send", "recv",
         "isend", "irecv", "batch_isend_irecv")


def _shapes(args):
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(tuple(a.shape))
        elif isinstance(a, (list, tuple)):
            out += _shapes(a)
    return out


def _elements(args):
    total = 0
    for a in args:
        if isinstance(a, torch.Tensor):
            total += a.numel()
        elif isinstance(a, (list, tuple)):
            total += _elements(a)
    return total


class _Functional(TorchDispatchMode):
    def __init__(self, record):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and not func.__name__.startswith(("wait",
                                                                                   "_wrap")):
            self.record(f"functional.{func.__name__}", args)
        return func(*args, **(kwargs or {}))


class Collectives:
    """The collectives issued inside the ``with`` block (module docstring)."""

    def __init__(self):
        self.calls = []
        self.shapes = []
        self._saved = {}
        self._depth = 0
        self._mode = None

    def _record(self, name, args):
        if self._depth <= 1:
            self.calls.append((name, _elements(args)))
            self.shapes.append((name, _shapes(args)))

    def _wrap(self, name, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            self._depth += 1
            try:
                self._record(name, list(args) + list(kwargs.values()))
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
        return counted

    def __enter__(self):
        for name in _C10D:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        self._mode = _Functional(self._record)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        return False

    @property
    def elements(self):
        return sum(n for _, n in self.calls)
