r"""Materialise an optimizer's state without stepping it.

torchtitan's ``init_optim_state`` and DCP's ``_init_optim_state`` create state before a
checkpoint by one ``step()`` with zero gradients and lr = 0 when ``optimizer.state`` is
empty. That step counts: Adam's ``step`` becomes 1, so the first real update bias-corrects
with t = 2 and the run changes. :func:`init_backbone_state` creates the state a first step
creates, with every counter at 0, so those tools see state and skip their step:

* an optimizer with its own ``init_state()`` (ours: MARS, MARS-M, LAMB) is asked to;
* ``torch.optim.Adam`` / ``AdamW`` (exactly these classes, whose first step creates
  ``step``, ``exp_avg``, ``exp_avg_sq`` and, with amsgrad, ``max_exp_avg_sq``, each zero
  before its update) take torch's own zero-gradient, lr = 0 step, after which every state
  tensor is set back to zero: their initial values. The step leaves the parameters as they
  were (the update is scaled by lr = 0; AdamW's decay is ``1 - lr * weight_decay = 1``);
  Adam's L2 term makes its zero-step moments nonzero, which the reset undoes;
* any other optimizer is refused (``TypeError``): its initial state is not derivable from
  its class here, and a zero step would not be a no-op in general (SGD's first momentum
  buffer skips dampening, for one).

Nothing happens if the optimizer already has state; gradients that are set are refused, as
they belong to a step in progress.
"""
import torch

__all__ = ["init_backbone_state"]

_ZERO_STEP_RESETS = (torch.optim.Adam, torch.optim.AdamW)


def init_backbone_state(optimizer):
    """Create ``optimizer``'s state as its first step would, counters at 0 (module docstring)."""
    own = getattr(optimizer, "init_state", None)
    if callable(own):
        own()
        return
    if optimizer.state:
        return
    if type(optimizer) not in _ZERO_STEP_RESETS:
        raise TypeError(f"cannot create the state of a {type(optimizer).__name__} without "
                        "stepping it (its initial state is known here for torch.optim.Adam and "
                        "AdamW and for optimizers with an init_state() method)")
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if any(p.grad is not None for p in params):
        raise ValueError("init_state: gradients are set (a step in progress); call it before "
                         "the first backward or after zero_grad()")
    lrs = [g["lr"] for g in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in optimizer.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        for p in params:
            p.grad = None
    with torch.no_grad():
        for entry in optimizer.state.values():
            for value in entry.values():
                if isinstance(value, torch.Tensor):
                    value.zero_()
