"""Run a benchmark's worker on N forked gloo ranks (CPU) and collect what each rank saved.

``worker(rank, world, store, path, args)`` initialises its process group on the file
``store``, measures, ``torch.save``s its result to ``path`` and leaves with ``os._exit``.
"""
import multiprocessing
import os
import tempfile

import torch


def run_ranks(worker, world, args, prefix="bench_"):
    """Every rank's saved result, in rank order."""
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        paths = [os.path.join(tmp, f"rank{r}.pt") for r in range(world)]
        procs = [ctx.Process(target=worker, args=(r, world, os.path.join(tmp, "store"),
                                                  paths[r], args)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            if p.exitcode != 0:
                raise RuntimeError(f"rank exited with {p.exitcode}")
        return [torch.load(p, weights_only=False) for p in paths]
