"""Exact mode (M1) for MARS and MARS-M: grad f(x_{t-1}, xi_t), the current batch at the previous
iterate, obtained two ways.

* ``evaluate_at_previous_then_current`` (recommended): the step's closure is evaluated at
  x_{t-1} (kept in ``state["prev_param"]``) and then at x_t, with the RNG state restored in
  between, so both gradients see the same sample.
* ``update_previous_grad`` / ``update_last_grad``: the authors' loop (``train_mars.py``), which
  computes the *next* batch's gradient at x_t before stepping and hands it over after the step.

Both leave grad f(x_{t-1}, xi_t) in ``state["last_grad"]``; the update then runs as in approx
mode, without overwriting ``last_grad`` with g_t.

Under a ``torch.amp.GradScaler`` (which refuses closures) the authors' loop must hand the
scaler to ``update_previous_grad(grad_scaler=...)``: the stored gradient is then unscaled like
``.grad`` is by ``scaler.step``.  ``GradScaler.step`` reads ``_step_supports_amp_scaling`` on
the optimizer just before stepping; the optimizers note it (``note_grad_scaler``) so that a
loop that stored scaled gradients is warned about once (``warn_if_scaled_previous_grad``).
"""
import warnings

import torch

from ..common.state_storage import G_PREV, write_state


def evaluate_at_previous_then_current(opt, closure):
    """Exact mode (M1): fill ``last_grad`` with grad f(x_{t-1}, xi_t), then evaluate at x_t.

    x_{t-1} is kept in ``prev_param``; the swap copies x_t aside and reuses that copy as the
    next ``prev_param``, so exact mode holds one extra parameter-sized buffer.
    """
    params = [p for group in opt.param_groups for p in group["params"]]
    returning = [p for p in params if p in opt.state and holds_previous_iterate(opt.state[p])]
    returning_set = set(returning)
    rng = _rng_state(params)
    if returning:
        current = [p.detach().clone() for p in returning]
        for p in returning:
            p.copy_(opt.state[p]["prev_param"])
        opt.zero_grad(set_to_none=True)
        with torch.enable_grad():
            closure()
        try:  # refuse an unsupported gradient before last_grad or prev_param change
            opt._check_gradients()  # noqa: SLF001
        except RuntimeError:
            for p, x_now in zip(returning, current):
                p.copy_(x_now)
            _set_rng_state(rng)
            raise
        for index, group in enumerate(opt.param_groups):
            for position, p in enumerate(group["params"]):
                buf = opt.state[p].get("last_grad") if p in returning_set else None
                if buf is None:
                    continue
                if p.grad is None:  # p did not enter the loss at x_{t-1}
                    buf.zero_()
                else:  # g_prev of the step about to count: rounded as the group says
                    write_state(group, index, position, buf,
                                -p.grad if group["maximize"] else p.grad, G_PREV,
                                float(opt.state[p]["step"]) + 1)
        for p, x_t in zip(returning, current):
            p.copy_(x_t)
            opt.state[p]["prev_param"] = x_t
        _set_rng_state(rng)  # the same sample xi_t (dropout masks included) at x_t
    opt.zero_grad(set_to_none=True)
    with torch.enable_grad():
        loss = closure()
    opt._check_gradients()  # noqa: SLF001  (a first step's prev_param is not kept either)
    for p in params:
        if p not in returning_set and p.grad is not None:  # its first step: x_t is kept
            st = opt.state[p]
            if "prev_param" in st:  # init_state's placeholder
                st["prev_param"].copy_(p.detach())
            else:
                st["prev_param"] = p.detach().clone()
    return loss


def holds_previous_iterate(st):
    """Whether ``st["prev_param"]`` is x_{t-1}: it is there and the tensor has taken a step.
    ``init_state`` creates it as zeros before the first step (a checkpoint template must
    name it, or DCP and torchtitan's flat layout do not load it back), so presence alone
    does not say it; the step counter does, since the first step that gives the tensor a
    gradient keeps x_t as ``prev_param`` and counts. ``step`` is a CPU tensor, read itself
    (no device read, no temporary)."""
    return "prev_param" in st and float(st.get("step", 0)) > 0


@torch.no_grad()
def init_previous_iterates(opt, params):
    """Exact mode's ``prev_param`` for ``init_state``: zeros like each of ``params`` that has
    none (a DTensor parameter gets a DTensor), a placeholder until the tensor's first step
    (``holds_previous_iterate``). Approx mode keeps no x_{t-1}: nothing is created."""
    if opt.param_groups[0]["is_approx"]:
        return
    for p in params:
        st = opt.state[p]
        if "prev_param" not in st:
            st["prev_param"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def forget_missing_gradients(opt):
    """Approx mode (M2): g_{t-1} = grad f(x_{t-1}, xi_{t-1}) is 0 for a tensor that had no
    gradient at step t-1 -- it did not enter that loss -- so its ``last_grad`` becomes 0 on
    that step (the tensor itself is skipped, as torch.optim skips it), and its next step
    corrects from 0, the recursion's start, as exact mode's g_prev of such a tensor is 0
    (``evaluate_at_previous_then_current``).  Otherwise the next correction would take the
    gradient of the last step the tensor took part in, at another point and batch.
    Traced by ``torch.compile(opt.step)`` (it is not part of ``_init_group``, which dynamo
    runs once, eagerly); a tensor idle for many steps is zeroed at each of them."""
    for group in opt.param_groups:
        if not group["is_approx"]:
            continue
        for p in group["params"]:
            if p.grad is None and p in opt.state and "last_grad" in opt.state[p]:
                opt.state[p]["last_grad"].zero_()


@torch.no_grad()
def update_previous_grad(opt, keeps_last_grad, grad_scaler=None):
    """``previous_grad`` <- a copy of ``p.grad`` (negated under maximize) for every parameter
    with a gradient that uses ``last_grad`` (``keeps_last_grad(p, group)``).  A parameter
    without a gradient did not enter the next batch's loss, so its g_prev is 0 (as in
    ``forget_missing_gradients``): a ``previous_grad`` it holds is zeroed, and one is made
    (zero) where it has a ``last_grad`` (the authors skip it and print a line, which leaves
    the previous g_prev to ``update_last_grad``).  No-op in approx mode.

    ``grad_scaler`` (an enabled ``torch.amp.GradScaler``): the copies are divided by its
    current scale, a tensor (no host sync); if any of them is not finite, all of them become
    0 (``unscale_stored``)."""
    stored = []
    for group in opt.param_groups:
        if group["is_approx"]:
            continue
        for p in group["params"]:
            if not keeps_last_grad(p, group):
                continue
            if p.grad is None:  # outside the next batch's loss: g_prev = 0
                st = opt.state.get(p, {})
                if "previous_grad" in st:
                    st["previous_grad"].zero_()
                elif "last_grad" in st:
                    st["previous_grad"] = torch.zeros_like(st["last_grad"])
                continue
            st = opt.state[p]
            g = -p.grad if group["maximize"] else p.grad
            if "previous_grad" in st:
                st["previous_grad"].copy_(g)
            else:
                st["previous_grad"] = g.detach().clone(memory_format=torch.preserve_format)
            stored.append(st["previous_grad"])
    opt._previous_grad_scaled = grad_scaler is None and bool(stored)  # noqa: SLF001
    if grad_scaler is not None and stored:
        unscale_stored(stored, grad_scaler)


def unscale_stored(tensors, grad_scaler):
    """Divide ``tensors`` in place by ``grad_scaler``'s scale, the way ``GradScaler.unscale_``
    divides ``.grad`` (its float32 reciprocal, taken in float64), then zero every one of them
    if any is not finite.

    Why zero all: the scaler skips a step when any gradient of the optimizer overflowed, and
    drops that gradient; an overflowed g_prev cannot be dropped from a correction that needs
    it, and copied into ``last_grad`` it would turn the next c_t, m and the parameters into
    NaN.  g_prev = 0 is the recursion's own start (step 1), so the next step is an ordinary
    first-step correction c = (1 + a) g, and ``update_last_grad`` stays a plain copy.  Nothing
    is read on the host: the flag stays a tensor."""
    scale = grad_scaler._get_scale_async() if grad_scaler.is_enabled() else None  # noqa: SLF001
    if scale is None:  # disabled, or never used to scale: nothing was scaled
        return
    inv_scale = scale.double().reciprocal().float()
    by_device = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    flags = []
    for device, ts in by_device.items():
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        for dtype in {t.dtype for t in ts}:
            torch._amp_foreach_non_finite_check_and_unscale_(
                [t for t in ts if t.dtype == dtype], found_inf, inv_scale.to(device))
        flags.append(found_inf)
    for device, ts in by_device.items():  # one flag for all (a copy only across devices)
        bad = torch.stack([f.to(device) for f in flags]).sum() > 0
        for t in ts:
            t.masked_fill_(bad, 0.0)


def note_grad_scaler(opt):
    """``GradScaler.step`` is about to call ``opt.step()`` (it read
    ``opt._step_supports_amp_scaling``)."""
    opt._driven_by_grad_scaler = True  # noqa: SLF001


def warn_if_scaled_previous_grad(opt):
    """In ``step()`` of the authors' loop: warn once if a GradScaler drives this step while
    ``update_previous_grad`` stored gradients without ``grad_scaler=``."""
    driven = opt.__dict__.pop("_driven_by_grad_scaler", False)
    if driven and getattr(opt, "_previous_grad_scaled", False) and \
            not getattr(opt, "_warned_scaled_previous_grad", False):
        opt._warned_scaled_previous_grad = True  # noqa: SLF001
        warnings.warn(
            f"{type(opt).__name__}: a GradScaler drives step(), but update_previous_grad() was "
            "called without grad_scaler=, so previous_grad (g_prev of the exact correction) "
            "holds the scaled gradient; call opt.update_previous_grad(grad_scaler=scaler)",
            stacklevel=3)


@torch.no_grad()
def update_last_grad(opt):
    """``last_grad`` <- ``previous_grad`` wherever both exist (the authors raise a KeyError for
    a parameter without ``previous_grad``, spec B4; here it keeps its ``last_grad``)."""
    for index, group in enumerate(opt.param_groups):
        if group["is_approx"]:
            continue
        for position, p in enumerate(group["params"]):
            st = opt.state.get(p, {})
            if "previous_grad" not in st:
                continue
            if "last_grad" in st:  # g_prev of the next step, rounded as the group says
                write_state(group, index, position, st["last_grad"], st["previous_grad"],
                            G_PREV, float(st.get("step", 0)) + 1)
            else:
                st["last_grad"] = st["previous_grad"].clone()


def uses_authors_api(opt):
    """Whether ``update_previous_grad`` has been called (exact mode without a closure)."""
    return any("previous_grad" in st for st in opt.state.values())


def _rng_state(params):
    cuda = sorted({p.device.index or 0 for p in params if p.is_cuda})
    return torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in cuda}


def _set_rng_state(state):
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for d, s in cuda.items():
        torch.cuda.set_rng_state(s, d)
