r"""K-FAC's per-layer state apart from the optimizer in :mod:`.kfac`: the factors' storage
dtype (issue 47 item 3, LP5), the state's checkpoint form, and loading it back.

**Storage and compute dtypes.** K-FAC computes in the *compute dtype*, the weights' dtype
promoted with float32: the batch statistics, the EMA blend, the eigendecomposition or inverse
(:func:`~.kfac_equations.decompose` upcasts a narrower factor first) and the preconditioned
gradient. ``factor_dtype`` (default: the compute dtype) is only where the EMAs A and G are
*kept* between steps: with ``torch.bfloat16`` each factor costs half the bytes of float32,
(d_in'^2 + d_out^2) x 2 per layer, and each EMA write

.. math:: \hat F_t = \mathrm{RN}\big(\beta \hat F_{t-1} + (1-\beta) F_{new}\big)

rounds every entry to nearest (relative error at most u = 2^-8, bf16's unit roundoff; 2^-11
for float16), so the kept factor's entrywise error obeys |\hat F_t - F_t| <= E_t with
E_t = beta E_{t-1} + u |\hat F_t| (first order; ``theory_tests/low_precision/
test_factor_kfac.py`` checks it against the float64 oracle, and the preconditioned gradient's
perturbation bound that follows). The decompositions stay in the compute dtype.
"""
import torch

from ..kronecker.placement import kept_here

__all__ = ["factor_storage_dtype", "preconditioner_state", "load_layer_states"]

_FACTOR_DTYPES = {"float64": torch.float64, "float32": torch.float32,
                  "bfloat16": torch.bfloat16, "float16": torch.float16}


def factor_storage_dtype(factor_dtype, compute_dtype):
    """The dtype the EMAs are kept in: ``factor_dtype`` (a torch dtype or its name), None for
    the compute dtype; a dtype wider than the compute dtype stores nothing the computation
    has, so it is refused (ValueError naming ``factor_dtype``)."""
    if factor_dtype is None:
        return compute_dtype
    value = factor_dtype
    if isinstance(value, str):
        value = _FACTOR_DTYPES.get(value.replace("torch.", ""), value)
    if value not in _FACTOR_DTYPES.values():
        raise ValueError(f"factor_dtype: expected None or one of {sorted(_FACTOR_DTYPES)}, "
                         f"got {factor_dtype!r}")
    if torch.finfo(value).bits > torch.finfo(compute_dtype).bits:
        raise ValueError(f"factor_dtype: expected a dtype no wider than the compute dtype "
                         f"{compute_dtype} (the weights' promoted with float32), got {value}")
    return value


def _to_device(value, device, dtype):
    """A copy of a saved state entry on ``device``; floating tensors in ``dtype``."""
    if isinstance(value, tuple):
        return tuple(_to_device(v, device, dtype) for v in value)
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype if value.is_floating_point() else None,
                        copy=True)
    return value


def preconditioner_state(steps, layer_states, clone):
    """K-FAC's own state: factors, their decompositions and counters (by module name) and
    the step count (the tensors copied if ``clone``)."""
    if not clone:
        return {"steps": steps, "layers": {n: dict(s) for n, s in layer_states.items()}}
    return {"steps": steps,
            "layers": {n: {k: (tuple(t.clone() for t in v) if isinstance(v, tuple)
                               else v.clone() if isinstance(v, torch.Tensor) else v)
                           for k, v in s.items()}
                       for n, s in layer_states.items()}}


def load_layer_states(saved_layers, own_states, compute_dtype, factor_dtype):
    """The layer states of a checkpoint (``preconditioner_state``'s ``"layers"``) checked
    against this optimizer's ``own_states`` and copied onto their devices: the factors A, G
    in ``factor_dtype``, the decompositions in ``compute_dtype``."""
    if set(saved_layers) != set(own_states):
        raise ValueError(f"state_dict layers {sorted(saved_layers)} do not match the "
                         f"preconditioned modules {sorted(own_states)}")
    loaded = {}
    for name, saved in saved_layers.items():
        own = own_states[name]
        if not kept_here(name, own, saved):
            loaded[name] = {}
            continue
        for key in ("A", "G"):
            if (key in saved) != (key in own) or (
                    key in own and saved[key].shape != own[key].shape):
                raise ValueError(f"{name}.{key}: the saved factor does not fit this layer "
                                 "(a different model or max_factor_dim?)")
        if saved["updates"].shape != own["updates"].shape:  # one layer vs a stack
            raise ValueError(f"{name}: the saved counters of shape "
                             f"{tuple(saved['updates'].shape)} do not fit this layer's "
                             f"{tuple(own['updates'].shape)} (a stack of experts?)")
        dev = own["updates"].device
        loaded[name] = {k: _to_device(v, dev, factor_dtype if k in ("A", "G") else compute_dtype)
                        for k, v in saved.items()}
    return loaded
