"""A stack of E expert layers is E layers (issue 31): every batched operation of MKOR's port
equals the 2-D operation applied to each matrix on its own, and discovery finds the fused
experts of a transformers model with the layout they declare."""
import types

import pytest
import torch

from torch_impl.kronecker.discovery import discover
from torch_impl.mkor.factors import factor_update, max_entry_norm, precondition, rescale
from torch_impl.mkor.layer_state import initial_layer_state, update_layer_factors
from torch_impl.mkor.vectors import expert_row_sum, grad_row_sum, input_row_sum

f64 = torch.float64
E, D = 4, 5


def _spd_stack(seed, n=E, d=D, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(n, d, d, generator=g, dtype=f64)
    return scale * (A @ A.mT / d + torch.eye(d, dtype=f64))


@pytest.mark.parametrize("variant", ["paper", "released"])
@pytest.mark.parametrize("first", [False, True])
def test_stacked_factor_update_is_the_per_matrix_update(variant, first):
    """Each matrix of the stack takes exactly its own 2-D update, with its own flags: one
    expert over the stabiliser's threshold, one flagged for reset, the rest plain."""
    J = _spd_stack(0)
    J[1] *= 3.0  # over the threshold (2): the stabiliser fires for this expert alone
    v = torch.randn(E, D, generator=torch.Generator().manual_seed(1), dtype=f64)
    reset = torch.tensor([False, False, True, False])
    first_flags = torch.tensor([first, False, first, True])
    options = dict(variant=variant, stat_decay=0.9, zeta=0.8, threshold=2.0)
    stacked, fired = factor_update(J, v, first=first_flags, reset_flag=reset, **options)
    for e in range(E):
        alone, f = factor_update(J[e], v[e], first=first_flags[e], reset_flag=reset[e], **options)
        assert torch.equal(fired[e], f)
        torch.testing.assert_close(stacked[e], alone, rtol=0, atol=1e-14)
    assert torch.equal(max_entry_norm(J), torch.stack([max_entry_norm(j) for j in J]))


def _layer(experts=E, d_out=3, d_in=D, bias=False):
    weight = torch.zeros(experts, d_out, d_in, dtype=f64) if experts else torch.zeros(d_out, d_in)
    # kept: the experts whose factors this rank keeps (all of them without expert parallelism)
    return types.SimpleNamespace(experts=experts, kept=experts, expert_shard=None, d_out=d_out,
                                 d_in=d_in + bias, has_bias=bias,
                                 identity_L=False, identity_R=False,
                                 module=types.SimpleNamespace(weight=weight))


@pytest.mark.parametrize("variant", ["paper", "released"])
def test_stacked_layer_update_with_an_expert_routed_nothing(variant):
    """update_layer_factors on a stack: an expert with no rows keeps its factors and counts
    one ``no_rows``; one with a non-finite vector is refused and counted; every other expert
    is updated as the same layer alone would be."""
    from torch_impl import MKOR
    net = torch.nn.Linear(2, 2)
    with MKOR(net, torch.optim.SGD(net.parameters(), lr=0.1), variant=variant,
              factor_dtype=f64) as mkor:
        o = mkor.options
    stack = initial_layer_state(_layer(), f64)
    assert stack["L_inv"].shape == (E, 3, 3) and stack["no_rows"].shape == (E,)
    g = torch.Generator().manual_seed(2)
    singles = [initial_layer_state(_layer(experts=None), f64) for _ in range(E)]
    for step in range(3):
        a = torch.randn(E, D, generator=g, dtype=f64)
        gv = torch.randn(E, 3, generator=g, dtype=f64)
        present = torch.tensor([True, step != 1, True, False])
        if step == 2:
            a[2, 0] = float("nan")
        update_layer_factors(stack, a, gv, present, o)
        for e, s in enumerate(singles):
            update_layer_factors(s, a[e], gv[e], present[e], o)
    for e, s in enumerate(singles):
        for key, value in s.items():
            torch.testing.assert_close(stack[key][e], value, rtol=0, atol=1e-13, msg=key)
    assert stack["no_rows"].tolist() == [0, 1, 0, 3]
    assert stack["non_finite"].tolist() == [0, 0, 1, 0]
    assert torch.equal(stack["L_inv"][3], torch.eye(3, dtype=f64))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("mode", ["joint", "sum_of_norms"])
@pytest.mark.parametrize("sides", ["both", "L", "R"])
def test_stacked_precondition_and_rescale_are_per_expert(bias, mode, sides):
    """Delta_e = L_e^-1 [G_e | b_e] R_e^-1 and its rescale s_e use expert e's factors and
    norms only; an expert with a zero gradient keeps it (the zero guard, per expert)."""
    g = torch.Generator().manual_seed(3)
    L = _spd_stack(4, d=3) if sides != "R" else None
    R = _spd_stack(5, d=D + bias) if sides != "L" else None
    G = torch.randn(E, 3, D, generator=g, dtype=f64)
    G[2] = 0
    b = torch.randn(E, 3, generator=g, dtype=f64) if bias else None
    if bias:
        b[2] = 0
    dW, db = precondition(L, R, G, b)
    sW, sb = rescale(dW.clone(), None if db is None else db.clone(), G, b, mode)
    for e in range(E):
        d1, b1 = precondition(None if L is None else L[e], None if R is None else R[e],
                              G[e], None if b is None else b[e])
        torch.testing.assert_close(dW[e], d1, rtol=0, atol=1e-14)
        s1, t1 = rescale(d1.clone(), None if b1 is None else b1.clone(), G[e],
                         None if b is None else b[e], mode)
        torch.testing.assert_close(sW[e], s1, rtol=0, atol=1e-14)
        if bias:
            torch.testing.assert_close(db[e], b1, rtol=0, atol=1e-14)
            torch.testing.assert_close(sb[e], t1, rtol=0, atol=1e-14)
    assert torch.equal(sW[2], G[2])


def test_expert_row_sums_are_each_experts_own():
    """The routed rows' per-expert sums and counts equal the 2-D statistic of the rows routed
    to each expert; an expert routed nothing gets zeros and 0; masked rows count nowhere."""
    g = torch.Generator().manual_seed(6)
    rows = torch.randn(11, D, generator=g, dtype=f64)
    ids = torch.tensor([0, 2, 2, 0, 1, 0, 2, 1, 1, 0, 2])
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    total, count = expert_row_sum(rows, mask, ids, E)
    a_stack, n_stack = input_row_sum(rows, mask, True, ids, E)
    g_stack, _ = grad_row_sum(rows, mask, 1, ids, E)
    for e in range(E):
        pick = ids == e
        a_e, n_e = input_row_sum(rows[pick], mask[pick], True)
        torch.testing.assert_close(a_stack[e], a_e, rtol=0, atol=1e-15)
        torch.testing.assert_close(g_stack[e], grad_row_sum(rows[pick], mask[pick], 1)[0],
                                   rtol=0, atol=1e-15)
        assert count[e] == n_e == n_stack[e]
    assert count[3] == 0 and torch.equal(total[3], torch.zeros(D, dtype=f64))


# -- discovery on transformers' fused experts ----------------------------------------------

def _mixtral(**overrides):
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        hidden_size=16, intermediate_size=12, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=64,
        max_position_embeddings=32, **overrides)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).double()


def test_discovery_finds_each_projection_as_a_stack_and_names_the_router():
    model = _mixtral()
    found = discover(model)
    by_name = {layer.name: layer for layer in found.layers}
    up = by_name["model.layers.0.mlp.experts.gate_up_proj"]
    down = by_name["model.layers.0.mlp.experts.down_proj"]
    assert (up.experts, up.d_out, up.d_in) == (4, 24, 16)  # one expert's (2I, H)
    assert (down.experts, down.d_out, down.d_in) == (4, 16, 12)
    assert "model.layers.0.mlp.experts" not in found.skipped
    assert found.skipped["model.layers.0.mlp.gate"].startswith("an MoE router beside fused experts")


def test_a_frozen_or_skipped_projection_is_left_with_its_reason():
    model = _mixtral()
    model.model.layers[0].mlp.experts.down_proj.requires_grad_(False)
    found = discover(model, skip=["*.gate_up_proj"])
    assert found.skipped["model.layers.0.mlp.experts.down_proj"].startswith("frozen weight")
    assert "skip_modules pattern" in found.skipped["model.layers.0.mlp.experts.gate_up_proj"]
    assert not any(layer.experts for layer in found.layers)


def test_a_layout_the_parameters_contradict_is_refused_with_the_reason():
    """The declared layout is checked against the parameters, never assumed."""
    model = _mixtral()
    experts = model.model.layers[0].mlp.experts
    experts.has_bias = True  # declared, but there is no gate_up_proj_bias
    found = discover(model)
    assert "has_bias" in found.skipped["model.layers.0.mlp.experts"]
    assert not any(layer.experts for layer in found.layers)


def test_expert_parallelism_without_transformers_dispatch_is_refused():
    """Experts marked expert-parallel (transformers' grouped_gemm sharding) without its
    ep_dispatch_experts forward see sentinel ids for the other ranks' experts: skipped at
    construction with the reason; marked after construction, the capture raises."""
    from torch_impl import MKOR
    model = _mixtral()
    experts = model.model.layers[0].mlp.experts
    experts._is_expert_parallel = True
    mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "sentinel expert ids" in mkor.skip_reasons["model.layers.0.mlp.experts"]
    mkor.remove()
    experts._is_expert_parallel = False
    mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1))
    experts._is_expert_parallel = True
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    with pytest.raises(Exception, match="expert parallelism"):
        model(input_ids=ids, labels=ids).loss.backward()
    mkor.remove()


def test_the_self_check_catches_a_gradient_moved_between_experts():
    """The weight check compares each expert's own gradient (one random weight per expert),
    so two experts' gradients swapped -- the same sum over the stack -- release the layer."""
    from torch_impl import MKOR
    model = _mixtral()
    weight = model.model.layers[0].mlp.experts.down_proj
    weight.register_hook(lambda g: g[[1, 0, 2, 3]])  # runs before MKOR's own hook
    mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1), inv_freq=1)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    mkor.step()
    report = mkor.capture_report()
    assert report["model.layers.0.mlp.experts.down_proj"]["self_check"]["weight"] == "fail"
    assert report["model.layers.0.mlp.experts.gate_up_proj"]["self_check"]["weight"] == "pass"
    assert "model.layers.0.mlp.experts.down_proj" in mkor.skip_reasons
