"""A small demo: a teacher-student MLP trained with MARS (each variant) and torch's AdamW.

Until the convergence figures land, ``python -m figures`` runs this: it trains for a few
hundred steps on CPU in seconds and prints the loss curve of each optimizer.
"""
import argparse
import time

import torch

from torch_impl import MARS


def teacher_student(seed, n=2048, d_in=32, d_hidden=64):
    g = torch.Generator().manual_seed(seed)
    teacher = [torch.randn(d_in, d_hidden, generator=g) / d_in**0.5,
               torch.randn(d_hidden, 1, generator=g) / d_hidden**0.5]
    x = torch.randn(n, d_in, generator=g)
    y = torch.tanh(x @ teacher[0]) @ teacher[1] + 0.05 * torch.randn(n, 1, generator=g)
    return x, y


def make_model(seed, d_in=32, d_hidden=128):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d_in, d_hidden), torch.nn.GELU(),
                               torch.nn.Linear(d_hidden, d_hidden), torch.nn.GELU(),
                               torch.nn.Linear(d_hidden, 1))


OPTIMIZERS = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0),
    "MARS-AdamW": lambda ps: MARS(ps, lr=3e-3, mars_type="mars-adamw"),
    "MARS-Lion": lambda ps: MARS(ps, lr=3e-4, mars_type="mars-lion"),
    "MARS-Shampoo": lambda ps: MARS(ps, lr=3e-3, mars_type="mars-shampoo"),
}


def train(name, steps, batch, seed):
    x, y = teacher_student(seed)
    model = make_model(seed)
    opt = OPTIMIZERS[name](model.parameters())
    g = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (batch,), generator=g)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    with torch.no_grad():
        full = torch.nn.functional.mse_loss(model(x), y).item()
    return torch.stack(losses), full


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"teacher-student MLP, {args.steps} steps of batch {args.batch}, seed {args.seed}")
    print(f"{'optimizer':<14}" + "".join(f"{'step ' + str(s):>12}" for s in _marks(args.steps))
          + f"{'full loss':>12}{'time (s)':>10}")
    for name in OPTIMIZERS:
        start = time.perf_counter()
        losses, full = train(name, args.steps, args.batch, args.seed)
        elapsed = time.perf_counter() - start
        # mean of the 20 mini-batch losses ending at each mark, to read through the noise
        cells = "".join(f"{losses[max(0, s - 20):s].mean().item():>12.4f}" for s in _marks(args.steps))
        print(f"{name:<14}{cells}{full:>12.4f}{elapsed:>10.2f}")


def _marks(steps):
    return [max(1, steps * k // 4) for k in (1, 2, 3, 4)]


if __name__ == "__main__":
    main()
