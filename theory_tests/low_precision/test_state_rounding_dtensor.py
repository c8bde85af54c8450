"""Stochastic state rounding of DTensor (FSDP2) parameters: each rank rounds its own shard, its
stream the tensor's LP2 words with the rank's mesh coordinate appended, so two shards holding
equal values round differently (a stream shared by the shards would correlate them) and no
rank needs another's data.  Two gloo ranks, a Shard(0) matrix whose two halves are equal."""
import torch

from theory_tests.support.distributed_harness import run
from torch_impl import MARS
from torch_impl.common.rounding import name_word, stochastic_round, stream_seed

SEED = 5


def _ranks(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world_size,))
    half = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    grad_half = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))

    def param():
        p = torch.nn.Parameter(distribute_tensor(torch.cat([half, half]), mesh, [Shard(0)]))
        p.grad = distribute_tensor(torch.cat([grad_half, grad_half]), mesh, [Shard(0)])
        return p
    p, q = param(), param()
    opt = MARS([p], lr=1e-2, state_dtype=torch.bfloat16, state_rounding="stochastic",
               rounding_seed=SEED)
    opt.step()
    twin = MARS([q], lr=1e-2)  # the same first step into float32 state: the working values
    twin.step()
    out = {}
    for key in ("exp_avg", "exp_avg_sq"):
        local = opt.state[p][key].to_local()
        words = (SEED, 0, 0, name_word(key), 1, rank)
        want = stochastic_round(twin.state[q][key].to_local(), torch.bfloat16, stream_seed(*words))
        out[key] = (torch.equal(local, want), local.clone())
    return out


def test_each_rank_rounds_its_shard_with_its_own_stream():
    a, b = run(_ranks, 2)
    for key in ("exp_avg", "exp_avg_sq"):
        assert a[key][0] and b[key][0], key  # LP1 with the documented words + coordinate
        assert not torch.equal(a[key][1], b[key][1]), key  # equal shards, their own streams
