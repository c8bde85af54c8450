"""Hyperparameter validation shared by every optimizer (MARS, MARS-M, MKOR, K-FAC, LAMB): each
failure is a ``ValueError`` that names the argument (torch.optim's convention), worded
``"<name>: expected <what>, got <value>"``."""
import math

import torch


def tensor_scalar(name, value):
    """The number a tensor hyperparameter holds (lr, betas, momentum: where torch.optim.AdamW
    takes a tensor, for a compiled step whose scheduler writes into it): one element, real
    floating point, on the CPU -- the step reads it on the host, where a CUDA tensor would
    synchronise."""
    _check_scalar_tensor(name, value)
    return value.item()


def host_value(name, value):
    """``value`` as the step reads it on the host: a number as it is, a tensor's number
    (``tensor_scalar``) -- or ``None`` for a tensor while ``torch.compile`` traces the step,
    whose value is data of the graph (a schedule writes it with ``fill_``): reading it would
    break the graph, so only what the trace fixes (one element, dtype, device) is checked."""
    if not torch.is_tensor(value):
        return value
    if torch.compiler.is_compiling():
        _check_scalar_tensor(name, value)
        return None
    return tensor_scalar(name, value)


def _check_scalar_tensor(name, value):
    if value.numel() != 1 or not value.is_floating_point() or value.is_cuda \
            or value.requires_grad:
        raise ValueError(f"{name}: a tensor {name} must be a one-element floating-point CPU "
                         f"tensor without grad, got {value!r}")


def check_number(name, value, low=None, high=None, high_open=False, *, low_open=False,
                 finite=False, tensor=False):
    """A real number (not a bool) in [low, high] (either end open on request); ``finite``
    also refuses +-inf.  NaN is always refused.  ``tensor``: a one-element CPU tensor is
    accepted too, and its value checked (``host_value``: not while a step is traced)."""
    if tensor and torch.is_tensor(value):
        value = host_value(name, value)
        if value is None:  # traced by torch.compile: the value is the graph's data
            return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: expected a number, got {value!r}")
    if finite and not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if value != value or below or above:
        if high is not None:
            interval = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        else:
            interval = f"{'>' if low_open else '>='} {low}"
        raise ValueError(f"{name}: expected a value {interval}, got {value!r}")


def check_int(name, value, low=None):
    """An int (not a bool), >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        raise ValueError(f"{name}: expected an int{'' if low is None else f' >= {low}'}, "
                         f"got {value!r}")


def check_matrix_batch_dims(group, matrix_batch_dims_of):
    """A group's ``matrix_batch_dims``: an int >= 0 under which every tensor of the group is
    either a stack of matrices or routes by its own shape --
    ``matrix_batch_dims_of(shape, matrix_batch_dims)`` (``mars_equations``'s, passed in)
    raises for any other; one ValueError names ``matrix_batch_dims`` and every such shape, so
    that nothing is guessed."""
    matrix_batch_dims = group["matrix_batch_dims"]
    check_int("matrix_batch_dims", matrix_batch_dims, low=0)
    bad = []
    for p in group["params"]:
        try:
            matrix_batch_dims_of(p.shape, matrix_batch_dims)
        except ValueError:
            bad.append(tuple(p.shape))
    if bad:
        raise ValueError(f"matrix_batch_dims={matrix_batch_dims}: the group's tensors must be "
                         f"stacks of matrices (ndim {matrix_batch_dims + 2}) or have ndim < 2; "
                         f"got shapes {bad} (put them in another parameter group; a 3-D "
                         "tensor is not taken for a stack of matrices unless its group says so)")


def check_bool(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected a bool, got {value!r}")


def check_betas(name, betas):
    """A pair in [0, 1), each a number or a one-element CPU tensor (as AdamW's betas)."""
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"{name}: expected a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        check_number(f"{name}[{i}]", b, low=0.0, high=1.0, high_open=True, tensor=True)


def check_ns_coefficients(value, orthogonalizer, ns_dtype):
    """``ns_coefficients`` (M13a): a schedule name, one (a, b, c) triple or a sequence of them,
    every coefficient finite; and ``orthogonalizer="gram_newton_schulz"`` not in float16, whose
    range the unnormalised X X^T (the Gram form normalises after it) overflows at entries
    beyond ~2^8 -- bfloat16 has float32's range."""
    import math

    from .matrix_functions import ns_schedule
    steps = 1 if isinstance(value, str) or not hasattr(value, "__len__") else len(value)
    schedule = ns_schedule(value, max(steps, 1))  # raises a ValueError naming ns_coefficients
    if not all(math.isfinite(x) for t in schedule for x in t):
        raise ValueError(f"ns_coefficients: every coefficient must be finite, got {value!r}")
    if orthogonalizer == "gram_newton_schulz" and ns_dtype == torch.float16:
        raise ValueError("orthogonalizer: 'gram_newton_schulz' forms X X^T before normalising, "
                         "which overflows float16; use ns_dtype=torch.bfloat16 (float32's "
                         "range) or float32")


def check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")


TORCH_FLAG_ADVICE = {
    "fused": "no fused kernel; use foreach=True or compiled=...",
    "capturable": "the step reads its CPU step counters on the host, which a CUDA graph "
                  "cannot capture",
    "differentiable": "the step runs under torch.no_grad and updates in place",
}


def check_torch_flags(owner, g):
    """The keywords other ``torch.optim`` optimizers take: ``fused`` None/False,
    ``capturable`` and ``differentiable`` False are accepted, ``True`` (or any other value)
    raises, naming the keyword, so that a group asking for them is never silently ignored."""
    for flag, allowed in (("fused", (None, False)), ("capturable", (False,)),
                          ("differentiable", (False,))):
        if flag == "capturable" and torch.compiler.is_compiling():
            continue  # dynamo's trace of a step reads every group's capturable as True
            #           (``OptimizerVariable._set_capturable``): the user's is not visible
        value = g.get(flag, False)
        if not any(value is a for a in allowed):
            raise ValueError(f"{owner}: {flag}={value!r} is not supported "
                             f"({TORCH_FLAG_ADVICE[flag]})")


def check_shared(name, groups, why):
    """Every group of ``groups`` holds the same ``name`` (a mode the step reads from the first
    group and applies to all); a ValueError naming it and ``why`` otherwise."""
    values = [g[name] for g in groups]
    if any(v != values[0] for v in values[1:]):
        raise ValueError(f"{name}: every parameter group must hold the same value ({why}), "
                         f"got {values!r}")
