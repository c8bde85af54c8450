"""MARS update math in PyTorch, one function per equation (mirrors ``reference/mars.py``).

Every equation exists twice with the same arithmetic, in the ``torch.optim`` manner: a
single-tensor form (``name_``) and a multi-tensor form (``foreach_name_``) built from
``torch._foreach_*`` kernels.  ``single_tensor_*`` / ``multi_tensor_*`` run a whole phase of a
step over a parameter group; ``torch_impl.mars.MARS`` strings the phases together.

Nothing here synchronises with the device: clipping divides by ``clamp(norm, min=1)``
instead of branching on the norm, and bias corrections come from CPU step counters.
"""
import math
from collections import defaultdict

import torch

from .matrix_functions import newton_schulz, orthogonalize_svd

ADAMW, LION, SHAMPOO, FALLBACK = "adamw", "lion", "shampoo", "fallback"


def route(param, mars_type, optimize_1d):
    """Which update a tensor takes (spec 2.5): the mars_type rule if 2-D or ``optimize_1d``,
    else the AdamW fallback (M14).  MARS-Shampoo's non-2-D tensors take the AdamW rule."""
    if param.ndim != 2 and not optimize_1d:
        return FALLBACK
    if mars_type == "mars-lion":
        return LION
    if mars_type == "mars-shampoo" and param.ndim == 2:
        return SHAMPOO
    return ADAMW


def correction_coefficient(gamma, beta1):
    """a = gamma beta1 / (1 - beta1)."""
    return gamma * beta1 / (1.0 - beta1)


def shape_scale(shape):
    """s = sqrt(max(1, A / B)); 1 for an empty matrix, whose update is empty anyway."""
    return max(1.0, shape[0] / shape[1]) ** 0.5 if shape[1] else 1.0


# ------------------------------------------------------------------ single-tensor equations

def corrected_gradient_(g_prev, g, a):
    r"""(M1)/(M2) in place: c_t = g_t + a (g_t - g_prev) = lerp(g_prev, g_t, 1 + a), written
    into the buffer that held g_prev: one pass, no temporary."""
    return g_prev.lerp_(g, 1.0 + a)


def momentum_(m, c, beta1):
    r"""(M4)  m <- beta1 m + (1 - beta1) c = lerp(m, c, 1 - beta1)."""
    return m.lerp_(c, 1.0 - beta1)


def second_moment_(v, c, beta2):
    r"""(M6)  v <- beta2 v + (1 - beta2) c * c."""
    return v.mul_(beta2).addcmul_(c, c, value=1.0 - beta2)


def adamw_step_(p, m, v, k, lr, beta1, beta2, eps, weight_decay):
    r"""(M7)+(M8)  p <- p (1 - lr wd) - (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps).

    Also (M14), the AdamW fallback, called with lr r, betas_1d and weight_decay_1d.
    ``v`` is v-bar (M9) under amsgrad.  One temporary (the denominator).
    """
    bc1, bc2 = 1.0 - beta1**k, 1.0 - beta2**k
    denom = v.sqrt().div_(math.sqrt(bc2)).add_(eps)
    if weight_decay != 0.0:
        p.mul_(1.0 - lr * weight_decay)
    p.addcdiv_(m, denom, value=-lr / bc1)


def lion_step_(p, m, lr, weight_decay):
    r"""(M10)  p <- p (1 - lr wd) - lr sign(m)."""
    if weight_decay != 0.0:
        p.mul_(1.0 - lr * weight_decay)
    p.add_(torch.sign(m), alpha=-lr)


def shampoo_direction(m, beta1, eps, orthogonalizer, ns_steps, ns_dtype):
    r"""(M11)/(M12)  O(m / (1 - beta1)): Newton-Schulz with the optimizer's eps, or U V^T."""
    scaled = m * (1.0 / (1.0 - beta1))
    if orthogonalizer == "svd":
        return orthogonalize_svd(scaled)
    return newton_schulz(scaled, steps=ns_steps, eps=eps, dtype=ns_dtype)


def shampoo_step_(p, m, lr, beta1, eps, weight_decay, orthogonalizer, ns_steps, ns_dtype):
    r"""(M12)  p <- p (1 - lr wd) - lr s O(m / (1 - beta1))."""
    if p.numel() == 0:  # nothing to orthogonalize (and an empty SVD has no max)
        return
    direction = shampoo_direction(m, beta1, eps, orthogonalizer, ns_steps, ns_dtype)
    if weight_decay != 0.0:
        p.mul_(1.0 - lr * weight_decay)
    p.add_(direction, alpha=-lr * shape_scale(p.shape))


# ------------------------------------------------------------------ multi-tensor equations

def foreach_corrected_gradient_(g_prevs, gs, a):
    torch._foreach_lerp_(g_prevs, gs, 1.0 + a)


def foreach_momentum_(ms, cs, beta1):
    torch._foreach_lerp_(ms, cs, 1.0 - beta1)


def foreach_second_moment_(vs, cs, beta2):
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, cs, cs, value=1.0 - beta2)


def foreach_adamw_step_(ps, ms, vs, ks, lr, beta1, beta2, eps, weight_decay):
    denoms = torch._foreach_sqrt(vs)
    torch._foreach_div_(denoms, [math.sqrt(1.0 - beta2**k) for k in ks])
    torch._foreach_add_(denoms, eps)
    if weight_decay != 0.0:
        torch._foreach_mul_(ps, 1.0 - lr * weight_decay)
    torch._foreach_addcdiv_(ps, ms, denoms, [-lr / (1.0 - beta1**k) for k in ks])


def foreach_lion_step_(ps, ms, lr, weight_decay):
    if weight_decay != 0.0:
        torch._foreach_mul_(ps, 1.0 - lr * weight_decay)
    torch._foreach_add_(ps, torch._foreach_sign(ms), alpha=-lr)


# ------------------------------------------------------------------ phases over a group

def single_tensor_correct(grads, last_grads, a):
    """Phase 1: c_t into each ``last_grad`` buffer; returns the per-tensor norms ||c_t||_F."""
    norms = []
    for g, buf in zip(grads, last_grads):
        corrected_gradient_(buf, g, a)
        norms.append(torch.linalg.vector_norm(buf))
    return norms


def multi_tensor_correct(grads, last_grads, a):
    if not grads:
        return []
    foreach_corrected_gradient_(last_grads, grads, a)
    return list(torch._foreach_norm(last_grads))


def single_tensor_divide(cs, divisors):
    """Phase 2, the clip (M3): c <- c / max(||.||, 1), with the tensor's or the global norm."""
    for c, d in zip(cs, divisors):
        c.div_(d.clamp(min=1.0))


def multi_tensor_divide(cs, divisors):
    if cs:
        torch._foreach_div_(cs, torch._foreach_clamp_min(divisors, 1.0))


def single_tensor_update(bucket, hp):
    """Phase 3: the update of every tensor of one group, by its route."""
    b1, b2 = hp["betas"]
    for p, g, c, st, kind in zip(*bucket):
        k = st["step"].item()  # a CPU counter: no device synchronisation
        if kind == FALLBACK:  # (M14) on the raw gradient
            f1, f2 = hp["betas_1d"]
            momentum_(st["exp_avg"], g, f1)
            second_moment_(st["exp_avg_sq"], g, f2)
            adamw_step_(p, st["exp_avg"], st["exp_avg_sq"], k, hp["lr"] * hp["lr_1d_factor"],
                        f1, f2, hp["eps"], hp["wd_1d"])
            continue
        m = momentum_(st["exp_avg"], c, b1)
        if kind == LION:
            lion_step_(p, m, hp["lr"], hp["weight_decay"])
        elif kind == SHAMPOO:
            shampoo_step_(p, m, hp["lr"], b1, hp["eps"], hp["weight_decay"],
                          hp["orthogonalizer"], hp["ns_steps"], hp["ns_dtype"])
        else:
            v = second_moment_(st["exp_avg_sq"], c, b2)
            if hp["amsgrad"]:
                v = torch.maximum(st["max_exp_avg_sq"], v, out=st["max_exp_avg_sq"])
            adamw_step_(p, m, v, k, hp["lr"], b1, b2, hp["eps"], hp["weight_decay"])


def multi_tensor_update(bucket, hp):
    b1, b2 = hp["betas"]
    groups = defaultdict(list)  # one foreach call per (route, device, dtype)
    for i, (p, kind) in enumerate(zip(bucket[0], bucket[4])):
        groups[(kind, p.device, p.dtype)].append(i)
    for (kind, _, _), idx in groups.items():
        ps, gs, cs, sts = ([bucket[j][i] for i in idx] for j in range(4))
        ks = [st["step"].item() for st in sts]  # CPU counters
        ms = [st["exp_avg"] for st in sts]
        if kind == FALLBACK:
            f1, f2 = hp["betas_1d"]
            vs = [st["exp_avg_sq"] for st in sts]
            foreach_momentum_(ms, gs, f1)
            foreach_second_moment_(vs, gs, f2)
            foreach_adamw_step_(ps, ms, vs, ks, hp["lr"] * hp["lr_1d_factor"], f1, f2,
                                hp["eps"], hp["wd_1d"])
            continue
        foreach_momentum_(ms, cs, b1)
        if kind == LION:
            foreach_lion_step_(ps, ms, hp["lr"], hp["weight_decay"])
        elif kind == SHAMPOO:  # the orthogonalizer is a matrix function: one call per tensor
            for p, m in zip(ps, ms):
                shampoo_step_(p, m, hp["lr"], b1, hp["eps"], hp["weight_decay"],
                              hp["orthogonalizer"], hp["ns_steps"], hp["ns_dtype"])
        else:
            vs = [st["exp_avg_sq"] for st in sts]
            foreach_second_moment_(vs, cs, b2)
            if hp["amsgrad"]:
                vmax = [st["max_exp_avg_sq"] for st in sts]
                torch._foreach_maximum_(vmax, vs)
                vs = vmax
            foreach_adamw_step_(ps, ms, vs, ks, hp["lr"], b1, b2, hp["eps"], hp["weight_decay"])
