"""The ``compiled=True`` path of ``MARS``: the elementwise math of one tensor's step as a
``torch.compile``d function, so Inductor fuses it into one pass over p, g, g_prev, m, v
(plus one reduction pass for the per-tensor clip norm) instead of ~12 eager kernels.

Same equations as ``mars_functional`` (M1-M10, M14), written out elementwise.  Everything that
changes between steps -- lr, the bias corrections, the global clip divisor -- enters as a
tensor ``hp`` so that neither a schedule nor the step count triggers recompilation, and shapes
are dynamic so one compilation serves every tensor of a rank.  MARS-Shampoo's matrices keep
the eager path: Newton-Schulz is matmul-bound and gains nothing from elementwise fusion.
"""
import torch

# layout of the hyperparameter vector ``hp`` (one per group, device and step count)
LR, WD, A, BETA1, BETA2, EPS, BC1, SQRT_BC2, DIVISOR = range(9)


def _corrected(g, last, hp, tensor_clip):
    r"""(M1)-(M3): c~ = c / max(||c||, 1) (tensor scope) or c / divisor (global: the clamped
    global norm; no clip: 1), with c = g + a (g - g_prev).  Under maximize, g arrives
    negated (``MARS._init_group``)."""
    c = g + hp[A] * (g - last)
    if tensor_clip:
        return c / torch.clamp(torch.linalg.vector_norm(c), min=1.0)
    return c / hp[DIVISOR]


def _adam_update(p, c, m, v, vmax, hp):
    r"""(M4), (M6)-(M9) given the clipped corrected gradient c."""
    m_new = m + (1 - hp[BETA1]) * (c - m)
    v_new = hp[BETA2] * v + (1 - hp[BETA2]) * c * c
    if vmax is not None:
        v_new_max = torch.maximum(vmax, v_new)
        vmax.copy_(v_new_max)
        denom = torch.sqrt(v_new_max) / hp[SQRT_BC2] + hp[EPS]
    else:
        denom = torch.sqrt(v_new) / hp[SQRT_BC2] + hp[EPS]
    p.copy_(p * (1 - hp[LR] * hp[WD]) - (hp[LR] / hp[BC1]) * m_new / denom)
    m.copy_(m_new)
    v.copy_(v_new)


def adamw_kernel(p, g, last, m, v, vmax, hp, tensor_clip: bool, write_last: bool):
    r"""(M1)-(M9) for one tensor."""
    c = _corrected(g, last, hp, tensor_clip)
    _adam_update(p, c, m, v, vmax, hp)
    if write_last:
        last.copy_(g)


def fallback_kernel(p, g, m, v, hp):
    r"""(M14): AdamW on the raw gradient (hp carries lr r, betas_1d, weight_decay_1d)."""
    _adam_update(p, g, m, v, None, hp)


def lion_kernel(p, g, last, m, hp, tensor_clip: bool, write_last: bool):
    r"""(M1)-(M4), (M10) for one tensor."""
    c = _corrected(g, last, hp, tensor_clip)
    m_new = m + (1 - hp[BETA1]) * (c - m)
    p.copy_(p * (1 - hp[LR] * hp[WD]) - hp[LR] * torch.sign(m_new))
    m.copy_(m_new)
    if write_last:
        last.copy_(g)


def corrected_norm_kernel(g, last, hp):
    """||c_t|| without materialising c_t: the first pass of the global clip."""
    return torch.linalg.vector_norm(g + hp[A] * (g - last))


_compiled = {}


def compiled(fn):
    """``torch.compile(fn, dynamic=True, fullgraph=True)``, created once per function."""
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=True, fullgraph=True)
    return _compiled[fn]


def hyperparameters(device, dtype, lr, wd, a, beta1, beta2, eps, k, divisor=None):
    """The ``hp`` vector for one group, device and step count k."""
    values = [lr, wd, a, beta1, beta2, eps, 1.0 - beta1**k, (1.0 - beta2**k) ** 0.5, 1.0]
    hp = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":  # a pageable host-to-device copy would synchronise the stream
        hp = hp.pin_memory().to(device, non_blocking=True)
    else:
        hp = hp.to(device)
    if divisor is not None:  # the global clip's clamped norm, already on the device
        hp[DIVISOR] = divisor.to(dtype)
    return hp


def _hp(cache, group, p, k, kind, divisor):
    """One ``hp`` per (device, dtype, step, route) within a group's step."""
    key = (p.device, p.dtype, k, kind)
    if key not in cache:
        if kind == "fallback":  # (M14): AdamW on the raw g with the 1-D hyperparameters
            b1, b2 = group["betas_1d"]
            lr, a, div = group["lr"] * group["lr_1d_factor"], 0.0, None
            wd = (group["weight_decay_1d"] if group["weight_decay_1d_source"] == "constructor"
                  else group["weight_decay"])
        else:
            (b1, b2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
            a, div = group["gamma"] * b1 / (1.0 - b1), divisor
        dtype = torch.promote_types(p.dtype, torch.float32)
        cache[key] = hyperparameters(p.device, dtype, lr, wd, a, b1, b2, group["eps"], k, div)
    return cache[key]


def _flat(*tensors):
    """1-D views with a dynamic length, so one compilation serves every contiguous tensor
    (dynamo otherwise specialises on each rank and size); non-contiguous tensors pass as they
    are (and cost a compilation per layout)."""
    if not all(t is None or t.is_contiguous() for t in tensors):
        return tensors
    flat = []
    for t in tensors:
        if t is not None:
            t = t.view(-1)
            torch._dynamo.maybe_mark_dynamic(t, 0)
        flat.append(t)
    return flat


def _over_lists(kernel):
    """``kernel`` applied to every row of column lists, as one function (compiled once per
    group in ``compiled="group"`` mode: one call and one guard check for the whole group)."""
    def run(columns, hp, *flags):
        return [kernel(*row, hp, *flags) for row in zip(*columns)]
    run.__name__ = f"{kernel.__name__}_over_lists"
    return run


_listed = {}


def _run(calls, grouped):
    """Execute ``(kernel, tensors, hp, flags)`` calls one by one (``compiled="tensor"``) or
    batched by (kernel, hp, flags) into one compiled call each (``compiled="group"``)."""
    if not grouped:
        return [compiled(kernel)(*tensors, hp, *flags) for kernel, tensors, hp, flags in calls]
    batches = {}
    for kernel, tensors, hp, flags in calls:
        batches.setdefault((kernel, id(hp), flags), (hp, []))[1].append(tensors)
    out = []
    for (kernel, _, flags), (hp, rows) in batches.items():
        if kernel not in _listed:
            _listed[kernel] = torch.compile(_over_lists(kernel), dynamic=True, fullgraph=True)
        out += _listed[kernel]([list(col) for col in zip(*rows)], hp, *flags)
    return out


def global_norms(group, bucket):
    """Per-tensor ||c_t|| of a compiled group's MARS-path tensors (global clip, first pass)."""
    cache = {}
    calls = [(corrected_norm_kernel, _flat(g, st["last_grad"]),
              _hp(cache, group, p, st["step"].item(), kind, None), ())
             for p, g, st, kind in zip(bucket.params, bucket.grads, bucket.states, bucket.kinds)
             if kind != "fallback"]
    return _run(calls, group["compiled"] == "group")


def update(group, bucket, total, exact):
    """Phase 1-3 of every tensor in ``bucket`` (AdamW, Lion and fallback routes): one compiled
    kernel call per tensor, or per batch of same-route tensors in ``compiled="group"`` mode.
    ``total``: the clamped global norm (global scope only)."""
    scope, cache, calls = group["clip_scope"], {}, []
    divisor = None
    if scope == "global":
        divisor = torch.clamp(total, min=1.0)
    flags = (scope == "tensor", not exact)  # (tensor_clip, write_last)
    for p, g, st, kind in zip(bucket.params, bucket.grads, bucket.states, bucket.kinds):
        hp = _hp(cache, group, p, st["step"].item(), kind, divisor)  # CPU counter: no sync
        if kind == "fallback":
            calls.append((fallback_kernel, _flat(p, g, st["exp_avg"], st["exp_avg_sq"]), hp, ()))
        elif kind == "lion":
            calls.append((lion_kernel, _flat(p, g, st["last_grad"], st["exp_avg"]), hp, flags))
        else:
            vmax = st.get("max_exp_avg_sq") if group["amsgrad"] else None
            calls.append((adamw_kernel, _flat(p, g, st["last_grad"], st["exp_avg"],
                                              st["exp_avg_sq"], vmax), hp, flags))
    _run(calls, group["compiled"] == "group")
