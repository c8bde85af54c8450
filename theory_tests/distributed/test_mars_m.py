"""MARS-M under FSDP2 (``fully_shard``) and DTensor column shards on gloo CPU ranks.

As for MARS-Shampoo: the clip norm of a DTensor is the whole tensor's, and Newton-Schulz is
computed on the whole matrix (``sharding.on_full_matrix``), so sharded MARS-M equals unsharded
MARS-M, uneven shards included.  A control on the local shards as plain tensors differs (the
comparison can fail).  Float64 throughout; 1e-12 covers sharded reductions' summation order.
"""
import pytest
import torch
import torch.nn.functional as Fn

from theory_tests.support.distributed_harness import run
from theory_tests.distributed.test_mars import STEPS, _batch, _local_shard_control, _model, _sharded_model
from torch_impl import MARSM

CASES = {"loop": dict(foreach=False), "foreach": dict(foreach=True),
         "efficient": dict(efficient=True, clip_c=False), "no-clip": dict(clip_c=False)}


def _options(case):
    return dict(lr=1e-2, ns_dtype=torch.float64, weight_decay=0.1, gamma=0.3, **CASES[case])


def _train(model, opt, rank=None, world=1):
    for t in range(STEPS):
        x, y = _batch(t)
        if rank is not None:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        opt.zero_grad()
        Fn.mse_loss(model(x), y).backward()
        opt.step()


def _reference(case):
    model = _model()
    _train(model, MARSM(model.parameters(), **_options(case)))
    return [p.detach() for p in model.parameters()]


def _fsdp_job(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for case in CASES:
        model = _sharded_model(mesh)
        _train(model, MARSM(model.parameters(), **_options(case)), rank, world)
        out[case] = [p.full_tensor() for p in model.parameters()]
    # control: MARS-M on plain copies of the local shards (per-shard norm and NS)
    out["control"] = _local_shard_control(
        mesh, lambda ps: MARSM(ps, **_options("loop")), rank, world)
    return out


@pytest.fixture(scope="module")
def fsdp_results():
    return run(_fsdp_job, 2)


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp2_mars_m_equals_unsharded_mars_m(fsdp_results, case):
    reference = _reference(case)
    for res in fsdp_results:
        for a, b in zip(res[case], reference):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_local_shard_control_differs(fsdp_results):
    reference = _reference("loop")
    diff = max((a - b).abs().max().item() for a, b in zip(fsdp_results[0]["control"], reference))
    assert diff > 1e-4
