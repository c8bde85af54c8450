r"""How MARS, MARS-M and LAMB store their state and write a step back into it: ``state_dtype``
(one implementation for the three).

For a parameter p of dtype :math:`d_p` in a group with storage dtype
:math:`d_s` = ``state_dtype`` (:math:`d_p` when ``None``), a step computes in
:math:`d_c = \operatorname{promote}(d_p, d_s)` on working copies of every tensor stored
narrower than :math:`d_c` (gradients are only read), and writes each copy back into its
stored tensor once, after the update, rounded to nearest (``copy_``).

``load_state_dict`` keeps ``state_dtype`` (torch casts every floating state tensor to the
parameter's dtype): ``shield_state_dtype`` / ``unshield_state_dtype`` pass it by torch's cast.
"""
import torch

from .validation import check_choice

__all__ = ["STATE_DTYPES", "check_storage", "stored_dtype", "compute_dtype", "ensure_state",
           "WriteBack", "shield_state_dtype", "unshield_state_dtype",
           "load_state_dict_keeping_storage"]

STATE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
# state kept in the parameter's dtype, whatever state_dtype says (torch's load casts them so)
PARAM_DTYPE_KEYS = ("step", "prev_param", "previous_grad")


# ------------------------------------------------------------------ options

def check_storage(group):
    """The group's storage options, against its parameters (a ValueError naming the option)."""
    if group["state_dtype"] is not None:
        check_choice("state_dtype", group["state_dtype"], STATE_DTYPES)
        complex_shapes = [tuple(p.shape) for p in group["params"] if p.is_complex()]
        if complex_shapes:
            raise ValueError(f"state_dtype: complex parameters (shapes {complex_shapes}) keep "
                             "complex state, which a real state_dtype cannot hold; put them in "
                             "a group with state_dtype=None")


def stored_dtype(p, group):
    """d_s: the dtype p's state is stored in."""
    return group["state_dtype"] or p.dtype


def compute_dtype(p, group):
    """d_c: the dtype p's step computes in (module docstring)."""
    dtype = torch.promote_types(p.dtype, stored_dtype(p, group))
    return dtype


def ensure_state(st, p, group, names):
    """``st[name]`` for each of ``names``: zeros like p in the group's storage dtype where it is
    missing (a buffer a later option needs appears then), cast where the group's
    ``state_dtype`` changed since."""
    dtype = stored_dtype(p, group)
    for name in names:
        if name not in st:
            st[name] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        elif st[name].dtype != dtype:  # the group's state_dtype changed since (or a state
            st[name] = st[name].to(dtype)  # set by hand): it holds from now on


# ------------------------------------------------------------------ the write-back

class WriteBack:
    """One group's working copies (in each tensor's compute dtype) and their writes back.

    ``params`` / ``column`` return the columns a functional step takes, recording a
    (stored, working) pair for each copy; ``finish()`` writes every copy back, after the
    update."""

    def __init__(self, group, group_index):
        self.group, self.group_index = group, group_index
        self.records = []  # (stored, working)

    def params(self, params, states):
        """The parameters in their compute dtypes (a copy where it is wider)."""
        return self.column("param", params, params, states)

    def column(self, name, tensors, params, states):
        """The state column ``name`` (``None`` where a route keeps no such buffer) in the
        compute dtypes of ``params``."""
        out = []
        for t, p in zip(tensors, params):
            dtype = compute_dtype(p, self.group)
            if t is not None and t.dtype != dtype:
                copy = t.to(dtype)
                self.records.append((t, copy))
                t = copy
            out.append(t)
        return out

    def read(self, tensors, params):
        """A read-only column (the gradients) in the compute dtypes of ``params``."""
        return [t if t is None or t.dtype == compute_dtype(p, self.group)
                else t.to(compute_dtype(p, self.group)) for t, p in zip(tensors, params)]

    def finish(self):
        """Write every working copy back into its stored tensor, rounded to nearest."""
        for stored, working in self.records:
            stored.copy_(working)


# ------------------------------------------------------------------ load_state_dict

class _Shielded:
    """A state tensor passing through ``Optimizer.load_state_dict`` uncast: torch casts
    tensors (and the contents of dicts and iterables) to the parameter's dtype, not this."""
    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor


def _keeps_state_dtype(key, value):
    """A state entry stored in ``state_dtype``: not ``step`` (a CPU counter), ``prev_param``
    (x_{t-1}) or ``previous_grad`` (a copy of ``.grad``)."""
    return key not in PARAM_DTYPE_KEYS and torch.is_tensor(value) and value.is_floating_point()


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


def load_state_dict_keeping_storage(optimizer, load, state_dict):
    """``load(state_dict)`` (torch's ``Optimizer.load_state_dict``) with the state kept in
    ``state_dtype``.  The caller's ``register_load_state_dict_pre_hook`` hooks run first and
    are honoured: the state is taken from the dict they return, through torch's own id map: a
    pre-hook of ours, run after theirs, wraps the state of every group with a ``state_dtype``
    so that torch's cast passes it by, and a post-hook, run before theirs, unwraps it."""
    pre = optimizer.register_load_state_dict_pre_hook(shield_state_dtype)  # after the caller's
    post = optimizer.register_load_state_dict_post_hook(unshield_state_dtype, prepend=True)
    try:
        load(state_dict)
    finally:
        pre.remove()
        post.remove()
