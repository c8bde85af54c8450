"""Peak memory of the tensors an optimizer step allocates, on any device (CPU included).

``torch.cuda.max_memory_allocated`` exists only on CUDA; this counts allocations at the
dispatcher instead.  Inside ``with StepMemory() as mem:`` every operator output whose storage
is new (not an input's storage, not a view of memory that existed before) is tracked until the
last tensor referring to it is freed; ``mem.peak_bytes`` is the largest total alive at once.
Memory that was allocated before the block and still lives after it (state created lazily, for
instance) counts too, so measure a step after the first one.
"""
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["StepMemory"]


class StepMemory(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._storages = {}  # data_ptr -> [bytes, tensors alive that use it]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        input_ids = {id(t) for t in inputs}
        input_ptrs = {t.untyped_storage().data_ptr() for t in inputs}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or id(t) in input_ids:
                continue  # not a tensor, or an in-place op handing back its input
            ptr = t.untyped_storage().data_ptr()
            entry = self._storages.get(ptr)
            if entry is None:
                if ptr in input_ptrs:
                    continue  # a view of memory allocated outside the block
                entry = self._storages[ptr] = [t.untyped_storage().nbytes(), 0]
                self.live_bytes += entry[0]
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            entry[1] += 1
            weakref.finalize(t, self._release, ptr)
        return out

    def _release(self, ptr):
        entry = self._storages.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live_bytes -= entry[0]
            del self._storages[ptr]
