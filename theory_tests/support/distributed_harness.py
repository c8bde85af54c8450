"""Run a function on N gloo ranks in forked processes, with a hard deadline.

The pattern of kfac-pytorch's ``distributed_test`` (spawn N CPU ranks, gloo), written for
this suite: ranks are *forked* (no re-import of torch, ~50 ms a rank), rendezvous through a
file store in a temporary directory (no ports, no network), and every job has a deadline
after which the parent kills what is left, so a hung collective fails the test instead of
stalling CI.

``run(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on every rank inside an
initialised default process group and returns the ranks' return values (anything
``torch.save`` can store). If any rank raises, dies or is killed at the deadline it raises
:class:`DistributedFailure` with every rank's traceback. ``run_outcomes`` returns the
per-rank :class:`Outcome` instead, for tests about failures themselves.
"""
import dataclasses
import datetime
import multiprocessing
import multiprocessing.connection
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout
# Imported here, once, so that forked ranks inherit them: DDP pulls in torch._dynamo (and
# with it sympy) on first use, which would otherwise cost every rank of every job seconds.
import torch._dynamo  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import torch.nn.parallel  # noqa: F401

__all__ = ["Outcome", "DistributedFailure", "run", "run_outcomes"]


@dataclasses.dataclass
class Outcome:
    """What one rank did: returned ``value``, raised (``error``: its traceback), or was
    ``killed`` at the deadline. ``elapsed``: seconds from the end of the rendezvous to the
    return or the exception, measured by the rank itself (None if killed)."""

    rank: int
    value: object = None
    error: str = None
    killed: bool = False
    exitcode: int = None
    elapsed: float = None

    @property
    def ok(self):
        return self.error is None and not self.killed and self.exitcode == 0


class DistributedFailure(AssertionError):
    """A distributed job in which some rank raised, died or ran past the deadline."""

    def __init__(self, outcomes, timeout):
        self.outcomes = outcomes
        lines = []
        for o in outcomes:
            if o.killed:
                lines.append(f"rank {o.rank}: still running at the {timeout:g} s deadline; killed")
            elif o.error is not None:
                lines.append(f"rank {o.rank}: raised after {o.elapsed:.2f} s\n{o.error}")
            elif o.exitcode != 0:
                lines.append(f"rank {o.rank}: died with exit code {o.exitcode} and no result")
        super().__init__("distributed job failed\n" + "\n".join(lines))


def _worker(fn, rank, world_size, store, result_path, collective_timeout, args):
    """Body of a forked rank: rendezvous, run, record the outcome, leave with os._exit (a
    forked copy of pytest must not run the parent's atexit handlers)."""
    torch.set_num_threads(1)
    record, start = {}, time.monotonic()
    try:
        # Rendezvous with a generous timeout (a loaded machine may start a rank late), then
        # give the collectives the short one the test asked for.
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=max(collective_timeout, 60)))
        _set_pg_timeout(datetime.timedelta(seconds=collective_timeout))
        start = time.monotonic()
        record["value"] = fn(rank, world_size, *args)
        dist.destroy_process_group()  # only on success: a broken group may block here
    except BaseException:  # noqa: BLE001 -- every failure is reported to the parent
        record = {"error": traceback.format_exc()}
    record["elapsed"] = time.monotonic() - start
    try:
        torch.save(record, result_path + ".tmp")
        os.replace(result_path + ".tmp", result_path)
    finally:
        os._exit(0 if "value" in record else 1)


def run_outcomes(fn, world_size, *args, timeout=60.0, collective_timeout=30.0):
    """Fork ``world_size`` gloo ranks running ``fn(rank, world_size, *args)``; wait at most
    ``timeout`` seconds, then kill what is still running. Collectives raise after
    ``collective_timeout`` seconds without their peers (the rendezvous waits up to 60 s,
    bounded by ``timeout``)."""
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="dist_harness_") as tmp:
        store = os.path.join(tmp, "store")
        paths = [os.path.join(tmp, f"rank{r}.pt") for r in range(world_size)]
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(fn, r, world_size, store, paths[r], collective_timeout, args))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        alive = list(procs)
        while alive:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            multiprocessing.connection.wait([p.sentinel for p in alive], timeout=left)
            alive = [p for p in alive if p.is_alive()]
        outcomes = []
        for rank, (p, path) in enumerate(zip(procs, paths)):
            killed = p.is_alive()
            if killed:
                p.kill()
            p.join()
            record = torch.load(path, weights_only=False) if os.path.exists(path) else {}
            outcomes.append(Outcome(rank, value=record.get("value"), error=record.get("error"),
                                    killed=killed, exitcode=p.exitcode,
                                    elapsed=record.get("elapsed")))
            p.close()
        return outcomes


def run(fn, world_size, *args, timeout=60.0, collective_timeout=30.0):
    """:func:`run_outcomes`, returning the ranks' values in rank order, or raising
    :class:`DistributedFailure` if any rank did not return."""
    outcomes = run_outcomes(fn, world_size, *args, timeout=timeout,
                            collective_timeout=collective_timeout)
    if not all(o.ok for o in outcomes):
        raise DistributedFailure(outcomes, timeout)
    return [o.value for o in outcomes]
