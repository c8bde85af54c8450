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
"""
import torch


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
    name = "foreach"

    @staticmethod
    def each(fn, x):
        return [fn(v) for v in x] if isinstance(x, list) else fn(x)

    @staticmethod
    def lerp_(x, y, w):
        torch._foreach_lerp_(x, y, w)
        return x

    @staticmethod
    def mul_(x, s):
        torch._foreach_mul_(x, scalar_operand(s))
        return x

    @staticmethod
    def div_(x, s):
        torch._foreach_div_(x, s)
        return x

    @staticmethod
    def add_(x, s):
        torch._foreach_add_(x, s)
        return x

    @staticmethod
    def add_scaled_(x, y, s):
        if isinstance(s, list):
            torch._foreach_add_(x, torch._foreach_mul(y, s))
        else:
            torch._foreach_add_(x, y, alpha=s)
        return x

    @staticmethod
    def addcmul_(x, a, b, s):
        torch._foreach_addcmul_(x, a, b, value=s) if not isinstance(s, list) \
            else torch._foreach_addcmul_(x, a, b, s)
        return x

    @staticmethod
    def addcdiv_(x, a, b, s):
        torch._foreach_addcdiv_(x, a, b, s) if isinstance(s, list) \
            else torch._foreach_addcdiv_(x, a, b, value=s)
        return x

    @staticmethod
    def sqrt(x):
        return torch._foreach_sqrt(x)

    @staticmethod
    def sign(x):
        return torch._foreach_sign(x)

    @staticmethod
    def maximum_(x, y):
        torch._foreach_maximum_(x, y)
        return x

    @staticmethod
    def copy_(x, y):
        for a, b in zip(x, y):  # DTensor has no sharding rule for _foreach_copy_
            a.copy_(b)
        return x

    @staticmethod
    def norm(x):
        return list(torch._foreach_norm(x))

    @staticmethod
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
