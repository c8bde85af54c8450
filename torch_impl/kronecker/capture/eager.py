r"""Capture steps of a compiled model run eagerly; every other step runs compiled.

The capture hooks (:mod:`.capture`) are Python that dynamo cannot trace: they read the
autograd engine's state, attach per-call gradient hooks and keep per-layer sums. Traced
under ``torch.compile``, each hooked call breaks the graph, and the frames dynamo resumes
after the breaks belong to the model's code, not ours: transformers wraps many forwards in
one shared decorator (``deprecate_kwarg``'s ``wrapped_func``), which then recompiles once
per wrapped function and argument pattern until dynamo's recompile limit (issue 20, item 4:
T5, Switch Transformers, a 12-layer Llama). No change to the hooks can stop a model's own
frames from recompiling; not breaking the graph inside the model can.

So the model's ``forward`` is routed: on a step whose statistics are captured (the owner's
schedule, ``Capture.capturing``) a compiled caller calls the model's forward through
``torch.compiler.disable``: dynamo breaks once, in front of the model, and the forward with
its hooks runs eagerly, exactly as without compile. On every other step the gate is a bool
dynamo traces and guards: the whole model is one graph, with the layer gates traced to
no-ops. Two compiled graphs in all, whatever the model. Measured in
``paper_notes/composition_matrix.md`` (compile column): on the CPU models there, eager
capture steps were also faster than graph-broken compiled ones.

The router is an instance attribute ``model.forward`` that wraps the forward that was there
(the class's, or one another library installed, e.g. accelerate's output cast), so
``inspect.signature(model.forward)`` (Trainer's column filter) is unchanged. A copy of the
model (``copy.deepcopy``: EMA, SWA; ``pickle``) gets the wrapped forward back, bound to the
copy, never a route to the original.
"""
import functools

import torch

__all__ = ["EagerCaptureSteps"]


def _unrouted(forward):
    """What a copied or unpickled router becomes: the forward it wrapped (copied with the
    model, so bound to the copy)."""
    return forward


class EagerCaptureSteps:
    """``model.forward`` while a :class:`~.capture.Capture` is registered on ``model``.

    Args:
        capture: the owner's capture; its ``capturing`` bool is the gate.
        forward: the forward to call (``model.forward`` before routing).
    """

    def __init__(self, capture, forward):
        self.capture = capture
        self.forward = forward
        self.eager_forward = torch.compiler.disable(self.tracked_forward)
        functools.update_wrapper(self, forward)  # __wrapped__: signature and name stay

    def tracked_forward(self, *args, **kwargs):
        """The forward of a capture step, with the call's row tracker around it (entered
        here, inside the eager region: dynamo never resumes tracing with it active)."""
        capture = self.capture
        if capture is None:
            return self.forward(*args, **kwargs)
        with capture.tracking():
            return self.forward(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        capture = self.capture
        if capture is not None and capture.capturing:
            if torch.compiler.is_compiling():
                return self.eager_forward(*args, **kwargs)
            return self.tracked_forward(*args, **kwargs)
        return self.forward(*args, **kwargs)

    def __reduce__(self):
        return _unrouted, (self.forward,)

    @classmethod
    def install(cls, model, capture):
        """Route ``model.forward`` through ``capture``'s gate; returns the router."""
        router = cls(capture, model.forward)
        router._had_own = "forward" in model.__dict__
        model.forward = router
        return router

    def uninstall(self, model):
        """Give ``model`` back the forward it had; if another library has since wrapped the
        router, it stays in the chain as a pass-through."""
        self.capture = None
        if model.__dict__.get("forward") is self:
            if self._had_own:
                model.forward = self.forward
            else:
                del model.forward
