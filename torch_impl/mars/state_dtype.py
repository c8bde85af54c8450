"""MARS's ``state_dtype``: the state is stored in it, a step computes in the wider of it and
the parameter's dtype (working copies, written back after the update), and
``load_state_dict`` keeps it (torch would cast the loaded state to the parameter's dtype).
``MARS`` uses these; the rule is in its docstring."""
import torch

__all__ = ["shield_state_dtype", "unshield_state_dtype", "working_copies"]


class _Shielded:
    """A state tensor passing through ``Optimizer.load_state_dict`` uncast: torch casts
    tensors (and the contents of dicts and iterables) to the parameter's dtype, not this."""
    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor


def _keeps_state_dtype(key, value):
    """A state entry stored in ``state_dtype``: not ``step`` (a CPU counter), ``prev_param``
    (x_{t-1}, the parameter's dtype) or ``previous_grad`` (a copy of ``.grad``)."""
    return key not in ("step", "prev_param", "previous_grad") and torch.is_tensor(value) and \
        value.is_floating_point()


def shield_state_dtype(optimizer, state_dict):
    """Load pre-hook (the last one): the state of saved groups with a ``state_dtype`` shielded
    from torch's cast; the dict the caller's hooks returned, ids as they left them.  A saved
    group without the key (the authors' format, or ours from before the option) gets the
    constructor's ``state_dtype``, as ``__setstate__`` back-fills it into the loaded group."""
    state = dict(state_dict["state"])
    for group in state_dict["param_groups"]:
        dtype = group.get("state_dtype", optimizer.defaults.get("state_dtype"))
        for i in group["params"]:
            if dtype is None or i not in state_dict["state"]:
                continue
            state[i] = {key: _Shielded(value) if _keeps_state_dtype(key, value) else value
                        for key, value in state[i].items()}
    return {**state_dict, "state": state}


def unshield_state_dtype(optimizer):
    """Load post-hook (the first one): each parameter's shielded state on its device, in its
    group's ``state_dtype`` (the loaded group's: torch takes the saved hyperparameters)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p not in optimizer.state:
                continue
            st = optimizer.state[p]
            for key, value in st.items():
                if isinstance(value, _Shielded):
                    st[key] = value.tensor.to(device=p.device,
                                              dtype=group["state_dtype"] or p.dtype)


def working_copies(column, dtypes, write_back):
    """``column`` with each tensor in ``dtypes[i]``: itself when it already is, else a copy,
    recorded as (stored, copy) in ``write_back`` (``None``: a read-only column)."""
    out = []
    for t, dtype in zip(column, dtypes):
        if t is not None and t.dtype != dtype:
            copy = t.to(dtype)
            if write_back is not None:
                write_back.append((t, copy))
            t = copy
        out.append(t)
    return out
