"""MKOR and K-FAC built *before* accelerate's FSDP2 ``prepare(model, optimizer)`` follow the
parameter swap (``torch_impl/kronecker/placement.py``, ParameterBinding), on 2 forked gloo CPU ranks.

Accelerate's real code path: ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
fsdp_version=2)).prepare(model, optimizer)``, i.e. ``Accelerator._prepare_fsdp2``, which
runs ``fsdp2_prepare_model`` (``fully_shard``) and then ``fsdp2_switch_optimizer_parameters``
on the optimizer (here the preconditioner, whose param groups are the backbone's). On CPU
``AcceleratorState`` resolves the process group to MULTI_CPU and would fall back to DDP, so
after constructing the Accelerator the test sets its state's ``distributed_type`` to FSDP and
``fsdp_plugin`` to the plugin (what it sets itself on GPUs); everything ``prepare`` does from
there is accelerate's own code. Accelerate refuses ``prepare(optimizer)`` without its model
under FSDP2, so it has no "build the optimizer after sharding" order; the reference run is
therefore built by hand: ``prepare(model)`` alone, then the backbone and the preconditioner
on the sharded model, stepped directly.
"""
import os
import warnings

import pytest
import torch
import torch.nn as nn

# imported once here, so that the forked ranks inherit them
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.fsdp import fully_shard

from torch_impl.baselines import KFAC
from torch_impl.mkor import MKOR

from theory_tests.support.distributed_harness import run

CASES = [("mkor", "replicated"), ("mkor", "owner"), ("kfac", "owner")]

STEPS = 3


def _accelerator(rank, world):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29555")
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    acc = Accelerator(fsdp_plugin=plugin, cpu=True)
    acc.state.distributed_type = DistributedType.FSDP  # CPU: MULTI_CPU otherwise (docstring)
    acc.state.fsdp_plugin = plugin
    assert acc.is_fsdp2
    return acc


def _model():
    torch.manual_seed(0)
    # 7 rows: an uneven split over 2 ranks; a bias-free layer
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 4, bias=False), nn.Tanh(),
                         nn.Linear(4, 3)).double()


def _build(model, kind, placement):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if kind == "mkor":
        return MKOR(model, opt, inv_freq=1, factor_dtype=torch.float64,
                    factor_placement=placement)
    return KFAC(model, opt, inv_freq=2, damping=1e-2, factor_placement=placement)


def _train(rank, world, model, opt, pre):
    for t in range(STEPS):
        g = torch.Generator().manual_seed(t)
        x = torch.randn(4 * world, 5, generator=g, dtype=torch.float64)[4 * rank:4 * rank + 4]
        y = torch.randn(4 * world, 3, generator=g, dtype=torch.float64)[4 * rank:4 * rank + 4]
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    held = [s for s in pre._state.values() if s]
    return {"params": {n: p.full_tensor() for n, p in model.named_parameters()},
            "kept": sorted(n for n, s in pre._state.items() if s),
            "owners": {n: r for n, (r, _) in pre._owners.items()},
            "state": [{k: v for k, v in s.items() if isinstance(v, torch.Tensor)} for s in held],
            "hooked": [bool(l.module.weight._post_accumulate_grad_hooks) for l in pre._layers]}


def _followed(rank, world, kind, placement):
    warnings.simplefilter("ignore")
    acc = _accelerator(rank, world)
    model = _model()
    pre = _build(model, kind, placement)
    model, wrapped = acc.prepare(model, pre)  # fully_shard, then the parameter swap
    assert type(model[0].weight).__name__ == "DTensor"
    assert wrapped.optimizer is pre
    return _train(rank, world, model, wrapped, pre)


def _built_after(rank, world, kind, placement):
    warnings.simplefilter("ignore")
    acc = _accelerator(rank, world)
    model = acc.prepare(_model())
    pre = _build(model, kind, placement)
    return _train(rank, world, model, pre, pre)


def _both(rank, world):
    return [(_followed(rank, world, *case), _built_after(rank, world, *case)) for case in CASES]


def test_prepare_swap_is_followed_bitwise():
    """Built before ``prepare(model, optimizer)``, the preconditioner ends bit-identical to
    one built after sharding (MKOR replicated and owner-placed, K-FAC owner-placed): the same
    parameters after 3 steps, the same owner map and the same factors kept on each rank
    (``"owner"``: each rank dropped the layers it does not own), and its capture's hooks
    moved to the new DTensor weights."""
    ranks = run(_both, 2, timeout=60)
    for i, (kind, placement) in enumerate(CASES):
        for pairs in ranks:
            got, want = pairs[i]
            assert got["params"].keys() == want["params"].keys()
            assert all(torch.equal(got["params"][n], want["params"][n])
                       for n in want["params"]), (kind, placement)
            assert got["owners"] == want["owners"] and got["kept"] == want["kept"]
            assert all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)
                       for a, b in zip(got["state"], want["state"]))
            assert all(got["hooked"])
        kept = [pairs[i][0]["kept"] for pairs in ranks]
        if placement == "owner":
            assert sorted(kept[0] + kept[1]) == ["0", "2", "4"] and kept[0] and kept[1]
        else:
            assert kept[0] == kept[1] == ["0", "2", "4"]


def _stale(rank, world, kind):
    """The model sharded by hand after the optimizer was built: nobody switched the
    backbone's parameters."""
    warnings.simplefilter("ignore")
    model = _model()
    pre = _build(model, kind, "replicated")
    fully_shard(model)
    x = torch.randn(4, 5, dtype=torch.float64)
    model(x).sum().backward()
    try:
        pre.step()
    except RuntimeError as error:
        return str(error)
    return None


def test_unswitched_parameters_are_refused():
    """``fully_shard`` after construction without the optimizer switch: the backbone holds
    tensors that no longer get gradients, and the first step raises, saying what to do
    (MKOR and K-FAC)."""
    ranks = run(lambda rank, world: [_stale(rank, world, k) for k in ("mkor", "kfac")], 2,
                timeout=60)
    for messages in ranks:
        for kind, message in zip(("MKOR", "KFAC"), messages):
            assert message is not None
            assert "does not hold the new ones" in message
            assert f"{kind} after sharding" in message
            assert "Accelerator.prepare(model, optimizer)" in message
