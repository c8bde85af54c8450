"""``MKOR(rank=k)`` inside the capture engine: padding masks (a padded row keeps its place in
the cut but not in its group's mean; an all-padding group contributes nothing), gradient
accumulation (group j pools the j-th pieces of every micro-batch), fused experts (each
expert's own real rows, token order; fewer than k rows; none), checkpoints, the payload, no
host sync and no solve larger than k x k. Expected values are computed here from rows that
plain hooks recorded, with the oracle (``reference/mkor/rank_k.py``)."""
import copy
import io

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as Fn

from reference.mkor import rank_k as RK
from theory_tests.mkor.test_differential import _record
from theory_tests.mkor.test_torch_preconditioner import SmallCNN, batch, make, train
from torch_impl.mkor import MKOR

f64 = torch.float64


def _err(ours, theirs):
    theirs = np.asarray(theirs)
    ours = ours.detach().numpy() if torch.is_tensor(ours) else np.asarray(ours)
    return float(np.abs(ours - theirs).max(initial=0) / max(1.0, np.abs(theirs).max(initial=0)))


def _present(mkor, name):
    """The groups of ``name`` that hold a real row: (A, G) as the oracle lists them."""
    A, G = mkor.pending_vectors()[name]
    keep = mkor.pending_sums()[name][0][..., -1] > 0
    return A[keep].numpy(), G[keep].numpy()


class Tokens(nn.Module):
    """Two Linear layers on (B, T, d) tokens; the forward takes the token mask."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, 5), nn.Linear(5, 2, bias=False)

    def forward(self, x, attention_mask=None):
        return self.fc2(torch.tanh(self.fc1(x)))


def _masked_loss(out, y, mask):
    """The mean over the real tokens: a padded row's gradient is exactly 0."""
    return (((out - y) ** 2).sum(-1) * mask).sum() / mask.sum()


def test_padding_keeps_its_place_in_the_cut_and_an_all_padding_group_is_dropped():
    torch.manual_seed(0)
    model = Tokens().to(f64)
    mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1), factor_dtype=f64, rank=4)
    seen = _record({"fc1": model.fc1, "fc2": model.fc2})
    x, y = torch.randn(2, 4, 3, dtype=f64), torch.randn(2, 4, 2, dtype=f64)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 1]], dtype=f64)  # group 1 (rows 2, 3) padded
    _masked_loss(model(x, attention_mask=mask), y, mask).backward()
    assert mkor.capture_report()["fc1"]["mask"] == "tokens"
    for name, module in (("fc1", model.fc1), ("fc2", model.fc2)):
        A, G = _present(mkor, name)
        A_ref, G_ref = RK.linear_group_vectors(seen["x", name].detach().numpy(),
                                               seen["g", name].detach().numpy(),
                                               4, module.bias is not None, mask.bool().numpy())
        assert A.shape[0] == 3 and A_ref.shape[0] == 3  # k' = 3 of k = 4
        assert _err(A, A_ref) < 1e-14 and _err(G, G_ref) < 1e-14


def test_accumulated_micro_batches_pool_the_jth_pieces():
    """Two micro-batches (losses halved): group j of the step is the union of each
    micro-batch's j-th piece; its G takes the step's total rows as R_g."""
    torch.manual_seed(1)
    model = Tokens().to(f64)
    mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1), factor_dtype=f64, rank=3)
    rows = {"a": [], "g": []}
    model.fc1.register_forward_pre_hook(lambda m, i: rows["a"].append(i[0].reshape(-1, 3)))
    model.fc1.register_full_backward_hook(
        lambda m, gi, go: rows["g"].append(go[0].reshape(-1, 5)))
    for size in (2, 3):  # unequal micro-batches: 8 and 12 rows
        x, y = torch.randn(size, 4, 3, dtype=f64), torch.randn(size, 4, 2, dtype=f64)
        (Fn.mse_loss(model(x), y, reduction="sum") / 20 / 2).backward()
    a_sum, g_sum, n = np.zeros((3, 4)), np.zeros((3, 5)), np.zeros(3)
    for a, g in zip(rows["a"], rows["g"]):
        a, g = a.detach().numpy(), g.detach().numpy()
        index = RK.group_index(a.shape[0], 3)
        for j in range(3):
            a_sum[j] += np.append(a[index == j].sum(0), (index == j).sum())
            g_sum[j] += g[index == j].sum(0)
            n[j] += (index == j).sum()
    A, G = _present(mkor, "fc1")
    assert _err(A, a_sum / n[:, None]) < 1e-14
    assert _err(G, n.sum() * g_sum / n[:, None]) < 1e-14


def test_checkpoints_round_trip_bit_for_bit():
    model, opt, mkor = make(rank=3, inv_freq=2)
    train(model, opt, mkor, 3)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "mkor": mkor.state_dict()}, saved)
    saved.seek(0)
    state = torch.load(saved)
    twin_model, twin_opt, twin = make(seed=5, rank=3, inv_freq=2)
    twin_model.load_state_dict(state["model"])
    twin.load_state_dict(state["mkor"])
    train(model, opt, mkor, 3, start=3)
    train(twin_model, twin_opt, twin, 3, start=3)
    for p, q in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(p, q)
    for name, (L, Rm) in mkor.inverse_factors().items():
        assert torch.equal(L, twin.inverse_factors()[name][0])
        assert torch.equal(Rm, twin.inverse_factors()[name][1])


def test_payload_carries_k_group_sums_and_counts_per_factor():
    """Per layer k (d_in + 1 + d_out) values (the group counts as the last input column,
    the bias column itself when there is a bias) plus the Packet's one count; float32."""
    for k in (1, 4):
        model, _, mkor = make(rank=k)
        layers = [(l.d_in, l.d_out, l.has_bias) for l in mkor._layers]
        if k == 1:
            expected = sum(d_in + d_out + (not bias) for d_in, d_out, bias in layers)
        else:
            expected = sum(k * (d_in - bias + 1 + d_out) + 1 for d_in, d_out, bias in layers)
        assert mkor.payload_bytes == 4 * expected


def test_no_host_sync_in_a_rank_k_step(monkeypatch):
    for variant in ("paper", "released"):
        model, opt, mkor = make(variant=variant, inv_freq=2, stat_decay=0.5, self_check=None,
                                rank=3)
        for t in range(4):
            x, y = batch(t)
            Fn.mse_loss(model(x), y).backward()
            with monkeypatch.context() as m:
                def boom(*args, **kwargs):
                    raise AssertionError("host synchronisation in precondition()")
                for name in ("__bool__", "item", "__float__", "__int__", "tolist", "__index__"):
                    m.setattr(torch.Tensor, name, boom)
                mkor.precondition()
            opt.step()
            opt.zero_grad()


def test_the_only_factorisation_is_k_by_k(monkeypatch):
    """O(k d^2 + k^3): a Cholesky and a triangular solve of k x k alone (the layers' sides are
    12-27 wide, k = 3); every other cubic routine raises."""
    model, opt, mkor = make(rank=3, inv_freq=1, stat_decay=0.5)
    shapes = []

    def forbidden(*args, **kwargs):
        raise AssertionError("O(d^3) routine called")
    for name in ("inv", "inv_ex", "solve", "solve_ex", "eigh", "eig", "svd", "cholesky",
                 "pinv", "lstsq", "lu_factor", "lu"):
        monkeypatch.setattr(torch.linalg, name, forbidden)
    for name in ("cholesky_ex", "solve_triangular"):
        original = getattr(torch.linalg, name)

        def watched(M, *args, original=original, **kwargs):
            shapes.append(tuple(M.shape[-2:]))
            return original(M, *args, **kwargs)
        monkeypatch.setattr(torch.linalg, name, watched)
    train(model, opt, mkor, 4)
    assert shapes and set(shapes) == {(3, 3)}


def _expert_vectors_and_oracle(padded, rank, batch_size=2, seq=8):
    pytest.importorskip("transformers")
    from reference.common.moe import expert_rows
    from theory_tests.support.moe_twin import lm_batch, tiny_moe_models
    (_, model), = tiny_moe_models(("mixtral",), num_layers=1).values()
    experts = model.model.layers[0].mlp.experts
    seen = {}
    experts.register_forward_pre_hook(
        lambda m, args: seen.__setitem__("inputs", [a.detach().clone() for a in args]))
    experts.register_full_backward_hook(
        lambda m, gi, go: seen.__setitem__("grad", go[0].detach().clone()))
    mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1), inv_freq=1,
                factor_dtype=f64, rank=rank)
    ids, mask, labels = lm_batch(0, padded, batch_size, seq)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    hidden, index, weights = (x.numpy() for x in seen["inputs"])
    rows = expert_rows(hidden, index, weights, seen["grad"].numpy(),
                       experts.gate_up_proj.detach().numpy(), experts.down_proj.detach().numpy(),
                       token_mask=mask.bool().numpy() if padded else None)
    return mkor, rows


@pytest.mark.parametrize("padded", [False, True], ids=["plain", "padded"])
def test_each_expert_cuts_its_own_real_rows(padded):
    """Per expert: its real rows in token order cut into k = 9 groups (the oracle's
    ``expert_group_vectors``); an expert with fewer than k rows has one group per row."""
    from reference.mkor.experts import expert_group_vectors
    mkor, rows = _expert_vectors_and_oracle(padded, 9)
    fewer = 0
    for projection, name in (("up", "gate_up_proj"), ("down", "down_proj")):
        full = f"model.layers.0.mlp.experts.{name}"
        A, G = mkor.pending_vectors()[full]
        counts = mkor.pending_sums()[full][0][..., -1]
        for e, pair in enumerate(expert_group_vectors(rows, 9, False, projection)):
            if pair is None:
                assert counts[e].sum() == 0
                continue
            keep = counts[e] > 0
            fewer += int(keep.sum()) < 9
            assert _err(A[e][keep], pair[0]) < 1e-13 and _err(G[e][keep], pair[1]) < 1e-13
    assert fewer > 0  # some expert had fewer than k rows


def test_an_expert_routed_no_token_sits_the_update_out():
    """2 tokens route 4 pairs over 4 experts: an expert with none keeps its identity
    factors and counts no_rows (as for rank 1); an updated one moved."""
    mkor, rows = _expert_vectors_and_oracle(False, 3, batch_size=1, seq=2)
    mkor.step()
    empty = [e for e, r in enumerate(rows) if r["a_gu"].shape[0] == 0]
    assert empty
    for layer in mkor._layers:
        if layer.experts is None:
            continue
        L, _ = mkor.inverse_factors()[layer.name]
        counters = mkor.counters()[layer.name]
        assert int(counters["updates_g"].sum()) > 0
        for e in range(layer.experts):
            identity = torch.equal(L[e], torch.eye(L.shape[-1], dtype=L.dtype))
            assert identity == (int(counters["updates_g"][e]) == 0)
            if e in empty:
                assert identity and int(counters["no_rows"][e]) == 1
            assert int(counters["non_finite"][e] + counters["overflow"][e]) == 0


def test_module_hooks_give_the_tensor_hooks_result():
    """grad_hook="module" pairs the same rows: the same rank-k run, bit for bit."""
    runs = []
    for hook in ("tensor", "module"):
        model, opt, mkor = make(rank=3, inv_freq=2, grad_hook=hook)
        train(model, opt, mkor, 4)
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(p, q) for p, q in zip(*runs))


def test_the_hybrid_switch_hands_over_as_for_rank_one():
    """MKOR-H at switch_step 2 with rank 3: factors freed, then the backbone's steps bit for
    bit (the same SGD run from the parameters and momentum at the switch)."""
    model, opt, mkor = make(rank=3, inv_freq=1, switch_step=2)
    train(model, opt, mkor, 2)
    assert not mkor.switched
    train(model, opt, mkor, 1, start=2)
    assert mkor.switched and mkor.inverse_factors() == {}
    twin_model = SmallCNN()
    twin_opt = torch.optim.SGD(twin_model.parameters(), lr=0.05, momentum=0.9)
    twin_model.load_state_dict(model.state_dict())
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # no shared momentum buffers
    for t in range(3, 5):
        for m, o in ((model, opt), (twin_model, twin_opt)):
            x, y = batch(t)
            Fn.mse_loss(m(x), y).backward()
            (mkor if m is model else o).step()
            o.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin_model.parameters()))


def test_a_real_bert_padding_never_reaches_a_rank_k_group():
    """transformers' BertForMaskedLM on right-padded batches, MKOR(rank=3): two runs whose
    batches differ only in the padded tokens end with bit-identical factors (every dense layer's
    groups hold real rows only); the control, the same runs with the mask withheld from MKOR
    (``token_mask=None``), differ, so the padded rows do reach the groups there."""
    pytest.importorskip("transformers")
    from theory_tests.support.hf_cases import equal_factors, factors_of, lm_batch, tiny_bert

    def run(pad_seed, token_mask):
        model = tiny_bert()
        mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.05), inv_freq=1, rank=3,
                    factor_dtype=f64, token_mask=token_mask)
        for t in range(2):
            batch = lm_batch(t, batch=2, seq=6, lengths=(6, 3), pad_seed=pad_seed)
            model(**batch).loss.backward()
            mkor.step()
            mkor.zero_grad()
        return factors_of(mkor)

    assert equal_factors(run(1, "attention_mask"), run(2, "attention_mask"))
    assert not equal_factors(run(1, None), run(2, None))
