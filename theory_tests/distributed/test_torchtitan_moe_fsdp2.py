"""torchtitan's qwen3 MoE (``theory_tests/support/torchtitan_cases.py::moe_model``, float64
parameters, bf16 expert products) sharded by torchtitan's ``apply_fsdp_to_decoder`` on 2 forked
gloo ranks, MKOR and K-FAC through our container: after one step on half the batch each, every
factor of every layer (the ``GroupedExperts`` stacks' per-expert factors among them) and every
counter equals the one-process run on the whole batch.

The factors come from the rows alone (each rank's rows are the one process's rows of its
tokens: the same bf16 products row by row), summed per expert over the ranks with each
expert's row count, so they agree to the float32 rounding of the statistics (measured max
relative difference per tensor: MKOR 1.8e-9, K-FAC 2.0e-7; asserted 1e-6). The parameters are
not compared: the weight gradient of a bf16 grouped mm is rounded to bf16 on each rank before
FSDP sums the ranks' parts, so they agree only to bf16 rounding. The load-balancing expert
bias is off (its token counts would need torchtitan's loss mesh).
"""
import pytest
import torch

from theory_tests.support.distributed_harness import run

GLOBAL_BATCH, VOCAB = 4, 64


def _job(rank, world, case):
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    from theory_tests.support.torchtitan_cases import config, lm_step, moe_model, tokens
    warnings.simplefilter("ignore")
    model = moe_model(load_balance=False, vocab=VOCAB)
    if world > 1:
        apply_fsdp_to_decoder(model, init_device_mesh("cpu", (world,)), torch.float64,
                              torch.float64, pp_enabled=False)
    opts = config(case).build(model_parts=[model])
    per = GLOBAL_BATCH // world
    lm_step(model, opts, tokens(0, GLOBAL_BATCH, vocab=VOCAB)[rank * per:(rank + 1) * per],
            world)
    return opts.optimizers[0].preconditioner_state_dict()["layers"]


def _tensors(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else k)
    elif torch.is_tensor(tree):
        yield prefix, tree


@pytest.mark.slow
@pytest.mark.parametrize("case", ["MKOR", "KFAC"])
def test_two_fsdp2_ranks_factor_as_one_process(case):
    (one,) = run(_job, 1, case)
    ranks = run(_job, 2, case, timeout=300)
    want = dict(_tensors(one))
    assert any("inner_experts.w1_EFD" in k for k in want)
    for layers in ranks:
        got = dict(_tensors(layers))
        assert got.keys() == want.keys()
        for k, w in want.items():
            if w.is_floating_point():
                scale = w.abs().max().clamp_min(torch.finfo(w.dtype).tiny)
                assert ((got[k] - w).abs().max() / scale).item() <= 1e-6, k
            else:
                assert torch.equal(got[k], w), k
