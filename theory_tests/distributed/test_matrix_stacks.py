"""Stacks of matrices under FSDP2 (issue 31, item 2) on gloo CPU ranks.

FSDP2 shards a fused-expert parameter (E, A, B) on its first dim: each rank holds whole
experts. With ``matrix_batch_dims=1`` every per-matrix operation -- the clip norms
(``vector_norm`` over the last two dims), Newton-Schulz and the SVD (``sharding.on_matrices``
-> ``on_local_matrices``) -- is then a function of each rank's own matrices, so a step needs
no communication at all, in either ``orthogonalize_on`` mode. Checked here, float64 (1e-12;
measured 2.2e-16), on 2 ranks (3 experts: shards of 2 and 1) and 3 ranks (one each):

- sharded MARS-M (loop, foreach, owner and every-rank), MARS-Shampoo (Newton-Schulz, SVD),
  MARS-AdamW and MARS-Lion equal the unsharded run;
- no collective in ``opt.step()`` (``CommDebugMode``), and each rank orthogonalised only its
  local shard of each stack (``figures.bench.recording.record_orthogonalisation``);
- the control: the same stacks sharded on a matrix dim (``Shard(1)``) still equal the
  unsharded run, through the all-gather (``on_full_matrix``), and do communicate -- so the
  zero above is a measurement, not a counter that never counts.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as Fn

from figures.bench.recording import record_orthogonalisation
from theory_tests.support.distributed_harness import run
from torch_impl import MARS, MARSM
from torch_impl.common import sharding

E, STEPS = 3, 3
F64 = torch.float64
CASES = {
    "mars-m-loop": (MARSM, dict(gamma=0.3)),
    "mars-m-foreach": (MARSM, dict(gamma=0.3, foreach=True)),
    "mars-m-every-rank": (MARSM, dict(gamma=0.3, orthogonalize_on="every_rank")),
    "shampoo": (MARS, dict(mars_type="mars-shampoo")),
    "shampoo-svd-foreach": (MARS, dict(mars_type="mars-shampoo", orthogonalizer="svd",
                                       foreach=True)),
    "adamw": (MARS, dict()),
    "lion-foreach": (MARS, dict(mars_type="mars-lion", foreach=True)),
}
ORTHOGONALISING = {"mars-m-loop", "mars-m-foreach", "mars-m-every-rank", "shampoo",
                   "shampoo-svd-foreach"}


class Experts(nn.Module):
    """A fused-expert layer as transformers 5 stores one: a tall (E, 12, 5) and a wide
    (E, 6, 12) stack, every expert applied to every input (a dense mixture: the gradients of
    all experts are nonzero).  12 and 6 rows: FSDP2's ``Shard(1)`` needs even shards."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w_in = nn.Parameter(torch.randn(E, 12, 5, generator=g, dtype=F64) / 2)
        self.w_out = nn.Parameter(torch.randn(E, 6, 12, generator=g, dtype=F64) / 2)

    def forward(self, x):
        h = torch.tanh(torch.einsum("bi,eoi->beo", x, self.w_in))
        return torch.einsum("beo,eko->bk", h, self.w_out).clone()


def _batch(t):
    """12 rows (split evenly on 2 and 3 ranks); large targets keep the clip active."""
    g = torch.Generator().manual_seed(t)
    return (3 * torch.randn(12, 5, generator=g, dtype=F64),
            30 * torch.randn(12, 6, generator=g, dtype=F64))


def _optimizer(name, params):
    cls, options = CASES[name]
    return cls([dict(params=list(params), matrix_batch_dims=1)], lr=1e-2, weight_decay=0.1,
               ns_dtype=F64, **options)


def _train(model, opt, rank=None, world=1, around_step=None):
    for t in range(STEPS):
        x, y = _batch(t)
        if rank is not None:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        opt.zero_grad()
        Fn.mse_loss(model(x), y).backward()
        if around_step is None:
            opt.step()
        else:
            with around_step:
                opt.step()


def _reference(name):
    model = Experts()
    _train(model, _optimizer(name, model.parameters()))
    return [p.detach() for p in model.parameters()]


def _job(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.debug import CommDebugMode
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name in CASES:
        for placement in (0, 1):  # Shard(0): whole experts per rank; Shard(1): the control
            model = fully_shard(Experts(), mesh=mesh,
                                shard_placement_fn=lambda p, d=placement: Shard(d))
            opt = _optimizer(name, model.parameters())
            comm = CommDebugMode()
            with record_orthogonalisation() as record:
                _train(model, opt, rank, world, around_step=comm)
            out[name, placement] = dict(
                params=[p.full_tensor() for p in model.parameters()],
                local=[tuple(p.to_local().shape) for p in model.parameters()],
                collectives=comm.get_total_counts(), record=record)
    return out


@pytest.fixture(scope="module")
def ranks():
    jobs = {}

    def get(world):
        if world not in jobs:
            jobs[world] = run(_job, world, timeout=180.0, collective_timeout=30.0)
        return jobs[world]
    return get


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_sharded_stacks_equal_unsharded_stacks(ranks, world, name):
    reference = _reference(name)
    for res in ranks(world):
        for placement in (0, 1):
            for a, b in zip(res[name, placement]["params"], reference):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("world", [2, 3])
def test_whole_experts_per_rank_need_no_communication(ranks, world):
    """Shard(0): no collective in any step, and each rank orthogonalised its own shard of
    each stack once per step (its local shapes), nothing gathered."""
    for rank, res in enumerate(ranks(world)):
        for name in CASES:
            r = res[name, 0]
            assert r["local"][0][0] == sharding.shard_sizes(E, world)[rank]
            assert r["collectives"] == 0, (name, r["collectives"])
            record = r["record"]
            assert record.collectives == 0 and record.bytes_received == 0, name
            expected = r["local"] * STEPS if name in ORTHOGONALISING else []
            assert sorted(record.computed) == sorted(expected), name


@pytest.mark.parametrize("world", [2, 3])
def test_a_stack_sharded_on_a_matrix_dim_is_gathered(ranks, world):
    """The control, Shard(1): each rank holds rows of every expert, so the matrix functions
    all-gather (and still give the unsharded numbers, test above)."""
    for res in ranks(world):
        for name in ORTHOGONALISING:
            r = res[name, 1]
            assert r["collectives"] > 0 and r["record"].bytes_received > 0, name
