"""What every capture hook runs inside (:mod:`.capture`, :mod:`.experts`): whether a
backward pass is running (a forward now is a checkpoint's recompute), our own computations kept
out of the call's row tracker, and any failure raised as an error that names the layer."""
import contextlib

import torch

__all__ = ["CaptureError"]


def _in_backward():
    """Whether a backward pass is running on this thread (a forward now is a checkpoint's
    recompute). The autograd engine's graph-task id, as torch.utils.checkpoint reads it."""
    return torch._C._current_graph_task_id() != -1


_UNKNOWN = object()  # a recompute whose forward call could not be identified


@contextlib.contextmanager
def _untracked(ctx):
    """Our own computations inside a hook stay out of the call's row tracker."""
    tracker = ctx.tracker if ctx is not None and ctx is not _UNKNOWN else None
    if tracker is None or not tracker.entered or \
            torch.utils._python_dispatch._get_current_dispatch_mode() is not tracker:
        yield
        return
    with torch.utils._python_dispatch._pop_mode_temporarily():
        yield


class CaptureError(RuntimeError):
    """A hook could not capture a layer's statistics (the message names the layer)."""


def _named_error(layer, exc):
    if isinstance(exc, CaptureError):
        return exc
    return CaptureError(
        f"MKOR/K-FAC: capturing the statistics of layer {layer.name!r} "
        f"({type(layer.module).__name__}) failed: {type(exc).__name__}: {exc}. Pass "
        f"skip_modules=[{layer.name!r}] to leave it to the backbone optimizer.")


def _guarded(layer, hook):
    """``hook`` with any failure raised as an error that names the layer."""
    def guarded(*args):
        try:
            return hook(*args)
        except CaptureError:
            raise
        except Exception as exc:  # noqa: BLE001 - named, never swallowed
            raise _named_error(layer, exc) from exc
    return guarded
