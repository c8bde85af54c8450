"""A seeded stochastic problem shared by the MARS tests, with a NumPy gradient oracle and the
same loss in torch, so that exact mode (which re-evaluates a closure at x_{t-1}) can be checked
against ``reference.mars.mars.mars_trajectory``.

f(x; xi) = sum_i [ 1/2 <w_i, x_i^2> + <b_i, x_i> + 0.1 sum cos(x_i) ],  w, b drawn per batch xi.
The scales differ per tensor so that the per-tensor clip fires on some tensors and not others.
"""
import numpy as np
import torch

# 1-D, 2-D (wide and tall, for Newton-Schulz's transpose), 4-D: every routing case.
SHAPES = [(6,), (5, 4), (3, 2, 2, 2), (4, 7)]
SCALES = [0.05, 1.0, 0.1, 0.5]


def initial_params(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=s) for s in SHAPES]


def batches(n_steps, seed=1):
    rng = np.random.default_rng(seed)
    return [[(rng.uniform(0.5, 2.0, size=s), scale * rng.normal(size=s))
             for s, scale in zip(SHAPES, SCALES)] for _ in range(n_steps)]


def grad_oracle(x, xi):
    return [w * xx + b - 0.1 * np.sin(xx) for xx, (w, b) in zip(x, xi)]


def torch_loss(params, xi):
    total = 0.0
    for p, (w, b) in zip(params, xi):
        w, b = torch.as_tensor(w, dtype=p.dtype, device=p.device), torch.as_tensor(b, dtype=p.dtype, device=p.device)
        total = total + 0.5 * (w * p * p).sum() + (b * p).sum() + 0.1 * torch.cos(p).sum()
    return total


def run_torch(opt_factory, x0, xis, dtype=torch.float64, device="cpu", use_closure=True):
    """Train torch parameters on the same batches; returns the list of iterates as NumPy."""
    params = [torch.nn.Parameter(torch.tensor(x, dtype=dtype, device=device)) for x in x0]
    opt = opt_factory(params)
    xs = [[p.detach().cpu().double().numpy().copy() for p in params]]
    for xi in xis:
        def closure(xi=xi):
            opt.zero_grad()
            loss = torch_loss(params, xi)
            loss.backward()
            return loss
        if use_closure:
            opt.step(closure)
        else:
            closure()
            opt.step()
        xs.append([p.detach().cpu().double().numpy().copy() for p in params])
    return xs, params, opt
