"""The three ways the optimizers' elementwise equations run, behind one interface.

Each equation in ``mars_equations`` / ``mars_m_equations`` is written once against an ``ops``
table and runs unchanged on three kinds of operands:

* ``SINGLE``: one tensor, Python-number scalars (the ``torch.optim`` for-loop path).
* ``FOREACH``: lists of tensors, scalars a number or one number per tensor
  (``torch._foreach_*`` kernels; the multi-tensor path).
* ``COMPILED``: one tensor, scalars 0-d tensors, so that a ``torch.compile``d caller sees a
  schedule or a new step count as data, not as a new constant (no recompilation).

``each(f, x)`` maps a scalar function over per-tensor scalars (a list only under FOREACH), and
``decay_`` skips a zero weight decay only where that test is free (a Python number).

On the CPU, ``SINGLE`` and ``FOREACH`` round alike in every dtype (bf16 and fp16 included:
``theory_tests/mars/test_low_precision_paths.py``), because ``FOREACH`` multiplies by a number
through ``scalar_operand`` (below).

``FOREACH`` runs each equation as one ``torch._foreach_*`` call per :func:`foreach_groups`
group of its tensors (device, dtype, DTensor mesh): a model under expert parallelism holds
parameters on two meshes (torchtitan: dense ones on ``fsdp``, experts on ``(efsdp, ep)``), and
DTensor refuses one call that spans both (issue 48).  A foreach kernel is elementwise per
tensor, so the split changes no number; one group is the single call it always was.
"""
import torch

from .sharding import is_dtensor


def scalar_operand(s):
    """The scalar operand of an in-place ``torch._foreach_mul_``: a number as a 0-d float64
    CPU tensor (a per-tensor list: one each), a tensor as it is.

    Why: on the CPU, ``torch._foreach_mul_(xs, number)`` (and its list-of-numbers form) runs
    ``Tensor::mul_(Scalar)`` per tensor, which passes the number as the *first* operand, so
    bf16 / fp16 tensors take the number rounded to their own dtype (1 - lr wd = 0.997 ->
    0.99609375 in bf16: a decay 30 % too strong), where ``x.mul_(number)`` (``SINGLE``)
    multiplies by the float32 number and rounds once: MARS, MARS-M and LAMB's foreach paths
    were up to 4.6 ulps of a tensor's largest entry from their loops after 4 steps (40
    draws).  A 0-d CPU tensor takes the Tensor overload, which multiplies as
    ``x.mul_(number)`` does; float64 keeps a float64 number exact.  On CUDA the kernel reads a CPU 0-d tensor on the host (``.item()`` of a CPU
    tensor: no device sync) and runs its number kernel; DTensor replicates it.  Traced by
    ``torch.compile``, the number stays a number (Inductor multiplies in float32 anyway)."""
    if isinstance(s, list):
        return [scalar_operand(v) for v in s]
    if torch.is_tensor(s) or torch.compiler.is_compiling():
        return s
    return torch.tensor(s, dtype=torch.float64)


def foreach_key(t):
    """What the tensors of one ``torch._foreach_*`` call share: device, dtype and, for a
    DTensor, its device mesh (``None`` for a plain tensor).

    Why the mesh: DTensor runs a foreach op on one mesh, and makes a plain tensor operand
    (``scalar_operand``'s 0-d scalar; LAMB's stacked trust ratios) a replicated DTensor on
    the first tensor's mesh, so a list spanning two meshes fails ("Cannot run aten.mul.Tensor
    on inputs with different meshes").  Placements need no split: DTensor propagates each
    tensor of a foreach op on its own (``theory_tests/distributed/test_foreach_meshes.py``)."""
    return t.device, t.dtype, (t.device_mesh if is_dtensor(t) else None)


def foreach_groups(tensors):
    """The positions of ``tensors`` grouped by :func:`foreach_key`, groups in order of first
    appearance, positions ascending: the one rule by which MARS, MARS-M and LAMB batch
    tensors into foreach kernels."""
    groups = {}
    for i, t in enumerate(tensors):
        groups.setdefault(foreach_key(t), []).append(i)
    return list(groups.values())


def _per_group(kernel):
    """``kernel(x, *args)`` run once per :func:`foreach_groups` group of the list ``x``:
    every list argument is taken at the group's positions (they are parallel to ``x``:
    tensors, or one scalar per tensor), any other argument passed whole.  A list result is
    put back in ``x``'s order; an in-place kernel returns ``x`` itself."""
    def run(x, *args):
        groups = foreach_groups(x)
        if len(groups) == 1:
            return kernel(x, *args)
        out = [None] * len(x)
        for idx in groups:
            part = kernel([x[i] for i in idx],
                          *([a[i] for i in idx] if isinstance(a, list) else a for a in args))
            for i, r in zip(idx, part):
                out[i] = r
        return x if all(a is b for a, b in zip(out, x)) else out
    run.__name__ = kernel.__name__
    run.__doc__ = kernel.__doc__
    return run


class _Single:
    name = "single"

    @staticmethod
    def each(fn, x):
        return fn(x)

    @staticmethod
    def lerp_(x, y, w):
        return x.lerp_(y, w)

    @staticmethod
    def mul_(x, s):
        return x.mul_(s)

    @staticmethod
    def div_(x, s):
        return x.div_(s)

    @staticmethod
    def add_(x, s):
        return x.add_(s)

    @staticmethod
    def add_scaled_(x, y, s):
        return x.add_(y, alpha=s)

    @staticmethod
    def addcmul_(x, a, b, s):
        return x.addcmul_(a, b, value=s)

    @staticmethod
    def addcdiv_(x, a, b, s):
        return x.addcdiv_(a, b, value=s)

    @staticmethod
    def sqrt(x):
        return x.sqrt()

    @staticmethod
    def sign(x):
        return torch.sign(x)

    @staticmethod
    def maximum_(x, y):
        return torch.maximum(x, y, out=x)

    @staticmethod
    def copy_(x, y):
        return x.copy_(y)

    @staticmethod
    def norm(x):
        return torch.linalg.vector_norm(x)

    @staticmethod
    def divide_by_clamped_(x, divisor):
        """x / max(divisor, 1): the sync-free clip (M3)."""
        return x.div_(divisor.clamp(min=1.0))

    @classmethod
    def decay_(cls, p, lr, wd):
        if wd != 0.0:
            cls.mul_(p, 1.0 - lr * wd)


class _Foreach:
    """Every kernel runs per :func:`foreach_groups` group of its first list (``_per_group``)."""
    name = "foreach"

    @staticmethod
    def each(fn, x):
        return [fn(v) for v in x] if isinstance(x, list) else fn(x)

    @staticmethod
    @_per_group
    def lerp_(x, y, w):
        torch._foreach_lerp_(x, y, w)
        return x

    @staticmethod
    @_per_group
    def mul_(x, s):
        torch._foreach_mul_(x, scalar_operand(s))
        return x

    @staticmethod
    @_per_group
    def div_(x, s):
        torch._foreach_div_(x, s)
        return x

    @staticmethod
    @_per_group
    def add_(x, s):
        torch._foreach_add_(x, s)
        return x

    @staticmethod
    @_per_group
    def add_scaled_(x, y, s):
        if isinstance(s, list):
            torch._foreach_add_(x, torch._foreach_mul(y, s))
        else:
            torch._foreach_add_(x, y, alpha=s)
        return x

    @staticmethod
    @_per_group
    def addcmul_(x, a, b, s):
        torch._foreach_addcmul_(x, a, b, value=s) if not isinstance(s, list) \
            else torch._foreach_addcmul_(x, a, b, s)
        return x

    @staticmethod
    @_per_group
    def addcdiv_(x, a, b, s):
        torch._foreach_addcdiv_(x, a, b, s) if isinstance(s, list) \
            else torch._foreach_addcdiv_(x, a, b, value=s)
        return x

    @staticmethod
    @_per_group
    def sqrt(x):
        return torch._foreach_sqrt(x)

    @staticmethod
    @_per_group
    def sign(x):
        return torch._foreach_sign(x)

    @staticmethod
    @_per_group
    def maximum_(x, y):
        torch._foreach_maximum_(x, y)
        return x

    @staticmethod
    def copy_(x, y):
        for a, b in zip(x, y):  # DTensor has no sharding rule for _foreach_copy_
            a.copy_(b)
        return x

    @staticmethod
    @_per_group
    def norm(x):
        return list(torch._foreach_norm(x))

    @staticmethod
    @_per_group
    def divide_by_clamped_(x, divisors):
        torch._foreach_div_(x, torch._foreach_clamp_min(divisors, 1.0))
        return x

    @classmethod
    def decay_(cls, p, lr, wd):
        if wd != 0.0:
            cls.mul_(p, 1.0 - lr * wd)


class _Compiled(_Single):
    """Scalars are 0-d tensors: no ``value=``/``alpha=`` keyword (those take numbers) and no
    branch on a scalar's value (a graph break, and a host sync on CUDA)."""
    name = "compiled"

    @staticmethod
    def lerp_(x, y, w):
        return x.add_((y - x) * w)

    @staticmethod
    def add_scaled_(x, y, s):
        return x.add_(y * s)

    @staticmethod
    def addcmul_(x, a, b, s):
        return x.add_(a * b * s)

    @staticmethod
    def addcdiv_(x, a, b, s):
        return x.add_(a / b * s)

    @staticmethod
    def maximum_(x, y):
        return x.copy_(torch.maximum(x, y))

    @staticmethod
    def divide_by_clamped_(x, divisor):
        return x.div_(torch.clamp(divisor, min=1.0))

    @classmethod
    def decay_(cls, p, lr, wd):
        p.mul_(1.0 - lr * wd)


SINGLE, FOREACH, COMPILED = _Single(), _Foreach(), _Compiled()
