"""The functional API's argument checks: parallel lists of one length, every route named as
the equations name it, and every buffer a route updates present and shaped like its
parameter -- all before the first write, so that a call the lists do not describe changes
nothing (``zip`` would otherwise run on the pairs it keeps while the step counters of the
others advance, and an unknown route would take another route's rule).

``functional.mars`` and ``functional.mars_m`` call ``check_lists`` first; the optimizers
build their lists with these routes, so the checks cost their step a few Python
comparisons per tensor.
"""
import torch

__all__ = ["check_lists"]


def check_lists(fn, params, columns, kinds, needs, *, matrices=(), optional=(),
                matrix_batch_dims=0):
    """ValueError (naming ``fn``'s argument) unless ``kinds`` and every list of ``columns``
    (name -> list) have ``len(params)`` entries, each ``kinds[i]`` is a key of ``needs``
    (route -> names of the columns that route reads and writes), each needed entry is a
    tensor of its parameter's shape, and the parameter of a route in ``matrices`` has
    ``matrix_batch_dims`` + 2 dims (2: a matrix; more: a stack of matrices);
    ``optional`` names columns that may also be ``None`` as a whole."""
    n = len(params)
    columns = dict(columns, kinds=kinds)
    for name, column in columns.items():
        if column is None and name in optional:
            continue
        if column is None or len(column) != n:
            got = "None" if column is None else len(column)
            raise ValueError(f"{fn}: {name} must have one entry per parameter ({n}), got {got}")
    for i, kind in enumerate(kinds):
        if kind not in needs:
            raise ValueError(f"{fn}: kinds[{i}]: expected one of {tuple(needs)}, got {kind!r}"
                             f"{_route_hint(fn)}")
        shape = params[i].shape
        if kind in matrices and len(shape) != matrix_batch_dims + 2:
            stack = "" if matrix_batch_dims == 0 else (
                f" (a stack of ndim {matrix_batch_dims + 2}: "
                f"matrix_batch_dims={matrix_batch_dims})")
            raise ValueError(f"{fn}: kinds[{i}]: route {kind!r} orthogonalises a matrix{stack}, "
                             f"got a parameter of shape {tuple(shape)}")
        for name in needs[kind]:
            t = columns[name][i]
            if not torch.is_tensor(t):
                raise ValueError(f"{fn}: {name}[{i}]: route {kind!r} updates this buffer, "
                                 f"got {type(t).__name__}")
            if t.shape != shape:
                raise ValueError(f"{fn}: {name}[{i}]: shape {tuple(t.shape)} differs from "
                                 f"its parameter's {tuple(shape)}")
    for i, k in enumerate(columns["state_steps"]):
        if not (torch.is_tensor(k) and k.numel() == 1 and not k.is_cuda):
            raise ValueError(f"{fn}: state_steps[{i}]: expected a one-element CPU tensor (the "
                             f"step counter, advanced in place), got {k!r}")


def _route_hint(fn):
    if fn == "mars":
        return (" (the route of a tensor, not a mars_type: "
                "mars_equations.route(p.shape, mars_type, optimize_1d))")
    return " (mars_m_equations.MATRIX, EFFICIENT or BACKUP)"
