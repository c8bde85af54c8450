"""The process group of the distributed examples: torchrun's, or, when an example is run
without a launcher (``python -m torch_impl.examples.ddp_mkor``), a group of one process, with
a line saying how to launch several, instead of torch's error about a missing ``RANK``. The
caller destroys the group as usual (``dist.destroy_process_group``); a one-process group's
file store deletes its file when the group is destroyed."""
import os
import sys
import tempfile

import torch.distributed as dist


def launch_command(example):
    """The command that runs ``example`` (a module of ``torch_impl.examples``) on 2 ranks."""
    return f"torchrun --nproc_per_node 2 -m torch_impl.examples.{example}"


def start(example, backend):
    """Initialise the default process group. Under a launcher (``RANK`` in the environment:
    torchrun sets it with ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``) join its group;
    without one, say so on stderr and make a group of one process through a file store (no
    port to pick)."""
    if "RANK" in os.environ:
        dist.init_process_group(backend)
        return
    print(f"torch_impl.examples.{example}: no launcher (RANK is not set), so this runs as one "
          f"process; for several ranks launch it with `{launch_command(example)} ...`",
          file=sys.stderr, flush=True)
    fd, store = tempfile.mkstemp(prefix=f"{example}-store-")  # empty: what a file store needs
    os.close(fd)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
