"""Checkpoints of MKOR and K-FAC under expert parallelism, across layouts (issue 48).

torchtitan's qwen3 MoE on its EP path (``theory_tests/support/torchtitan_ep.py``), float64,
saved with DCP (torchtitan's ``ModelWrapper`` and our container's ``state_dict``: torchtitan's
flat FQN-keyed layout, ``get_flat_optim_state_dict``) on 2 ranks at
EP = 2 after 2 of 4 steps, loaded into a fresh job (another seed) in another layout:

* EP = 2 on 2 ranks (the same layout), EP = 4 on 4 ranks, EP = 2 x efsdp 2 on 4 ranks,
  FSDP2 without EP on 2 ranks (every stack ``Shard(0)`` over the experts, factors replicated),
  and one process;
* every expert's restored factors and counters equal the saved ones bit for bit, wherever the
  expert lands (an expert stack's state is saved as DTensors of all its experts,
  ``experts/parallel.py::global_layer_state``);
* the continuation equals the uninterrupted EP = 2 run: bit for bit in the same layout, to
  float64 rounding where each expert's rows stay on one rank, to bf16 rounding where the model's
  own FSDP sums bf16 partial gradients of the stacks (``BOUNDS``).
"""
import pytest
import torch

from theory_tests.distributed.test_kronecker_ep import CASES, _config, _expert_factors
from theory_tests.support.distributed_harness import run

GLOBAL_BATCH, STEPS, SAVE_AT = 4, 4, 2
# target layouts: (ranks, EP degree); EP 1 on 2 ranks is FSDP2 without EP
LAYOUTS = {"EP2": (2, 2), "EP4": (4, 4), "EP2xFSDP2": (4, 2), "FSDP2": (2, 1), "one": (1, 1)}
# the continuation against the uninterrupted run: bit for bit in the same layout; float64
# rounding of the dense layers' FSDP sums where each expert's rows stay on one rank; where
# they are split over ranks (efsdp 2, FSDP2 without EP), torchtitan's FSDP sums bf16-rounded
# partial weight gradients of the stacks, so bf16's unit roundoff (AdamW alone: the same)
BOUNDS = {"EP2": 0.0, "EP4": 1e-8, "one": 1e-8, "EP2xFSDP2": 2.0 ** -8, "FSDP2": 2.0 ** -8}


def _job(rank, world, root, kind, case, ep, mode):
    import warnings

    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpoint import ModelWrapper

    from theory_tests.support import torchtitan_ep as T
    warnings.simplefilter("ignore")
    T.configure()
    model = T.ep_model(kind, ep, seed=1 if mode == "resume" else 0)
    if world > 1:
        T.parallelize(model, kind, T.parallel_dims(world, ep))
    opts = _config(case).build(model_parts=[model])
    per = GLOBAL_BATCH // world

    def train(steps):
        for t in steps:
            T.lm_step(model, opts, T.tokens(t, GLOBAL_BATCH)[rank * per:(rank + 1) * per],
                      world)

    def state():
        return {"model": ModelWrapper(model).state_dict(), "optimizer": opts.state_dict()}

    restored = None
    if mode == "save":
        train(range(SAVE_AT))
        dcp.save(state(), checkpoint_id=root)
        return _expert_factors(opts.optimizers[0]), None
    if mode == "resume":
        loaded = state()
        dcp.load(loaded, checkpoint_id=root)
        ModelWrapper(model).load_state_dict(loaded["model"])
        opts.load_state_dict(loaded["optimizer"])
        restored = _expert_factors(opts.optimizers[0])
        train(range(SAVE_AT, STEPS))
    else:
        train(range(STEPS))
    return restored, T.full_parameters(model)


def _merge(per_rank):
    """{key: factor} over the ranks; an expert kept on several ranks (replicated factors)
    must be the same there."""
    out = {}
    for factors in per_rank:
        for key, value in factors.items():
            if key in out:
                assert torch.equal(out[key], value), f"{key} differs between ranks"
            out[key] = value
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_saved_under_ep_resumes_in_every_layout(tmp_path, case):
    root = str(tmp_path / case)
    uninterrupted = run(_job, 2, root, "qwen3", case, 2, "full", timeout=300)[0][1]
    saved = _merge([r[0] for r in run(_job, 2, root, "qwen3", case, 2, "save", timeout=300)])
    for name, (world, ep) in LAYOUTS.items():
        ranks = run(_job, world, root, "qwen3", case, ep, "resume", timeout=600)
        restored = _merge([r[0] for r in ranks])
        assert restored.keys() == saved.keys(), name
        for key, value in saved.items():
            assert torch.equal(restored[key], value), f"{name}: {key} not restored bit for bit"
        params = max(((ranks[0][1][k] - v).abs().max() / v.abs().max()).item()
                     for k, v in uninterrupted.items())
        print(f"{case}: saved at EP 2, resumed {name}: max relative parameter difference "
              f"from the uninterrupted run {params:.2e}")
        assert params <= BOUNDS[name], name
