"""Count the torch.distributed collectives a block of code issues on this rank.

:class:`CountCollectives` is a ``TorchDispatchMode`` that counts every operator of the
namespaces through which torch moves a tensor between ranks:

* ``c10d`` -- what ``torch.distributed``'s own functions (``all_reduce``, ``all_gather*``,
  ``all_to_all*``, ``broadcast``, ``reduce*``, ``reduce_scatter*``, ``gather``, ``scatter``,
  ``send`` / ``recv`` / ``isend`` / ``irecv``, the ``*_object`` ones over their tensors)
  dispatch to, from Python or from the process group's C++;
* ``_c10d_functional`` / ``c10d_functional`` / ``_c10d_functional_autograd`` -- the
  functional collectives, which DTensor's redistributions (``full_tensor``, a
  ``Partial`` -> ``Replicate`` of a norm) and FSDP2 issue.

``wait_tensor`` moves nothing (it waits for one of the above) and is not counted. Each
counted op is also recorded in ``calls`` as ``(name, elements)`` and in ``shapes`` as
``(name, [shapes])``: the tensors among its arguments (what it moves, with its output buffers
where an op takes them), so a test can tell which data travelled.  An op on
DTensors is left to DTensor first (``NotImplemented``, as torch's ``CommDebugMode`` does),
so the collectives its redistribution issues come back through the mode and are counted.
``theory_tests/distributed/test_mars_ep.py::test_the_counter_sees_every_kind_of_collective``
checks that each entry point above is seen.
"""
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CountCollectives", "NAMESPACES"]

NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")
_NOT_MOVING = ("wait_tensor", "_wrap_tensor_autograd")


def _tensors(args):
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += _tensors(a)
    return out


class CountCollectives(TorchDispatchMode):
    """``with CountCollectives() as count: ...``; then ``count.total`` and ``count.ops``
    (a ``Counter`` of ``"namespace.name"``)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()
        self.calls, self.shapes = [], []

    @property
    def total(self):
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into local ops and collectives
        name = func._schema.name  # "c10d::allreduce_", "_c10d_functional::all_reduce", ...
        namespace, _, op = name.partition("::")
        if namespace in NAMESPACES and op not in _NOT_MOVING:
            self.ops[f"{namespace}.{op}"] += 1
            tensors = _tensors(list(args) + list((kwargs or {}).values()))
            self.calls.append((f"{namespace}.{op}", sum(t.numel() for t in tensors)))
            self.shapes.append((f"{namespace}.{op}", [tuple(t.shape) for t in tensors]))
        return func(*args, **(kwargs or {}))
