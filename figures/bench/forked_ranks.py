"""Run a benchmark's per-rank measurement on N forked gloo ranks (CPU) and collect the results.

``measure(rank, world, args)`` runs inside an initialised default process group (a file store in
a temporary folder: no ports) and returns anything ``torch.save`` can store.
"""
import multiprocessing
import os
import tempfile

import torch
import torch.distributed as dist


def _worker(measure, rank, world, store, path, args):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    result = measure(rank, world, args)
    dist.destroy_process_group()
    torch.save(result, path)
    os._exit(0)  # a forked copy must not run the parent's atexit handlers


def run_ranks(measure, world, args, prefix="bench_"):
    """Every rank's result, in rank order."""
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        paths = [os.path.join(tmp, f"rank{r}.pt") for r in range(world)]
        procs = [ctx.Process(target=_worker, args=(measure, r, world, os.path.join(tmp, "store"),
                                                   paths[r], args)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            if p.exitcode != 0:
                raise RuntimeError(f"rank exited with {p.exitcode}")
        return [torch.load(p, weights_only=False) for p in paths]
