"""A failing or stalled rank must surface as an error on the others, never as a silent
hang (theory_tests/support/distributed_harness.py; gloo on CPU)."""
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as Fn

from torch_impl.mkor import MKOR

from theory_tests.support.distributed_harness import DistributedFailure, run


def _training(rank, world, fail_at, failure):
    """MKOR + DDP; at step ``fail_at`` rank 1 calls ``failure`` (raise, or stall)."""
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Tanh(),
                                                              nn.Linear(4, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mkor = MKOR(model, opt, inv_freq=1)
    for t in range(10):
        if rank == 1 and t == fail_at:
            failure()
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * t + rank))
        Fn.mse_loss(model(x), torch.zeros(4, 2)).backward()
        mkor.step()
        mkor.zero_grad()
    return True


def _raise():
    raise RuntimeError("rank 1 gives up")


def _stall():
    time.sleep(60)


def test_a_rank_that_raises_fails_its_peers_at_once():
    """The dead rank's sockets close, so rank 0's next collective raises long before the
    20 s collective timeout (measured ~0.1 s; 10 s allowed for a loaded machine)."""
    with pytest.raises(DistributedFailure) as info:
        run(_training, 2, 3, _raise, timeout=30, collective_timeout=20)
    rank0, rank1 = info.value.outcomes
    assert "rank 1 gives up" in rank1.error
    assert rank0.error is not None and not rank0.killed and rank0.elapsed < 10
    assert "rank 1 gives up" in str(info.value)  # the peer's traceback reaches the test


def test_a_stalled_rank_times_out_its_peers_and_is_killed_at_the_deadline():
    start = time.monotonic()
    with pytest.raises(DistributedFailure, match="deadline") as info:
        run(_training, 2, 2, _stall, timeout=3, collective_timeout=1)
    rank0, rank1 = info.value.outcomes
    assert rank0.error is not None and "Timed out" in rank0.error
    assert 1 <= rank0.elapsed < 3
    assert rank1.killed
    assert time.monotonic() - start < 10  # the deadline held (generous on 2 loaded cores)
