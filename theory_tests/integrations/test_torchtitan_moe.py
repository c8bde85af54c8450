"""torchtitan's qwen3 MoE (a small ``debugmodel_moe``: ``GroupedExperts`` behind the token
dispatcher, a softmax router with route_norm, the expert bias of auxiliary-loss-free load
balancing; ``theory_tests/support/torchtitan_cases.py::moe_model``) under MKOR and K-FAC through
our container (``torch_impl/integrations/torchtitan.py``), with the load-balancing hook qwen3's
model spec registers:

* each ``GroupedExperts`` is three preconditioned stacks (``w1_EFD``, ``w3_EFD``, ``w2_EDF``),
  updated on the factor-update steps, the router's gate an ordinary layer;
* torchtitan's flat, FQN-keyed state dict carries the stacks' factors, and a run resumed from
  it equals the uninterrupted one bit for bit (the expert bias rides in the model's).
"""
import warnings

import pytest
import torch

pytest.importorskip("torchtitan")

from torchtitan.components.optimizer.utils import get_flat_optim_state_dict  # noqa: E402

from theory_tests.support.torchtitan_cases import (lm_step, moe_model, moe_optimizers,  # noqa: E402
                                                   optimizer_name, saved, tokens)

BATCH, VOCAB = 2, 64
STACKS = ("w1_EFD", "w3_EFD", "w2_EDF")


def _build(case, seed=0):
    model = moe_model(seed, vocab=VOCAB)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the skipped embedding and norms
        return model, moe_optimizers(case, model)


def _train(model, opts, steps):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU autocast's note on the router's float32 block
        for t in steps:
            lm_step(model, opts, tokens(t, BATCH, vocab=VOCAB))


def _fqn(model):
    return {id(p): n for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", ["MKOR", "KFAC"])
def test_grouped_experts_are_preconditioned_through_the_container(case):
    model, opts = _build(case)
    pre = opts.optimizers[0]
    names = {f"layers.{i}.moe.routed_experts.inner_experts.{p}" for i in range(2) for p in STACKS}
    assert names <= set(pre.preconditioned_modules)
    assert {f"layers.{i}.moe.router.gate" for i in range(2)} <= set(pre.preconditioned_modules)
    assert not [n for n in pre.skip_reasons if "experts" in n]
    _train(model, opts, range(4))  # inv_freq 2: two factor updates
    counters = pre.counters()
    key = "updates_a" if case == "MKOR" else "updates"
    for name in names:
        assert (counters[name][key] > 0).any(), (name, counters[name])
    bias = model.layers["0"].moe.expert_bias_E
    assert bias.abs().sum() > 0  # the load-balancing hook ran before each step


@pytest.mark.parametrize("case", ["MKOR", "KFAC"])
def test_the_flat_fqn_layout_resumes_bit_for_bit(case):
    """Train 3 steps, save the flat state dict (``torch.save``), load it into a container on
    a fresh model (another seed, its weights and buffers then loaded) and train 3 more: equal
    to 6 uninterrupted steps bit for bit; the stacks' state is under their parameters' FQNs."""
    model, opts = _build(case)
    _train(model, opts, range(3))
    flat = opts.state_dict()
    assert flat.keys() == get_flat_optim_state_dict(opts.optimizers[0]).keys()
    key = optimizer_name(case).lower()
    pre = opts.optimizers[0]
    fqn = _fqn(model)
    carried = {k.split(f".{key}.")[0][len("state."):] for k in flat if f".{key}." in k}
    assert carried == {fqn[id(layer.module.weight)] for layer in pre._layers}
    assert {n for n in carried if n.endswith(STACKS)}
    resumed_model, resumed = _build(case, seed=1)
    resumed_model.load_state_dict(saved(model.state_dict()))  # the expert bias too
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "only the backbone's state was loaded"
        resumed.load_state_dict(saved(flat))
    for run, opt in ((model, opts), (resumed_model, resumed)):
        _train(run, opt, range(3, 6))
    after = [dict(m.named_parameters()) | dict(m.named_buffers()) for m in (model, resumed_model)]
    assert after[0].keys() == after[1].keys()
    assert all(torch.equal(after[0][n], after[1][n]) for n in after[0])
