"""MKOR under DistributedDataParallel, one process per rank, launched by torchrun:

    torchrun --nproc_per_node 2 -m torch_impl.examples.ddp_mkor --steps 50

(gloo on CPU, NCCL when CUDA is present; run without torchrun it trains as one process and
says so.) Each rank trains the same MLP on its own slice of a synthetic teacher-student
batch; DDP averages the weight gradients and MKOR all-reduces only its rank-1 vectors, so
the inverse factors stay identical on every rank. Rank 0 prints the loss, the bytes MKOR
all-reduced per factor update next to what K-FAC would send for the same model, and whether
every rank holds the same factors.
"""
import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from torch_impl.baselines import KFAC
from torch_impl.examples import launcher
from torch_impl.mkor import MKOR


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m torch_impl.examples.ddp_mkor",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=50, help="Training steps (default 50).")
    p.add_argument("--batch", type=int, default=64,
                   help="The global batch, split over the ranks (default 64).")
    p.add_argument("--width", type=int, default=64,
                   help="Hidden width of the MLP (default 64).")
    p.add_argument("--inv-freq", type=int, default=5,
                   help="Steps between MKOR's factor updates (default 5).")
    p.add_argument("--lr", type=float, default=0.05,
                   help="SGD's learning rate, MKOR's backbone (default 0.05).")
    return p.parse_args(argv)


def main(argv=None):
    """Train; returns {"loss", "factors_identical", "payload_bytes", "kfac_payload_bytes",
    "communicated_bytes"} (for tests). Uses an existing process group if there is one."""
    args = parse(argv)
    cuda = torch.cuda.is_available()
    owns_group = not dist.is_initialized()
    if owns_group:  # torchrun's group, or one process without a launcher
        launcher.start("ddp_mkor", "nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else \
        torch.device("cpu")
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {world} ranks")

    torch.manual_seed(0)  # the same initial weights everywhere (DDP broadcasts rank 0's too)
    model = nn.Sequential(nn.Linear(16, args.width), nn.Tanh(),
                          nn.Linear(args.width, 1)).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    sgd = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    mkor = MKOR(ddp, sgd, inv_freq=args.inv_freq)
    teacher = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))

    for step in range(args.steps):
        # The global batch is the same on every rank; each takes its slice (with real data,
        # a DistributedSampler does this).
        x = torch.randn(args.batch, 16, generator=torch.Generator().manual_seed(1000 + step))
        y = torch.tanh(x @ teacher)
        x, y = x.chunk(world)[rank].to(device), y.chunk(world)[rank].to(device)
        loss = F.mse_loss(ddp(x), y)
        loss.backward()
        mkor.step()          # all-reduce a_bar, g_bar (factor-update steps), precondition, SGD
        mkor.zero_grad()

    # Replicated factors: compare every rank's with rank 0's (the only check that sends them).
    same = torch.ones(1, device=device)
    for L_inv, R_inv in mkor.inverse_factors().values():
        for J in (L_inv, R_inv):
            ref = J.clone()
            dist.broadcast(ref, 0)
            same *= float(torch.equal(ref, J))
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    loss_sum = loss.detach().reshape(1)
    dist.all_reduce(loss_sum)
    twin = copy.deepcopy(model)  # a K-FAC on a copy, only to read its payload size
    kfac_bytes = KFAC(twin, torch.optim.SGD(twin.parameters())).payload_bytes
    result = {"loss": loss_sum.item() / world, "factors_identical": bool(same.item()),
              "payload_bytes": mkor.payload_bytes, "kfac_payload_bytes": kfac_bytes,
              "communicated_bytes": mkor.communicated_bytes}
    if rank == 0:
        ranks = f"{world} rank{'s' if world > 1 else ''}"
        print(f"{ranks}, {args.steps} steps: loss {result['loss']:.4g}; MKOR all-reduced "
              f"{mkor.payload_bytes} B per factor update ({mkor.communicated_bytes} B in all), "
              f"K-FAC would send {kfac_bytes} B; factors identical on every rank: "
              f"{result['factors_identical']}")
    if owns_group:
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
