"""MKOR and K-FAC under FSDP2 through distributed checkpoints (``torch.distributed.checkpoint``,
issue 23): saved on 2 gloo ranks, resumed on 2, 3 and 1, on the model and batches of
``test_mkor_fsdp2.py`` (a 7-row layer, a 2-row layer, a bias-free and a frozen layer, mixed
``fully_shard`` granularity; float64).

The protocol of torch's DCP tutorial: ``get_state_dict(model, optimizer)`` and ``dcp.save``
after ``SAVE_AT`` steps; a fresh job builds the model from another seed (so the load has to
overwrite it), calls ``get_state_dict``, ``dcp.load`` and ``set_state_dict`` and runs the
remaining steps. DCP saves one copy of an entry several ranks hold, from a rank of its
choosing, so the preconditioner's state is merged over the ranks here and entries held twice
must agree bit for bit; owner-placed factors are held by their owner alone.

Every variant runs in one job per world size (saved on 2; uninterrupted on 2; resumed on 2, 3
and 1), each in its own checkpoint folder: a forked rank pays for its first FSDP and DCP calls
(sharding propagation, planners) once instead of once per variant. The tests, one per
variant, read that module's runs.
"""
import os

import pytest
import torch

from theory_tests.distributed.test_mkor_fsdp2 import (STEPS, VARIANTS, _assert_close, _build,
                                                      _factors, _full, _job, _model, _run,
                                                      _shard, _single)
from theory_tests.support.distributed_harness import run

SAVE_AT = 2
NAMES = ("paper", "kfac", "paper_owner", "kfac_owner", "paper_switched", "paper_rate",
         "paper_rate_buffered")
# a job runs every variant: a deadline for a hung collective, with room for a loaded machine
TIMEOUT = 180.0


def _dcp_job(rank, world, root, names, save):
    """:func:`_dcp_variant` for each of ``names`` in turn, each checkpointed in its own
    folder under ``root``: {name: what it returned}."""
    return {name: _dcp_variant(rank, world, os.path.join(root, name), name, save)
            for name in names}


def _dcp_variant(rank, world, root, name, save):
    """``save``: train SAVE_AT steps and checkpoint; else load into a fresh model (another
    seed, so the load must overwrite it) and train the remaining steps."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model = _shard(_model(seed=0 if save else 1))
    opt, pre = _build(model, VARIANTS[name])
    if save:
        _run(model, pre, opt, range(SAVE_AT), rank, world)
        model_sd, optim_sd = get_state_dict(model, pre)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root)
        return pre.preconditioner_state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's zero-gradient init step captures nothing
        model_sd, optim_sd = get_state_dict(model, pre)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=root)
        set_state_dict(model, pre, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    restored = pre.preconditioner_state_dict()
    _run(model, pre, opt, range(SAVE_AT, STEPS), rank, world)
    return {"params": [_full(p.detach()).clone() for p in model.parameters()],
            "restored": restored, "factors": _factors(pre)}


def _whole_state(states, what):
    """One preconditioner state from every rank's ``preconditioner_state_dict()``: each
    layer's entries merged over the ranks that hold them, which must hold the same values
    bit for bit (a rank holds a layer's state whole or not at all: DCP saves one copy of an
    entry several ranks hold, from whichever rank it picks). Everything else is replicated."""
    whole = {k: v for k, v in states[0].items() if k != "layers"}
    for state in states[1:]:
        assert {k: v for k, v in state.items() if k != "layers"} == whole, what
    layers = {}
    for rank, state in enumerate(states):
        for name, entries in state["layers"].items():
            merged = layers.setdefault(name, {})
            if entries and merged:  # held by two ranks: replicated, so the same everywhere
                _assert_same_state(entries, merged, f"{what}: {name} on rank {rank}")
            merged.update(entries)
    return dict(whole, layers=layers)


def _assert_same_state(a, b, what):
    assert set(a) == set(b), what
    for key, value in a.items():
        if isinstance(value, dict):
            _assert_same_state(value, b[key], f"{what}.{key}")
        elif isinstance(value, tuple):
            assert all(torch.equal(x, y) for x, y in zip(value, b[key])), f"{what}.{key}"
        elif isinstance(value, torch.Tensor):
            assert value.dtype == b[key].dtype and torch.equal(value, b[key]), f"{what}.{key}"
        else:
            assert value == b[key], f"{what}.{key}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every variant saved on 2 ranks, run uninterrupted on 2, and resumed on 2, 3 and 1:
    (saved, uninterrupted, {world: resumed}), each a list over the ranks of {name: result}."""
    root = str(tmp_path_factory.mktemp("ckpt"))
    saved = run(_dcp_job, 2, root, NAMES, True, timeout=TIMEOUT)
    uninterrupted = run(_job, 2, NAMES, timeout=TIMEOUT)
    resumed = {world: run(_dcp_job, world, root, NAMES, False, timeout=TIMEOUT)
               for world in (2, 3, 1)}
    return saved, uninterrupted, resumed


@pytest.mark.parametrize("name", NAMES)
def test_dcp_saved_on_two_ranks_resumes_on_three_and_one(runs, name):
    """MKOR / K-FAC under FSDP2 through get_state_dict + dcp.save on 2 ranks, dcp.load +
    set_state_dict on 2, 3 and 1:

    * the preconditioner's whole state (every layer's factors and counters, merged over the
      ranks that hold them; the step count; MKOR-H's switch and rule state) comes back bit
      for bit, whichever ranks own the layers before and after;
    * the resumed run equals one process on the whole batch (1e-12; the first steps summed
      over 2 ranks, the last over 3 or 1), and on 2 ranks the uninterrupted 2-rank run bit
      for bit. The frozen layer's weight (never trained) checks the model load too: the
      fresh model starts from another seed."""
    saved_on_ranks, uninterrupted, resumed = runs
    saved = _whole_state([r[name] for r in saved_on_ranks], f"{name} saved")
    assert all(saved["layers"].values())  # every layer's state is on some rank
    if name == "paper_switched":  # saved after the hand-over at step 1: factors freed,
        assert saved["switched"] and saved["steps"] == 1  # their layout kept (zeros)
        assert not any(v.any() for s in saved["layers"].values() for v in s.values())
    else:
        assert saved["steps"] == SAVE_AT
    reference = _single(name)
    for world in (2, 3, 1):
        results = [r[name] for r in resumed[world]]
        restored = _whole_state([r["restored"] for r in results], f"{name} on {world}")
        _assert_same_state(restored, saved, f"{name}: 2 -> {world} ranks")
        for rank, result in enumerate(results):
            _assert_close(result, reference, f"{name}, resumed on rank {rank} of {world}")
            if world == 2:  # the same ranks and shards: the uninterrupted run, bit for bit
                for a, b in zip(result["params"], uninterrupted[rank][name]["params"]):
                    assert torch.equal(a, b), f"{name}, resumed on rank {rank} of 2"


def _one_ranks_state_job(rank, world):
    """Each owner-placed preconditioner loads rank 0's ``preconditioner_state_dict()`` (what
    ``torch.save`` on rank 0 would write): the error message on each rank, or None."""
    import torch.distributed as dist
    out = {}
    for name in ("paper_owner", "kfac_owner"):
        model = _shard(_model())
        opt, pre = _build(model, VARIANTS[name])
        _run(model, pre, opt, range(1), rank, world)
        state = [pre.preconditioner_state_dict()]
        dist.broadcast_object_list(state, src=0)
        try:
            pre.load_preconditioner_state_dict(state[0])
            out[name] = None
        except ValueError as error:
            out[name] = str(error)
    return out


def test_one_ranks_state_of_owner_placed_factors_is_refused():
    """Rank 0's own state loads on rank 0; on rank 1, which owns layers rank 0 keeps no state
    for, it is refused naming the layer and pointing to DCP (never loaded as a fresh state)."""
    results = run(_one_ranks_state_job, 2)
    for name in ("paper_owner", "kfac_owner"):
        assert results[0][name] is None, results[0][name]
        message = results[1][name]
        assert message is not None and "saved by a rank that did not own it" in message, message
        assert "torch.distributed.checkpoint" in message
