"""MKOR on fused experts (issue 31) against its two references: the oracle's per-expert
equations (``reference/mkor/experts.py``, on the rows of ``reference/common/moe.py``) and the
twin model whose experts are ``nn.Linear`` modules with the same weights and routing
(``theory_tests/support/moe_twin.py``), on three families of transformers 5: Mixtral (default
layout), Qwen2-MoE (with its shared expert) and GPT-OSS (interleaved gate/up, transposed
storage, biases, clamped SwiGLU)."""
import types

import numpy as np
import pytest
import torch

from theory_tests.support.moe_twin import build_twin, fused_view, tiny_moe_models
from theory_tests.support.moe_twin import lm_batch as _batch

pytest.importorskip("transformers")

from reference.common.moe import expert_rows  # noqa: E402
from reference.mkor.experts import expert_rank1_vectors  # noqa: E402
from torch_impl import KFAC, MKOR  # noqa: E402

f64 = torch.float64
STEPS = 3


def _preconditioner(kind, model):
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    if kind == "mkor":
        return MKOR(model, sgd, inv_freq=1, factor_dtype=f64)
    return KFAC(model, sgd, inv_freq=1, factor_freq=1, damping=1e-2)


def _train(model, padded, batch_size=2, seq=8, kind="mkor"):
    mkor = _preconditioner(kind, model)
    for t in range(STEPS):
        ids, mask, labels = _batch(t, padded, batch_size, seq)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        mkor.step()
        mkor.zero_grad()
    return mkor


def _fused_against_twin(family, padded, batch_size=2, seq=8, kind="mkor"):
    (_, model), = tiny_moe_models((family,)).values()
    mask = _batch(0, padded, batch_size, seq)[1]
    # the twin routes a padded token nowhere: its Linear experts see real tokens only
    twin = build_twin(model, unroute_mask=mask.bool() if padded else None)
    fused_mkor = _train(model, padded, batch_size, seq, kind)
    _train(twin, padded, batch_size, seq, kind)
    reference = fused_view(twin)
    params = dict(model.named_parameters())
    initial = dict(tiny_moe_models((family,))[family][1].named_parameters())
    change = max((params[n].detach() - p.detach()).abs().max().item() for n, p in initial.items())
    errors = {n: (params[n].detach() - p).abs().max().item() for n, p in reference.items()}
    return fused_mkor, errors, change


@pytest.mark.parametrize("kind", ["mkor", "kfac"])
@pytest.mark.parametrize("padded", [False, True], ids=["plain", "padded"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "gpt_oss"])
def test_fused_experts_train_as_their_twin(family, padded, kind):
    """3 MKOR steps (factor update every step, float64 factors) / K-FAC steps (factors and
    eigendecompositions every step) of the fused model equal the twin's, every parameter,
    experts included; under padding the fused experts read each pair's token mask and are
    listed in no unmasked_reasons."""
    mkor, errors, change = _fused_against_twin(family, padded, kind=kind)
    worst = max(errors.values())
    print(f"[moe twin {kind} {family} {'padded' if padded else 'plain'}] max |fused - twin| = "
          f"{worst:.2e} of a largest change {change:.2e}")
    assert worst <= 1e-15 * max(1.0, change) + 1e-16, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    stacks = [l for l in mkor._layers if l.experts is not None]
    assert len(stacks) == 4  # two projections of two layers' experts
    assert not set(mkor.unmasked_reasons) & {l.name for l in stacks}
    if padded:
        report = mkor.capture_report()
        assert all(report[l.name]["mask"] == "tokens" for l in stacks)


@pytest.mark.parametrize("kind", ["mkor", "kfac"])
def test_an_expert_routed_no_token_counts_no_rows_as_its_twin_does(kind):
    """A batch of 2 tokens routes 4 pairs over 4 experts: some expert gets none and sits the
    update out (no_rows), as its twin Linear, never called, does; no update is refused."""
    mkor, errors, _ = _fused_against_twin("mixtral", False, batch_size=1, seq=2, kind=kind)
    assert max(errors.values()) <= 1e-16
    counters = mkor.counters()
    no_rows = sum(counters[l.name]["no_rows"].sum().item() for l in mkor._layers if l.experts)
    assert no_rows > 0
    assert all(c["non_finite"].sum() == 0 for c in counters.values())


def _vectors_and_oracle(padded):
    (_, model), = tiny_moe_models(("mixtral",), num_layers=1).values()
    experts = model.model.layers[0].mlp.experts
    seen = {}

    def keep_inputs(module, args):
        seen["inputs"] = [a.detach().clone() for a in args]

    def keep_grad(module, grad_input, grad_output):
        seen["grad"] = grad_output[0].detach().clone()
    experts.register_forward_pre_hook(keep_inputs)
    experts.register_full_backward_hook(keep_grad)
    mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1), inv_freq=1,
                factor_dtype=f64)
    ids, mask, labels = _batch(0, padded)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    vectors = mkor.pending_vectors()
    hidden, index, weights = (x.numpy() for x in seen["inputs"])
    rows = expert_rows(hidden, index, weights, seen["grad"].numpy(),
                       experts.gate_up_proj.detach().numpy(), experts.down_proj.detach().numpy(),
                       token_mask=mask.bool().numpy() if padded else None)
    mkor.remove()
    return vectors, rows


@pytest.mark.parametrize("padded", [False, True], ids=["plain", "padded"])
def test_the_ports_vectors_are_the_oracles(padded):
    """MKOR's captured per-expert (a_bar, g_bar) equal the oracle's, computed in NumPy from
    the experts module's inputs, weights and output gradient (float64, 1e-13)."""
    vectors, rows = _vectors_and_oracle(padded)
    for projection, name in (("up", "gate_up_proj"), ("down", "down_proj")):
        a_bar, g_bar = vectors[f"model.layers.0.mlp.experts.{name}"]
        oracle = expert_rank1_vectors(rows, has_bias=False, projection=projection)
        for e, pair in enumerate(oracle):
            if pair is None:
                assert torch.all(a_bar[e] == 0) and torch.all(g_bar[e] == 0)
                continue
            np.testing.assert_allclose(a_bar[e].numpy(), pair[0], rtol=0, atol=1e-13)
            np.testing.assert_allclose(g_bar[e].numpy(), pair[1], rtol=0, atol=1e-13)


def _declared_layout_model(seed=0):
    """A router and fused experts of a class of our own under transformers' real decorator,
    with the layouts no model above declares: no gate (``up_proj`` and an activation) and a
    norm after each expert (``has_post_expert_norm``)."""
    import torch.nn as nn
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation(has_gate=False, has_post_expert_norm=True)
    class PlainExperts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts, H, I = 4, 6, 5
            self.up_proj = nn.Parameter(0.3 * torch.randn(4, I, H, dtype=f64))
            self.down_proj = nn.Parameter(0.3 * torch.randn(4, H, I, dtype=f64))
            self.act_fn = nn.GELU()
            self.post_expert_norm = nn.LayerNorm(H, dtype=f64)

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise AssertionError("config._experts_implementation picks batched_mm")

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            config = types.SimpleNamespace(_experts_implementation="batched_mm")
            self.inp = nn.Linear(3, 6, dtype=f64)
            self.router = nn.Linear(6, 4, bias=False, dtype=f64)
            self.experts = PlainExperts(config)
            self.out = nn.Linear(6, 2, dtype=f64)

        def forward(self, x):
            h = torch.tanh(self.inp(x)).reshape(-1, 6)
            weights, index = torch.softmax(self.router(h), -1).topk(2, dim=-1)
            return self.out(self.experts(h, index, weights))

    torch.manual_seed(seed)
    return Block()


def test_the_layouts_no_model_declares_train_as_their_twin():
    """has_gate=False (the module's act_fn) and has_post_expert_norm (the norm's VJP in the
    down projection's gradient rows), run by transformers' batched_mm implementation: the
    fused block equals its twin after 3 MKOR steps."""
    import types as _types  # noqa: F401  (SimpleNamespace above)
    model = _declared_layout_model()
    twin = build_twin(model)
    runs = []
    for net in (model, twin):
        mkor = MKOR(net, torch.optim.SGD(net.parameters(), lr=0.1), inv_freq=1, factor_dtype=f64)
        for t in range(STEPS):
            g = torch.Generator().manual_seed(t)
            x, y = torch.randn(5, 3, generator=g, dtype=f64), torch.randn(5, 2, generator=g, dtype=f64)
            torch.nn.functional.mse_loss(net(x), y).backward()
            mkor.step()
            mkor.zero_grad()
        runs.append(mkor)
    assert {l.name for l in runs[0]._layers if l.experts} == {"experts.up_proj", "experts.down_proj"}
    params = dict(model.named_parameters())
    worst = max((params[n].detach() - p).abs().max().item() for n, p in fused_view(twin).items())
    print(f"[moe twin declared layouts] max |fused - twin| = {worst:.2e}")
    assert worst <= 1e-15


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_under_bf16_autocast_the_rows_are_the_ones_the_forward_multiplied(family):
    """A float32 model under CPU bf16 autocast: the recomputed rows (under the forward's
    autocast, each product's gradient in the product's dtype) pass the self-check's weight
    test per expert, so no projection is released (in float32 outside autocast they were off
    by 3-23 times its bound and were released)."""
    (_, model), = tiny_moe_models((family,), dtype=torch.float32).values()
    mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1), inv_freq=1)
    ids, mask, labels = _batch(0, True)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    mkor.step()
    report = mkor.capture_report()
    stacks = [l.name for l in mkor._layers if l.experts is not None]
    assert all(report[n]["self_check"]["weight"] == "pass" for n in stacks), \
        {n: report[n]["self_check"] for n in stacks}
    assert not set(stacks) & set(mkor.skip_reasons)
