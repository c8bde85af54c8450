"""The hook objects MKOR and K-FAC install on a model, its modules and its parameters, and the
schedule those hooks consult, held weakly (:func:`weak_schedule`).

Each is a module-level callable, never a local closure, so the model stays picklable, and
each copies (``copy.deepcopy``, ``copy.copy``, ``pickle``) as an :class:`InertHook`, which does
nothing: a copy of the model (EMA, ``torch.optim.swa_utils.AveragedModel``,
``torch.save(model)``) never reaches the original's statistics (``torch_impl/kronecker/capture/README.md``).
"""
import weakref

import torch

__all__ = ["BoundHook", "CopyInertHook", "Gated", "InertHook", "weak_schedule"]


class InertHook:
    """What a copied or unpickled :class:`CopyInertHook` becomes: a hook that does nothing
    (returns None, whatever it is called with)."""

    __slots__ = ()

    def __call__(self, *args, **kwargs):
        return None


class CopyInertHook:
    """Base of every hook a preconditioner installs on a model, its modules or its
    parameters: a module-level callable object, so the model stays picklable, and one whose
    copies (``copy.deepcopy``, ``copy.copy``, ``pickle``) are :class:`InertHook`, so a copy
    of the model never reaches the original's statistics (module docstring)."""

    def __reduce__(self):
        return InertHook, ()

    def __deepcopy__(self, memo):
        return InertHook()


class BoundHook(CopyInertHook):
    """``fn(*bound, *args)`` as a copy-inert hook (for hooks that run in the autograd engine
    or eagerly; the forward hooks dynamo traces are :class:`Gated`)."""

    def __init__(self, fn, *bound):
        self.fn, self.bound = fn, bound

    def __call__(self, *args):
        return self.fn(*self.bound, *args)


class Gated(CopyInertHook):
    """A forward (pre-)hook behind the traceable gate (module docstring, torch.compile): a
    bool read, then the ``compiler.disable``d hook proper. Under torch.compile a step
    without capture traces this to nothing."""

    def __init__(self, capture, hook):
        self.capture = capture
        self.inner = torch.compiler.disable(hook)

    def __call__(self, *args):
        if not self.capture.capturing:
            return None
        return self.inner(*args)


def weak_schedule(method):
    """A ``should_capture`` callable that holds its owner weakly: hooks left behind by a
    preconditioner that was garbage-collected capture nothing."""
    ref = weakref.WeakMethod(method)

    def schedule():
        bound = ref()
        return bound is not None and bound()
    return schedule
