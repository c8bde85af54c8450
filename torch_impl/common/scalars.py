"""How a step reads a hyperparameter that may be a tensor (lr, betas, momentum: where
``torch.optim.AdamW`` takes one, torch's advice for a compiled step with a scheduler)."""
import torch

__all__ = ["step_scalar"]


def step_scalar(x):
    """``x`` as the step uses it: a tensor read as a Python number (it lives on the CPU --
    ``validation.tensor_scalar`` -- so this is a host read, no device sync), or, while
    ``torch.compile`` traces the step, the tensor itself, so that a scheduler writing into it
    is new data for the graph rather than a new constant (a recompilation per value).
    Numbers pass unchanged."""
    return x.item() if torch.is_tensor(x) and not torch.compiler.is_compiling() else x
