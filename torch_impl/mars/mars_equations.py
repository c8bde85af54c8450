"""MARS update math in PyTorch, one function per equation (mirrors
``reference/mars/mars_equations.py``).

Each equation is written once against an ``ops`` table (``tensor_ops``) and so serves every
path: the single-tensor loop (``SINGLE``), the multi-tensor kernels (``FOREACH``) and the
``torch.compile``d kernels (``COMPILED``, ``mars_compiled``).  The names are the oracle's; a
trailing ``_`` marks an in-place form.  ``resolve_hyperparameters`` is the one place that
turns a parameter group (or the functional's keywords) into the numbers a route uses.

Nothing here synchronises with the device: the clip divides by ``clamp(norm, min=1)``
instead of branching on the norm, and bias corrections come from CPU step counters.

A stack of matrices (``matrix_batch_dims``, issue 31: fused MoE experts as one (E, A, B)
parameter) is its matrices: routed as one of them (``matrix_batch_dims_of``), clipped per
matrix (``clip_matrices_``), scaled by each matrix's shape and orthogonalised per matrix
(``newton_schulz`` and ``orthogonalize_svd`` take batches).
"""
import itertools
import math
from typing import NamedTuple

import torch

from ..common.matrix_functions import gram_newton_schulz, newton_schulz, orthogonalize_svd
from ..common.scalars import step_scalar
from ..common.sharding import is_dtensor
from ..common.tensor_ops import SINGLE

ADAMW, LION, SHAMPOO, FALLBACK = "adamw", "lion", "shampoo", "fallback"


# ------------------------------------------------------------------ routing (2.5)

def takes_mars_path(shape, optimize_1d):
    """A tensor takes the mars_type update if it is 2-D or ``optimize_1d``; else (M14)."""
    return len(shape) == 2 or optimize_1d


def matrix_batch_dims_of(shape, matrix_batch_dims):
    r"""How many leading dims of a tensor of ``shape`` index independent matrices, in a group
    that declares ``matrix_batch_dims`` = k (fused MoE experts: one (E, A, B) parameter):

    * ndim = k + 2: k, a stack, each of whose A x B matrices takes the rule of a 2-D tensor
      (k = 0: a matrix, as without the option);
    * k = 0, or ndim < 2: 0, the tensor routes by its own shape, as without the option;
    * anything else (k >= 1, ndim >= 2, ndim != k + 2): a ValueError naming
      ``matrix_batch_dims``.  Nothing is guessed: a 3-D Conv1d kernel is not a stack of
      matrices, and a 2-D tensor among stacks is a mistake in the grouping.
    """
    if len(shape) == matrix_batch_dims + 2:
        return matrix_batch_dims
    if matrix_batch_dims == 0 or len(shape) < 2:
        return 0
    raise ValueError(
        f"matrix_batch_dims={matrix_batch_dims}: a tensor of ndim {matrix_batch_dims + 2} is a "
        f"stack of matrices and one of ndim < 2 takes the non-matrix rule; got shape "
        f"{tuple(shape)} (give it a parameter group with its own matrix_batch_dims)")


def route(shape, mars_type, optimize_1d, matrix_batch_dims=0):
    """The update a tensor takes: the mars_type rule, or the AdamW fallback (M14).
    MARS-Shampoo's non-2-D tensors (with ``optimize_1d``) take the AdamW rule; a stack of
    matrices (``matrix_batch_dims_of``) takes the rule of one of its matrices."""
    shape = tuple(shape)[matrix_batch_dims_of(shape, matrix_batch_dims):]
    if not takes_mars_path(shape, optimize_1d):
        return FALLBACK
    if mars_type == "mars-lion":
        return LION
    if mars_type == "mars-shampoo" and len(shape) == 2:
        return SHAMPOO
    return ADAMW


# ------------------------------------------------------------------ hyperparameters

class Hyper(NamedTuple):
    """The numbers one route uses at one step, by the constructor's names: the record every
    path reads (the loop and foreach kernels with Python numbers, per-tensor lists for the
    bias corrections under FOREACH; the compiled kernels with 0-d tensors: ``packed`` moves it
    to the device as one tensor, ``unpack`` names its fields again inside the kernel).
    MARS and MARS-M share it: MARS-M's ``momentum`` is its ``beta1``."""
    lr: object
    weight_decay: object
    gamma: object  # enters the equations as a = gamma beta1 / (1 - beta1) (M2)
    beta1: object
    beta2: object
    eps: object
    bc1: object = 1.0  # 1 - beta1^k
    sqrt_bc2: object = 1.0  # sqrt(1 - beta2^k)
    clip_divisor: object = 1.0  # the global clip's max(||c||, 1) (M3, clip_scope="global")
    scale: object = 1.0  # MARS-M's 0.2 sqrt(max(A, B)) (M17)

    def packed(self, device, dtype, **on_device):
        """The record as one tensor on ``device``, for the compiled kernels: one host-to-device
        copy (pinned and non-blocking on CUDA, which a pageable copy would synchronise), so
        that a new lr, bias correction or scale is new data, never a recompilation.
        ``on_device``: fields already held as 0-d tensors on the device (the global clip's
        divisor), written in after the copy.  The kernels read it back with ``unpack``."""
        values = torch.tensor([float(x) for x in self], dtype=dtype)
        if device.type == "cuda":
            values = values.pin_memory().to(device, non_blocking=True)
        else:
            values = values.to(device)
        for name, value in on_device.items():
            values[self._fields.index(name)] = value.to(dtype)
        return values

    @classmethod
    def unpack(cls, packed):
        """``packed``'s fields by name again (inside a compiled kernel: free; the one tensor
        keeps a kernel call to one guarded argument)."""
        return cls(*packed.unbind())


def resolve_hyperparameters(kind, *, lr, betas, eps, weight_decay, gamma, lr_1d_factor,
                            betas_1d, weight_decay_1d, weight_decay_1d_source):
    """The one resolver: the optimizer's keywords -> the route's ``Hyper``.

    MARS routes use (lr, weight_decay, betas, gamma); the fallback (M14) uses lr r,
    ``betas_1d``, no correction, and ``weight_decay_1d`` or the group's ``weight_decay``
    (``weight_decay_1d_source``)."""
    if kind == FALLBACK:
        beta1, beta2 = (_number(b) for b in betas_1d)
        if weight_decay_1d_source == "constructor":
            weight_decay = weight_decay_1d
        return Hyper(lr=_number(lr) * lr_1d_factor, weight_decay=weight_decay, gamma=0.0,
                     beta1=beta1, beta2=beta2, eps=eps)
    beta1, beta2 = (_number(b) for b in betas)
    return Hyper(lr=_number(lr), weight_decay=weight_decay, gamma=gamma, beta1=beta1,
                 beta2=beta2, eps=eps)


def with_bias_corrections(h, ks, ops):
    """``h`` with bc1 = 1 - beta1^k and sqrt(bc2) for step(s) ``ks`` (CPU numbers, or 0-d
    tensors while ``torch.compile`` traces the step: ``_step_count``)."""
    return h._replace(bc1=ops.each(lambda k: 1.0 - h.beta1**k, ks),
                      sqrt_bc2=ops.each(lambda k: _sqrt(1.0 - h.beta2**k), ks))


def _sqrt(x):
    return x.sqrt() if torch.is_tensor(x) else math.sqrt(x)


def _step_count(k):
    """A CPU step counter as the bias corrections take it: a Python number (a host read of a
    CPU tensor, no device sync), or the tensor itself while ``torch.compile`` traces the step
    (``torch.compile(opt.step)``), where a number would be a graph break and a new constant,
    hence a recompilation, at every step."""
    return k if torch.compiler.is_compiling() else k.item()


# A tensor hyperparameter (lr, betas; as torch.optim.AdamW accepts them) read as a number, or
# kept a tensor while torch.compile traces the step: common.scalars.step_scalar.
_number = step_scalar


# ------------------------------------------------------------------ equations (2.1-2.4)

def correction_coefficient(gamma, beta1):
    """a = gamma beta1 / (1 - beta1)."""
    return gamma * beta1 / (1.0 - beta1)


def shape_scale(shape):
    """s = sqrt(max(1, A / B)); 1 for an empty matrix, whose update is empty anyway."""
    return max(1.0, shape[0] / shape[1]) ** 0.5 if shape[1] else 1.0


def corrected_gradient_(g_prev, g, gamma, beta1, ops=SINGLE):
    r"""(M1)/(M2) in place: c_t = g_t + a (g_t - g_prev) = lerp(g_prev, g_t, 1 + a) with
    a = gamma beta1 / (1 - beta1), written into the buffer that held g_prev: one pass, no
    temporary.  g_prev is 0 at t = 1 and wherever the tensor had no gradient in the loss it
    is taken from (it did not enter that loss): after a step it sat out in approx mode
    (``exact_mode.forget_missing_gradients``), at x_{t-1} in exact mode."""
    return ops.lerp_(g_prev, g, 1.0 + correction_coefficient(gamma, beta1))


def clip_tensor_(c, norm, ops=SINGLE):
    r"""(M3), official scope: c <- c / max(||c||_F, 1), ``norm`` = ||c||_F of that tensor."""
    return ops.divide_by_clamped_(c, norm)


def clip_matrices_(c, matrix_batch_dims, ops=SINGLE):
    r"""(M3), official scope, on stacks: c <- c / max(||c||_F, 1) with the norm of the whole
    tensor, or of each matrix where c is a stack under ``matrix_batch_dims``
    (``matrix_batch_dims_of``: a stack's matrices are clipped as the 2-D parameters they stand
    for).  FOREACH: ``c`` is a list, one multi-tensor norm where no tensor is a stack."""
    if ops.name != "foreach":
        stack = matrix_batch_dims_of(c.shape, matrix_batch_dims) > 0
        if stack and torch.compiler.is_compiling() and c.device.type == "cpu":
            return _clip_each_matrix_(c, matrix_batch_dims, ops)
        return clip_tensor_(c, _matrix_norms(c) if stack else ops.norm(c), ops)
    stacks = [matrix_batch_dims_of(x.shape, matrix_batch_dims) > 0 for x in c]
    if not any(stacks):
        return clip_tensor_(c, ops.norm(c), ops)
    norms = [_matrix_norms(x) if stack else SINGLE.norm(x) for x, stack in zip(c, stacks)]
    return clip_tensor_(c, norms, ops)


def _clip_each_matrix_(c, matrix_batch_dims, ops):
    """``clip_matrices_`` one matrix view at a time (c a stack: ndim ``matrix_batch_dims`` +
    2), for ``torch.compile(opt.step)`` on the CPU: Inductor's C++ outer-loop fusion of a
    per-matrix norm with the in-place division of the stack raises (KeyError in
    ``try_outer_loop_fusion_with_local_buf``, torch 2.13)."""
    for i in itertools.product(*map(range, c.shape[:matrix_batch_dims])):
        clip_tensor_(c[i], ops.norm(c[i]), ops)
    return c


def _matrix_norms(c):
    """||C_i||_F of every matrix of a stack (..., A, B), kept as (..., 1, 1) so that each
    matrix is divided by its own (a DTensor sharded on the leading dims reduces locally)."""
    return torch.linalg.vector_norm(c, dim=(-2, -1), keepdim=True)


def clip_global_(cs, norms, ops=SINGLE):
    r"""(M3), paper scope: every c divided by max(sqrt(sum ||c_i||^2), 1), one norm for all."""
    if cs:
        total = global_norm(norms)
        if ops.name == "foreach":
            ops.divide_by_clamped_(cs, [total] * len(cs))
        else:
            for c in cs:
                ops.divide_by_clamped_(c, total)
    return cs


def global_norm(norms):
    """sqrt(sum ||c_i||^2) of per-tensor norms (one device), ``None`` for no tensors.

    Norms of DTensors on several device meshes (expert parallelism: dense tensors on one mesh,
    experts on another; issue 48) cannot share one stack: each mesh's norms are combined on
    that mesh, and those norms, made plain tensors (``full_tensor``: the same value on every
    rank), then combined.  Norms of one mesh (or none) are stacked as they always were, and
    DTensor norms mixed with plain ones still raise in the stack: a plain tensor's norm may be
    one rank's own, which no other rank would add."""
    if not norms:
        return None
    meshes = {}
    for n in norms:
        meshes.setdefault(n.device_mesh if is_dtensor(n) else None, []).append(n)
    if len(meshes) > 1 and None not in meshes:
        norms = [_full(_stacked_norm(ns)) for ns in meshes.values()]
    return _stacked_norm(norms)


def _stacked_norm(norms):
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))


def _full(x):
    return x.full_tensor() if is_dtensor(x) else x


def momentum_(m, c, beta1, ops=SINGLE):
    r"""(M4)  m <- beta1 m + (1 - beta1) c = lerp(m, c, 1 - beta1)."""
    return ops.lerp_(m, c, 1.0 - beta1)


def second_moment_(v, c, beta2, ops=SINGLE):
    r"""(M6)  v <- beta2 v + (1 - beta2) c * c."""
    ops.mul_(v, beta2)
    return ops.addcmul_(v, c, c, 1.0 - beta2)


def amsgrad_max_(v_max, v, ops=SINGLE):
    r"""(M9)  v-bar <- max(v-bar, v), used in place of v in (M7)."""
    return ops.maximum_(v_max, v)


def adamw_step_(p, m, v, h, ops=SINGLE):
    r"""(M7)+(M8)  p <- p (1 - lr wd) - (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps).

    Also (M14), the fallback, with its own ``h``.  One temporary (the denominator)."""
    denom = ops.sqrt(v)
    ops.div_(denom, h.sqrt_bc2)
    ops.add_(denom, h.eps)
    ops.decay_(p, h.lr, h.weight_decay)
    ops.addcdiv_(p, m, denom, ops.each(lambda b: -h.lr / b, h.bc1))


def lion_step_(p, m, h, ops=SINGLE):
    r"""(M10)  p <- p (1 - lr wd) - lr sign(m)."""
    ops.decay_(p, h.lr, h.weight_decay)
    ops.add_scaled_(p, ops.sign(m), -h.lr)


def shampoo_direction(m, beta1, eps, orthogonalizer, ns_steps, ns_dtype,
                      ns_coefficients="authors"):
    r"""(M11)/(M12)  O(m / (1 - beta1)): Newton-Schulz with the optimizer's eps (its schedule
    ``ns_coefficients``, M13a), the same through the Gram matrix (M13b), or U V^T.  A batch of
    same-shape matrices (..., A, B): each one's own O."""
    scaled = m * (1.0 / (1.0 - beta1))
    if orthogonalizer == "svd":
        return orthogonalize_svd(scaled)
    ns = gram_newton_schulz if orthogonalizer == "gram_newton_schulz" else newton_schulz
    return ns(scaled, steps=ns_steps, eps=eps, dtype=ns_dtype, coefficients=ns_coefficients)


def shampoo_step_(p, m, h, orthogonalizer, ns_steps, ns_dtype, scale=None, direction=None,
                  ns_coefficients="authors"):
    r"""(M12)  p <- p (1 - lr wd) - lr s O(m / (1 - beta1)); ``scale`` overrides s = s(p.shape)
    (a parameter stored transposed, e.g. transformers' Conv1D, gives its true shape); a stack
    of matrices (..., A, B) takes the s of its A x B matrices and O of each.
    ``direction``: O(m / (1 - beta1)) when already computed (``functional``'s owner-rank
    orthogonalisation of sharded matrices, ``sharding.orthogonalize_on_owners``)."""
    if p.numel() == 0:  # nothing to orthogonalize (and an empty SVD has no max)
        return
    if direction is None:
        direction = shampoo_direction(m, h.beta1, h.eps, orthogonalizer, ns_steps, ns_dtype,
                                      ns_coefficients)
    SINGLE.decay_(p, h.lr, h.weight_decay)
    if scale is None and p.ndim > 2:  # a stack: its matrices' s, not the stack's shape's
        scale = shape_scale(p.shape[-2:])
    p.add_(direction, alpha=-h.lr * (shape_scale(p.shape) if scale is None else scale))


# ------------------------------------------------------------------ the rules, per route

def adamw_rule_(p, c, m, v, v_max, h, ops=SINGLE):
    """(M4), (M6), (M9), (M7)+(M8) given the clipped corrected gradient (or raw g for M14)."""
    momentum_(m, c, h.beta1, ops)
    second_moment_(v, c, h.beta2, ops)
    if v_max is not None:
        v = amsgrad_max_(v_max, v, ops)
    adamw_step_(p, m, v, h, ops)


def lion_rule_(p, c, m, h, ops=SINGLE):
    """(M4), (M10)."""
    momentum_(m, c, h.beta1, ops)
    lion_step_(p, m, h, ops)
