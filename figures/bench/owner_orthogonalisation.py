"""Owner-rank against every-rank orthogonalisation of FSDP2-sharded matrices (issue 23.4).

``python -m figures.bench.owner_orthogonalisation [--ranks 1 2 4] [--width 256] [--layers 2]
[--vocab 1001] [--steps 3]`` forks gloo CPU ranks (one thread each), shards a GPT-like list of
matrices by rows (``Shard(0)``, FSDP2's layout: qkv 3d x d, proj d x d, fc 4d x d, fc2
d x 4d per block, and a vocab x d head whose rows do not split evenly), and runs MARS-M
steps (``functional.mars_m``, float32 Newton-Schulz) with ``orthogonalize_on="owner"`` and
``"every_rank"``. Per step and rank it reports the Newton-Schulz flops the rank ran, the bytes
it received and the collectives it joined (``recording.record_orthogonalisation``), and the
step time (the slowest rank, median over steps). MARS-Shampoo uses the same exchange.
Prints a Markdown table. Times on a machine with fewer cores than ranks are not
comparable across rank counts; flops and bytes are exact.
"""
import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed.tensor  # noqa: F401  (imported before the fork)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from figures.bench.forked_ranks import run_ranks
from figures.bench.recording import record_orthogonalisation
from torch_impl.mars import functional

MODES = ("every_rank", "owner")


def shapes(width, layers, vocab):
    d = width
    return [s for _ in range(layers) for s in ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d))] + [
        (vocab, d)]


def _rank(rank, world, args):
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(*s, generator=g) for s in shapes(args.width, args.layers, args.vocab)]
    out = {}
    for mode in MODES:
        params = [distribute_tensor(f.clone(), mesh, [Shard(0)]) for f in fulls]
        bufs = [torch.zeros_like(p) for p in params]
        lasts = [torch.zeros_like(p) for p in params]
        counters = [torch.tensor(0.0) for _ in params]
        n = len(params)
        times = []
        for step in range(args.steps + 1):  # the first step warms up, uncounted
            grads = [distribute_tensor(torch.randn(*f.shape, generator=g) * 0.01, mesh, [Shard(0)])
                     for f in fulls]
            dist.barrier()
            with record_orthogonalisation() as record:
                start = time.perf_counter()
                functional.mars_m(params, grads, bufs, lasts, [None] * n, [None] * n, counters,
                                  ["mars_m"] * n, lr=1e-3, weight_decay=0.1, momentum=0.95,
                                  gamma=0.025, ns_dtype=torch.float32, foreach=False,
                                  orthogonalize_on=mode)
                dist.barrier()
                elapsed = time.perf_counter() - start
            if step:
                times.append(elapsed)
                last = record
        out[mode] = dict(matrices=len(last.computed), flops=last.flops(),
                         received=last.bytes_received, sent=last.bytes_sent,
                         collectives=last.collectives, times=times)
    return out


def measure(world, args):
    """Every rank's result dict for ``world`` forked gloo ranks."""
    return run_ranks(_rank, world, args, prefix="owner_bench_")


def table(args):
    mats = shapes(args.width, args.layers, args.vocab)
    total_mb = sum(a * b for a, b in mats) * 4 / 2**20
    lines = [f"{len(mats)} float32 matrices ({total_mb:.1f} MB): "
             f"{args.layers} blocks of width {args.width}, head {args.vocab} x {args.width}; "
             f"{args.steps} steps after one warm-up, per step:",
             "",
             "| ranks | mode | NS matrices per rank (max) | NS GFLOP per rank (max) "
             "| MB received per rank (max) | MB moved, all ranks | collectives | step ms |",
             "|---|---|---|---|---|---|---|---|"]
    for world in args.ranks:
        results = measure(world, args)
        for mode in MODES:
            rows = [r[mode] for r in results]
            step_ms = statistics.median(max(ts) for ts in zip(*(r["times"] for r in rows))) * 1e3
            lines.append(
                f"| {world} | {mode} | {max(r['matrices'] for r in rows)} "
                f"| {max(r['flops'] for r in rows) / 1e9:.2f} "
                f"| {max(r['received'] for r in rows) / 2**20:.2f} "
                f"| {sum(r['received'] for r in rows) / 2**20:.2f} "
                f"| {rows[0]['collectives']} | {step_ms:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1001)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"`python -m figures.bench.owner_orthogonalisation` "
          f"({datetime.date.today().isoformat()}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, one thread per rank)\n")
    print(table(args))


if __name__ == "__main__":
    main()
