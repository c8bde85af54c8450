"""The lockstep harness of the peer tests: a small model, a peer optimizer and our MARS built by
a convention map (``theory_tests/support/peer_conventions.py``), stepped together.

Both optimizers get the same gradients at every step: the model's gradient at the peer's
iterate, copied to our twin parameters.  The comparison then isolates the optimizers (a
difference in the iterate does not feed back through the loss), so the tolerances below are
bounds on rounding (and on the one unmapped term, pytorch_optimizer's 1e-15) accumulated step
by step, not on a trajectory's sensitivity.
"""
import copy

import torch
from torch import nn

# A schedule that changes lr at every step (warm-up, then decay), as a scheduler would.
LR_SCHEDULE = (0.3, 1.0, 0.7, 0.45, 0.2, 0.1)


class Net(nn.Module):
    """Every kind of tensor the routes distinguish: a 3-D Conv1d kernel (ndim > 2), a 2-D
    Linear weight, 1-D biases and a 0-D scale."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3)
        self.lin = nn.Linear(12, 4)
        self.scale = nn.Parameter(torch.tensor(0.8))

    def forward(self, x):
        return self.scale * self.lin(torch.tanh(self.conv(x)).flatten(1))


def _batch(t, dtype, scale):
    gen = torch.Generator().manual_seed(100 + t)
    x = torch.randn(8, 2, 6, generator=gen, dtype=dtype)
    y = torch.randn(8, 4, generator=gen, dtype=dtype) * scale
    return x, y


def lockstep(make_peer, make_ours, dtype, steps=len(LR_SCHEDULE), lr=1e-2, target_scale=3.0,
             seed=0, peer_v=None):
    """Run both for ``steps`` steps, lr following ``LR_SCHEDULE`` in every group of both.

    ``make_peer(params)`` builds the peer on tensors, ``make_ours(named_params)`` returns an
    ``OurMARS``.  Returns the history: per step, per tensor, a dict with the name, our and the
    peer's iterate after the step, the iterate before it, the step's lr and the peer's
    ``exp_avg_sq`` after it (``None`` where it keeps none; ``peer_v(peer, p)`` reads it from a
    peer that keeps it under another name)."""
    torch.manual_seed(seed)
    peer_model = Net().to(dtype)
    our_model = copy.deepcopy(peer_model)
    peer = make_peer(list(peer_model.parameters()))
    mapping = make_ours(list(our_model.named_parameters()))
    ours = mapping.build()
    names = [n for n, _ in peer_model.named_parameters()]
    history = []
    for t in range(steps):
        factor = LR_SCHEDULE[t % len(LR_SCHEDULE)]
        for opt in (peer, ours):
            for group in opt.param_groups:
                group["lr"] = lr * factor
        x, y = _batch(t, dtype, target_scale)
        peer_model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(peer_model(x), y).backward()
        for p, q in zip(peer_model.parameters(), our_model.parameters()):
            q.grad = p.grad.detach().clone()
        before = [p.detach().clone() for p in peer_model.parameters()]
        peer.step()
        mapping.step(ours)
        history.append([dict(name=n, ours=q.detach().clone(), peer=p.detach().clone(),
                             before=b, lr=lr * factor,
                             v=_clone(peer_v(peer, p) if peer_v else
                                      peer.state[p].get("exp_avg_sq")))
                        for n, p, q, b in zip(names, peer_model.parameters(),
                                              our_model.parameters(), before)])
    return history


def _clone(x):
    return None if x is None else x.detach().clone()


def max_abs_difference(history):
    return max((r["ours"] - r["peer"]).abs().max().item() for step in history for r in step)


def rounding_bound(history, dtype, decay):
    """Per tensor, the accumulated rounding bound on |ours - peer| after each step.

    Both compute the same formula in a different order.  At step t every quantity of the
    update (c, m, v, the denominator, u) is formed in at most ~4 roundings from the previous
    step's state, whose own relative error is carried: the update's relative error is at most
    (4t + 8) unit roundings u_r (2^-24 float32, 2^-53 float64; the 8 cover the denominator and
    the step), so it moves p by at most (4t + 8) u_r |d_t|, |d_t| = |p_{t+1} - p_t| +
    lr_t decay |p_t| (the update before the decay; ``decay``: the largest lr factor times
    weight decay of any rule).  The decay and the addition of the update round p twice more:
    2 u_r |p|.  Summed over the steps: a list (per step) of dicts (per tensor)."""
    ur = 2.0 ** -24 if dtype == torch.float32 else 2.0 ** -53
    total, out = {}, []
    for t, step in enumerate(history, start=1):
        for r in step:
            d = ((r["peer"] - r["before"]).abs() + r["lr"] * decay * r["before"].abs()).max()
            size = torch.maximum(r["peer"].abs().max(), r["before"].abs().max())
            total[r["name"]] = (total.get(r["name"], 0.0)
                                + (4 * t + 8) * ur * d.item() + 2 * ur * size.item())
        out.append(dict(total))
    return out


def sqrt_shift_bound(history, eps, decay, uses_denominator, shift=1e-15):
    """Per tensor, a bound on what pytorch_optimizer's sqrt(v + 1e-15) moves the iterate.

    The peer's denominator (sqrt(v + s) + eps)/sqrt(bc2) exceeds the mapped one,
    (sqrt(v) + eps)/sqrt(bc2), by the relative amount
    r = (sqrt(v + s) - sqrt(v)) / (sqrt(v) + eps) = s / ((sqrt(v + s) + sqrt(v)) (sqrt(v) + eps))
    (<= s / (2 v) for v >> eps^2), so the update u = m_hat / denominator changes by at most
    |u| r and the iterate by lr |u| r.  s enters no state (m and v are the same numbers in
    both), and both see the same gradients, so the shifts add up over the steps:
    sum_t max|lr_t u_t| max r_t per tensor, with |lr_t u_t| <= |p_{t+1} - p_t| + lr_t decay |p_t|.
    ``uses_denominator(name)``: whether the tensor's rule divides by it (not MARS-Lion's)."""
    total, out = {}, []
    for step in history:
        for r in step:
            if r["v"] is None or not uses_denominator(r["name"]):
                total.setdefault(r["name"], 0.0)
                out_value = 0.0
            else:
                v = r["v"].double()
                ratio = shift / ((torch.sqrt(v + shift) + torch.sqrt(v)) * (torch.sqrt(v) + eps))
                move = ((r["peer"] - r["before"]).abs()
                        + r["lr"] * decay * r["before"].abs()).max().double()
                out_value = (move * ratio.max()).item()
            total[r["name"]] = total.get(r["name"], 0.0) + out_value
        out.append(dict(total))
    return out


def assert_within(history, *bounds):
    """|ours - peer| <= the sum of the given per-step, per-tensor bounds, at every step; returns
    the largest difference and the largest ratio difference / bound."""
    worst, ratio = 0.0, 0.0
    for t, step in enumerate(history):
        for r in step:
            diff = (r["ours"] - r["peer"]).abs().max().item()
            bound = sum(b[t][r["name"]] for b in bounds)
            assert diff <= bound, (f"step {t + 1}, {r['name']}: |ours - peer| = {diff:.3e} "
                                   f"> bound {bound:.3e}")
            worst, ratio = max(worst, diff), max(ratio, diff / bound)
    return worst, ratio
