"""DDP replicas and the default rounding seed: ranks whose torch generators differ still round
their replicated state identically, because ``rounding_seed=None`` is rank 0's draw on every
rank (``agreed_rounding_seed``: one broadcast at construction).  Two gloo ranks, the same
parameter and gradient on both (what DDP's all-reduce leaves)."""
import torch

from theory_tests.support.distributed_harness import run
from torch_impl import MARS
from torch_impl.common.rounding import default_rounding_seed


def _ranks(rank, world_size):
    torch.manual_seed(100 + rank)  # each rank's own generator: their own draws would differ
    p = torch.nn.Parameter(torch.randn(8, 16, generator=torch.Generator().manual_seed(0)))
    opt = MARS([p], lr=1e-2, state_dtype=torch.bfloat16, state_rounding="stochastic")
    for step in range(3):
        p.grad = torch.randn(8, 16, generator=torch.Generator().manual_seed(step + 1))
        opt.step()
    torch.manual_seed(100 + rank)  # what this rank alone would have drawn
    return (opt.param_groups[0]["rounding_seed"], default_rounding_seed(),
            opt.state[p]["exp_avg"].clone(), p.detach().clone())


def test_ranks_with_different_generators_agree_on_the_seed_and_the_state():
    a, b = run(_ranks, 2)
    assert a[1] != b[1]  # the ranks' own draws differ (the case the broadcast is for)
    assert a[0] == b[0] == a[1]  # rank 0's draw on both
    assert torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])  # replicas stay equal
