"""The ``KFAC`` optimizer's flavours (issue 46, item 2; claims row KFAC-FLAVOURS):
``fisher_type`` / ``kfac_approx`` with ``curvature_backward`` (``torch_impl/baselines/
kfac_curvature.py``). The defaults' bit-for-bit sameness is the rest of the K-FAC suite,
which runs them unchanged.

* each flavour's first factor update equals ``torch_impl.kfac_factors``'s (A, G) of the same
  batch (1e-12, float64), reduce and expand differ on a weight-shared model;
* ``curvature_backward``: an error at the step that needed it when it was not called, a no-op
  on other steps and with "empirical", no ``.grad`` written, the self-check run on the
  columns, ``zero_grad`` between it and the backward, gradient accumulation, a loss scale,
  a checkpoint round trip, an expert routed no token, 2 gloo ranks;
* every option refused by name where it cannot apply.
"""
import pytest
import torch
import torch.nn as nn

from theory_tests.support.distributed_harness import run
from torch_impl import KFAC, kfac_factors

f64 = torch.float64
TOL = 1e-12


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


class TokenNet(nn.Module):
    """Linear layers shared over S tokens; ``per_token``: logits per token, flattened to
    (N S, C) for a per-token CE (the expand setting); else averaged over the tokens, (N, C)
    (the reduce setting)."""

    def __init__(self, per_token=True, C=5):
        super().__init__()
        self.per_token = per_token
        self.fc1, self.fc2 = nn.Linear(3, 4), nn.Linear(4, C)

    def forward(self, x):
        h = self.fc2(torch.tanh(self.fc1(x)))
        return h.flatten(0, 1) if self.per_token else h.mean(1)


def _data(per_token, seed=0, N=6, S=4, C=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, S, 3, generator=g, dtype=f64)
    y = torch.randint(0, C, (N * S,) if per_token else (N,), generator=g)
    return x, y


def _kfac(model, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs.setdefault("kl_clip", None)
    return opt, KFAC(model, opt, **kwargs)


def _step(model, kfac, x, y, lf, scale=1.0):
    out = model(x)
    kfac.curvature_backward(out, y, lf)
    (lf(out, y) * scale).backward()
    kfac.step()
    kfac.zero_grad()


def _mc(fisher):
    return dict(generator=torch.Generator().manual_seed(5)) if fisher == "mc" else {}


@pytest.mark.parametrize("fisher", ["empirical", "mc", "type-2"])
@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_the_first_factor_update_is_kfac_factors(fisher, approx):
    """Per-token CE for expand, a per-sample CE after the tokens' mean for reduce (the
    settings whose 1/R the empirical G's sample count is: rows, samples)."""
    per_token = approx == "expand"
    torch.manual_seed(0)
    model = TokenNet(per_token).double()
    x, y = _data(per_token)
    lf = nn.CrossEntropyLoss()
    ref = kfac_factors(model, lf, x, y, fisher_type=fisher, kfac_approx=approx, **_mc(fisher))
    _, kfac = _kfac(model, fisher_type=fisher, kfac_approx=approx, **_mc(fisher))
    _step(model, kfac, x, y, lf)
    got = kfac.factors()
    for name, (A, G) in ref.items():
        print(f"{fisher} {approx} {name}: A {_rel(got[name][0], A):.1e} "
              f"G {_rel(got[name][1], G):.1e}")
        assert _rel(got[name][0], A) < TOL and _rel(got[name][1], G) < TOL


@pytest.mark.parametrize("fisher", ["empirical", "type-2"])
@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_a_conv_nets_first_factor_update_is_kfac_factors(fisher, approx):
    """Conv2d (its L patches one sample's rows) and a Linear, a per-image CE: kfac_factors's
    factors (the empirical G's count: the B images)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(),
                          nn.Linear(48, 4)).double()
    x, y = torch.randn(5, 2, 4, 4, dtype=f64), torch.tensor([0, 3, 1, 2, 1])
    lf = nn.CrossEntropyLoss()
    ref = kfac_factors(model, lf, x, y, fisher_type=fisher, kfac_approx=approx)
    _, kfac = _kfac(model, fisher_type=fisher, kfac_approx=approx)
    _step(model, kfac, x, y, lf)
    for name, (A, G) in ref.items():
        got = kfac.factors()[name]
        assert _rel(got[0], A) < TOL and _rel(got[1], G) < TOL


class MaskedTokens(nn.Module):
    """TokenNet's layers, the outputs averaged over each sample's real tokens (the reduce
    setting with right padding: ``attention_mask`` 0 at the padded positions)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, 4), nn.Linear(4, 5)

    def forward(self, x, attention_mask):
        m = attention_mask.unsqueeze(-1).to(x.dtype)
        return (self.fc2(torch.tanh(self.fc1(x))) * m).sum(1) / m.sum(1)


def test_reduce_with_ragged_padding_averages_each_samples_real_rows():
    """A token mask with samples of 4, 2 and 3 real tokens: reduce's A and type-2 G are those
    of the samples without their padding (kfac_factors on each sample alone, combined: A the
    mean of the samples' A, G = R x the sum of the samples' sum-reduced G)."""
    torch.manual_seed(0)
    model = MaskedTokens().double()
    x = torch.randn(3, 4, 3, dtype=f64)
    lengths = [4, 2, 3]
    mask = torch.tensor([[1] * n + [0] * (4 - n) for n in lengths])
    y = torch.tensor([1, 4, 0])
    lf = nn.CrossEntropyLoss()
    alone = [kfac_factors(_Alone(model, n), nn.CrossEntropyLoss(reduction="sum"), x[i:i + 1, :n],
                          y[i:i + 1], kfac_approx="reduce") for i, n in enumerate(lengths)]
    _, kfac = _kfac(model, fisher_type="type-2", kfac_approx="reduce")
    out = model(x, attention_mask=mask)
    kfac.curvature_backward(out, y, lf)
    lf(out, y).backward()
    kfac.step()
    report = kfac.capture_report()
    assert str(report).count("tokens") == 2, report  # both layers read the mask
    for name in ("fc1", "fc2"):
        A = sum(f["m." + name][0] for f in alone) / 3
        G = sum(f["m." + name][1] for f in alone) / 3
        got = kfac.factors()[name]
        assert _rel(got[0], A) < TOL and _rel(got[1], G) < TOL


class _Alone(nn.Module):
    """One unpadded sample through the same model (its mask all ones)."""

    def __init__(self, model, n):
        super().__init__()
        self.m, self.n = model, n

    def forward(self, x):
        return self.m(x, attention_mask=torch.ones(1, self.n, dtype=torch.long))


class _Rare(nn.Module):
    """A layer called on the rows that pass a test no row of these batches passes: 0 rows."""

    def __init__(self):
        super().__init__()
        self.a, self.rare, self.b = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        return self.b(h + self.rare(h[x[:, 0] > 100]).sum(0))


def test_a_layer_with_no_rows_sits_the_columns_update_out():
    """type-2: the 0-row layer counts no_rows and keeps no factors; the others update."""
    torch.manual_seed(0)
    model = _Rare().double()
    x, y = torch.randn(5, 3, dtype=f64), torch.tensor([0, 1, 0, 1, 1])
    _, kfac = _kfac(model, fisher_type="type-2")
    _step(model, kfac, x, y, nn.CrossEntropyLoss())
    counters = kfac.counters()
    assert counters["rare"]["no_rows"] == 1 and counters["rare"]["updates"] == 0
    assert counters["a"]["updates"] == 1 and counters["b"]["updates"] == 1


def test_reduce_and_expand_differ_on_a_weight_shared_model():
    torch.manual_seed(0)
    model = TokenNet(per_token=False).double()
    x, y = _data(False)
    lf = nn.CrossEntropyLoss()
    states = []
    for approx in ("expand", "reduce"):
        _, kfac = _kfac(model, fisher_type="type-2", kfac_approx=approx)
        _step(model, kfac, x, y, lf)
        states.append(kfac.factors())
        kfac.remove()
    for name in states[0]:
        assert _rel(states[1][name][0], states[0][name][0]) > 0.05
        assert _rel(states[1][name][1], states[0][name][1]) > 0.05


def test_a_factor_step_without_curvature_backward_is_an_error():
    torch.manual_seed(0)
    model = TokenNet().double()
    x, y = _data(True)
    _, kfac = _kfac(model, fisher_type="type-2")
    nn.CrossEntropyLoss()(model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"fc1 has statistics.*curvature_backward"):
        kfac.step()


def test_curvature_backward_is_a_noop_off_factor_steps_and_for_empirical():
    """Returns the columns it ran: C on a factor step, 0 on the next (factor_freq=2) and
    always 0 for "empirical"; it writes no .grad and leaves the parameters."""
    torch.manual_seed(0)
    model = TokenNet().double()
    x, y = _data(True)
    lf = nn.CrossEntropyLoss()
    _, kfac = _kfac(model, fisher_type="type-2", factor_freq=2)
    before = [p.detach().clone() for p in model.parameters()]
    out = model(x)
    assert kfac.curvature_backward(out, y, lf) == 5
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    lf(out, y).backward()
    kfac.step()
    kfac.zero_grad()
    out = model(x)
    assert kfac.curvature_backward(out, y, lf) == 0  # step 1: no factor update
    _, empirical = _kfac(TokenNet().double())
    assert empirical.curvature_backward(out, y, lf) == 0


def test_the_self_check_verifies_the_columns_and_the_training_rows():
    """With the check on (default), a type-2 step checks every layer and passes; the
    columns' rows are committed to it like a backward's (a column whose rows were not
    committed would compare a nonzero weight gradient with nothing: a release)."""
    torch.manual_seed(0)
    model = TokenNet().double()
    x, y = _data(True)
    _, kfac = _kfac(model, fisher_type="type-2")
    _step(model, kfac, x, y, nn.CrossEntropyLoss())
    report = kfac.capture_report()
    assert not kfac._capture.check.released
    assert all(kfac._capture.check.verdicts[n]["weight"] == "pass" for n in ("fc1", "fc2"))
    assert "pass" in str(report)


def test_zero_grad_between_the_columns_and_the_backward_keeps_them():
    torch.manual_seed(0)
    model = TokenNet().double()
    x, y = _data(True)
    lf = nn.CrossEntropyLoss()
    ref = kfac_factors(model, lf, x, y)
    _, kfac = _kfac(model, fisher_type="type-2")
    out = model(x)
    kfac.curvature_backward(out, y, lf)
    kfac.zero_grad()
    lf(out, y).backward()
    kfac.step()
    for name, (A, G) in ref.items():
        assert _rel(kfac.factors()[name][1], G) < TOL


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradient_accumulation_gives_the_full_batchs_factors(reduction):
    """Two micro-batches of a loss divided by 2 (the empirical G's convention) give the
    factors of the whole batch: mean, the curvature of the whole batch's mean; sum, of the
    mean of the two halves' sums."""
    torch.manual_seed(0)
    model = TokenNet().double()
    x, y = _data(True)
    lf = nn.CrossEntropyLoss(reduction=reduction)
    ref = kfac_factors(model, lf, x, y)
    _, kfac = _kfac(model, fisher_type="type-2")
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        out = model(xs)
        kfac.curvature_backward(out, ys, lf)
        (lf(out, ys) / 2).backward()
    kfac.step()
    for name, (A, G) in ref.items():
        A2, G2 = kfac.factors()[name]
        expected = G if reduction == "mean" else G / 2
        assert _rel(A2, A) < TOL and _rel(G2, expected) < TOL


def test_a_loss_scale_leaves_the_columns_unscaled():
    """grad_scale=1024 with the loss scaled by 1024: the same A and G as without."""
    results = []
    for scale in (1.0, 1024.0):
        torch.manual_seed(0)
        model = TokenNet().double()
        x, y = _data(True)
        _, kfac = _kfac(model, fisher_type="type-2", grad_scale=scale)
        _step(model, kfac, x, y, nn.CrossEntropyLoss(), scale=scale)
        results.append(kfac.factors())
    for name, (A, G) in results[0].items():
        assert _rel(results[1][name][0], A) < TOL and _rel(results[1][name][1], G) < TOL


def test_a_grad_scaler_leaves_the_columns_unscaled():
    """torch.amp.GradScaler (scale 1024) stepping K-FAC: the first factors are kfac_factors's."""
    torch.manual_seed(0)
    model = TokenNet().double()
    x, y = _data(True)
    lf = nn.CrossEntropyLoss()
    ref = kfac_factors(model, lf, x, y)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    _, kfac = _kfac(model, fisher_type="type-2", grad_scaler=scaler)
    out = model(x)
    kfac.curvature_backward(out, y, lf)
    scaler.scale(lf(out, y)).backward()
    scaler.step(kfac)
    scaler.update()
    for name, (A, G) in ref.items():
        assert _rel(kfac.factors()[name][0], A) < TOL and _rel(kfac.factors()[name][1], G) < TOL


def test_state_dict_round_trip_continues_bit_for_bit():
    lf = nn.CrossEntropyLoss()

    def make():
        torch.manual_seed(0)
        model = TokenNet().double()
        opt, kfac = _kfac(model, fisher_type="mc", kfac_approx="reduce",
                          generator=torch.Generator().manual_seed(1), inv_freq=1)
        return model, opt, kfac
    model, _, kfac = make()
    for t in range(2):
        _step(model, kfac, *_data(True, seed=t), lf)
    saved, params = kfac.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    gen_state = kfac.generator.get_state()
    _step(model, kfac, *_data(True, seed=2), lf)
    model2, _, kfac2 = make()
    model2.load_state_dict(params)
    kfac2.load_state_dict(saved)
    kfac2.generator.set_state(gen_state)
    _step(model2, kfac2, *_data(True, seed=2), lf)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    for name, (A, G) in kfac.factors().items():
        assert torch.equal(kfac2.factors()[name][0], A)
        assert torch.equal(kfac2.factors()[name][1], G)


def test_an_expert_routed_no_token_keeps_its_state():
    """A fused Mixtral experts block (float64) and a head, one token (top-2 of 4 experts),
    type-2: the two routed experts take kfac_factors's A_e, G_e; the other two count
    ``no_rows`` and keep their factors and zero updates."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral import modeling_mixtral
    config = transformers.MixtralConfig(hidden_size=16, intermediate_size=12,
                                        num_local_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    moe = modeling_mixtral.MixtralSparseMoeBlock(config).double()
    for p in moe.parameters():
        nn.init.normal_(p, std=0.3)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.moe, self.head = moe, nn.Linear(16, 5).double()

        def forward(self, x):
            return self.head(self.moe(x.unsqueeze(0)).squeeze(0))
    model = Net()
    x, y, lf = torch.randn(1, 16, dtype=f64), torch.tensor([3]), nn.CrossEntropyLoss()
    ref = kfac_factors(model, lf, x, y)
    _, kfac = _kfac(model, fisher_type="type-2")
    before = {k: v.clone() for k, v in kfac._state["moe.experts.down_proj"].items()
              if isinstance(v, torch.Tensor)}
    _step(model, kfac, x, y, lf)
    for name in ("moe.experts.gate_up_proj", "moe.experts.down_proj"):
        counters = kfac.counters()[name]
        routed = counters["updates"] == 1
        assert routed.sum() == 2 and torch.equal(counters["no_rows"], (~routed).long())
        A, G = kfac.factors()[name]
        for e in range(4):
            if routed[e]:
                assert _rel(A[e], ref[name][0][e]) < TOL and _rel(G[e], ref[name][1][e]) < TOL
            elif name.endswith("down_proj"):
                assert torch.equal(A[e], before["A"][e]) and torch.equal(G[e], before["G"][e])


@pytest.mark.parametrize("kwargs, match", [
    (dict(fisher_type="fisher"), "fisher_type"),
    (dict(kfac_approx="mean"), "kfac_approx"),
    (dict(fisher_type="mc", mc_samples=0), "mc_samples"),
    (dict(fisher_type="type-2", mc_samples=4), "mc_samples"),
    (dict(fisher_type="empirical", generator=torch.Generator()), "generator"),
    (dict(fisher_type="type-2", grad_hook="module"), "grad_hook"),
])
def test_bad_flavour_options_are_named(kwargs, match):
    model = TokenNet().double()
    with pytest.raises(ValueError, match=match):
        _kfac(model, **kwargs)


def test_reduce_is_refused_where_the_samples_cannot_be_derived():
    """A model with a batch_first=False module (the rows after it are sequence-first), an
    nn.MultiheadAttention out-projection (its rows come from the attention kernel)."""
    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru, self.fc = nn.GRU(3, 4), nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(self.gru(x)[0])
    with pytest.raises(ValueError, match="gru has batch_first=False"):
        _kfac(Recurrent(), kfac_approx="reduce")
    attention = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    with pytest.raises(ValueError, match="self_attn.out_proj is an nn.MultiheadAttention"):
        _kfac(attention, kfac_approx="reduce")


def test_one_reduction_per_step():
    torch.manual_seed(0)
    model = TokenNet().double()
    x, y = _data(True)
    _, kfac = _kfac(model, fisher_type="type-2")
    kfac.curvature_backward(model(x), y, nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="reduction"):
        kfac.curvature_backward(model(x), y, nn.CrossEntropyLoss(reduction="sum"))


def _ddp_rank(rank, world):
    torch.manual_seed(0)
    model = TokenNet().double()
    ddp = nn.parallel.DistributedDataParallel(model)
    _, kfac = _kfac(ddp, fisher_type="type-2")
    x, y = _data(True, N=8)
    xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
    lf = nn.CrossEntropyLoss()
    out = ddp(xs)
    kfac.curvature_backward(out, ys, lf)
    lf(out, ys).backward()
    kfac.step()
    return {n: (A, G) for n, (A, G) in kfac.factors().items()}


def test_two_gloo_ranks_hold_the_single_process_factors_of_the_union():
    """DDP on 2 ranks, each half the batch: every rank's type-2 factors are those of one
    process on the whole batch (the columns' sums and counts all-reduced)."""
    torch.manual_seed(0)
    model = TokenNet().double()
    x, y = _data(True, N=8)
    ref = kfac_factors(model, nn.CrossEntropyLoss(), x, y)
    for factors in run(_ddp_rank, 2):
        for name, (A, G) in ref.items():
            assert _rel(factors[name][0], A) < TOL and _rel(factors[name][1], G) < TOL


def _fsdp2_rank(rank, world):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = fully_shard(TokenNet().double())
    _, kfac = _kfac(model, fisher_type="type-2")
    x, y = _data(True, N=2)
    try:
        kfac.curvature_backward(model(x), y, nn.CrossEntropyLoss())
    except RuntimeError as error:
        return str(error)
    return None


def test_fsdp2_is_refused_by_name():
    """Under FSDP2 the columns' extra backward passes would run its gradient hooks: refused,
    naming the fully_shard modules, on every rank."""
    for message in run(_fsdp2_rank, 2):
        assert message is not None and "FSDP2 (fully_shard) modules ['<model>']" in message
