"""Exact mode (M1) for MARS and MARS-M: grad f(x_{t-1}, xi_t), the current batch at the previous
iterate, obtained two ways.

* ``evaluate_at_previous_then_current`` (recommended): the step's closure is evaluated at
  x_{t-1} (kept in ``state["prev_param"]``) and then at x_t, with the RNG state restored in
  between, so both gradients see the same sample.
* ``update_previous_grad`` / ``update_last_grad``: the authors' loop (``train_mars.py``), which
  computes the *next* batch's gradient at x_t before stepping and hands it over after the step.

Both leave grad f(x_{t-1}, xi_t) in ``state["last_grad"]``; the update then runs as in approx
mode, without overwriting ``last_grad`` with g_t.
"""
import torch


def evaluate_at_previous_then_current(opt, closure):
    """Exact mode (M1): fill ``last_grad`` with grad f(x_{t-1}, xi_t), then evaluate at x_t.

    x_{t-1} is kept in ``prev_param``; the swap copies x_t aside and reuses that copy as the
    next ``prev_param``, so exact mode holds one extra parameter-sized buffer.
    """
    params = [p for group in opt.param_groups for p in group["params"]]
    returning = [p for p in params if p in opt.state and "prev_param" in opt.state[p]]
    returning_set = set(returning)
    rng = _rng_state(params)
    if returning:
        current = [p.detach().clone() for p in returning]
        for p in returning:
            p.copy_(opt.state[p]["prev_param"])
        opt.zero_grad(set_to_none=True)
        with torch.enable_grad():
            closure()
        for group in opt.param_groups:
            for p in group["params"]:
                buf = opt.state[p].get("last_grad") if p in returning_set else None
                if buf is None:
                    continue
                if p.grad is None:  # p did not enter the loss at x_{t-1}
                    buf.zero_()
                else:
                    buf.copy_(-p.grad if group["maximize"] else p.grad)
        for p, x_t in zip(returning, current):
            p.copy_(x_t)
            opt.state[p]["prev_param"] = x_t
        _set_rng_state(rng)  # the same sample xi_t (dropout masks included) at x_t
    opt.zero_grad(set_to_none=True)
    with torch.enable_grad():
        loss = closure()
    for p in params:
        if "prev_param" not in opt.state[p] and p.grad is not None:
            opt.state[p]["prev_param"] = p.detach().clone()
    return loss


@torch.no_grad()
def update_previous_grad(opt, keeps_last_grad):
    """``previous_grad`` <- a copy of ``p.grad`` (negated under maximize) for every parameter
    with a gradient that uses ``last_grad`` (``keeps_last_grad(p, group)``); parameters
    without a gradient are skipped (the authors print a line for each).  No-op in approx mode."""
    for group in opt.param_groups:
        if group["is_approx"]:
            continue
        for p in group["params"]:
            if p.grad is None or not keeps_last_grad(p, group):
                continue
            st = opt.state[p]
            g = -p.grad if group["maximize"] else p.grad
            if "previous_grad" in st:
                st["previous_grad"].copy_(g)
            else:
                st["previous_grad"] = g.detach().clone(memory_format=torch.preserve_format)


@torch.no_grad()
def update_last_grad(opt):
    """``last_grad`` <- ``previous_grad`` wherever both exist (the authors raise a KeyError for
    a parameter without ``previous_grad``, spec B4; here it keeps its ``last_grad``)."""
    for group in opt.param_groups:
        if group["is_approx"]:
            continue
        for p in group["params"]:
            st = opt.state.get(p, {})
            if "previous_grad" not in st:
                continue
            if "last_grad" in st:
                st["last_grad"].copy_(st["previous_grad"])
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
