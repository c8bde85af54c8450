"""MKOR and K-FAC statistics that are right by construction (torch_impl/kronecker/capture/README.md).

Each test compares a feature against the same run without it, or against statistics
computed here from recorded inputs and output gradients (never through the capture code):
a module called several times per forward under either checkpointing, token masks that
survive a reentrant recompute, masks chosen by a layer's place in an encoder-decoder model,
layers with no rows (alone and on some DDP ranks), stale statistics of a cleared gradient,
and the layers whose rows cannot be matched to a mask. float64 throughout.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as Fn
from torch.utils.checkpoint import checkpoint

from torch_impl.baselines import KFAC

from torch_impl.mkor import MKOR

from theory_tests.support.distributed_harness import run
from theory_tests.support.hf_cases import factors_of, snapshot

f64 = torch.float64
KINDS = {"mkor": MKOR, "kfac": KFAC}


def _wrap(kind, model, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    extra = {"factor_dtype": "float64"} if kind == "mkor" else {}
    return KINDS[kind](model, opt, inv_freq=1, **extra, **kwargs)


# -- a module called several times per forward, under checkpointing -------------------------
class _Shared(nn.Module):
    """ALBERT's pattern: one Linear applied three times per forward, then a head."""

    def __init__(self, mode):
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)
        self.mode = mode
        self.double()

    def _body(self, h):
        for _ in range(3):
            h = torch.tanh(self.shared(h))
        return h

    def forward(self, x):
        if self.mode == "plain":
            h = self._body(x)
        else:
            h = checkpoint(self._body, x, use_reentrant=self.mode == "reentrant")
        return self.head(h)


def _shared_batch(t):
    g = torch.Generator().manual_seed(t)
    x = torch.randn(5, 6, generator=g, dtype=f64, requires_grad=True)
    return x, torch.randn(5, 3, generator=g, dtype=f64)


def _shared_run(kind, mode, steps=3):
    model = _Shared(mode)
    pre = _wrap(kind, model)
    vectors = []
    for t in range(steps):
        x, y = _shared_batch(t)
        Fn.mse_loss(model(x), y).backward()
        if kind == "mkor":
            vectors.append(pre.pending_vectors())
        pre.step()
        pre.zero_grad()
    return snapshot(model), factors_of(pre), vectors


@pytest.mark.parametrize("kind", ["mkor", "kfac"])
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_a_module_called_three_times_keeps_every_call_under_checkpointing(kind, mode):
    """Every one of the three calls of the shared Linear is paired with its own gradient,
    whichever checkpointing recomputes them: the factors and parameters after 3 steps equal
    the run without checkpointing exactly (the same rows and gradients, committed in the same
    order). The old rule (drop statistics when .grad is None at forward time) kept one call
    out of three under non-reentrant checkpointing."""
    plain = _shared_run(kind, "plain")
    ckpt = _shared_run(kind, mode)
    for name, pair in plain[1].items():
        for a, b in zip(pair, ckpt[1][name]):
            assert a is None and b is None or torch.equal(a, b), name
    assert all(torch.equal(plain[0][n], ckpt[0][n]) for n in plain[0])


def test_the_shared_layers_vectors_are_the_mean_over_all_three_calls():
    """Independent of the capture code: a_bar of the shared Linear is the mean of [a | 1]
    over the 15 rows of its three calls, and g_bar the sum of their output gradients (K3,
    K6), recorded with plain forward hooks and retain_grad."""
    model = _Shared("non_reentrant")
    pre = _wrap("mkor", model)
    ins, outs = [], []

    def record(module, args, output):
        ins.append(args[0].detach())
        output.retain_grad()
        outs.append(output)
    handle = model.shared.register_forward_hook(record)
    x, y = _shared_batch(0)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        Fn.mse_loss(model(x), y).backward()
    handle.remove()
    ins, outs = ins[:3], outs[:3]  # the recompute's calls follow the three real ones
    a_bar, g_bar = pre.pending_vectors()["shared"]
    rows = torch.cat(ins)
    torch.testing.assert_close(a_bar, torch.cat([rows.mean(0), torch.ones(1, dtype=f64)]),
                               rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(g_bar, sum(o.grad.sum(0) for o in outs), rtol=1e-13,
                               atol=1e-15)


# -- token masks that survive a reentrant recompute (HF Llama) -------------------------------
def _llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                      use_cache=False, attention_dropout=0.0)
    return LlamaForCausalLM(cfg).to(f64).train()


def _padded(t, pad_seed):
    g = torch.Generator().manual_seed(t)
    ids = torch.randint(1, 50, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, 4:] = 0
    mask[2, 6:] = 0
    pads = torch.randint(1, 50, (3, 7), generator=torch.Generator().manual_seed(pad_seed + t))
    ids = torch.where(mask.bool(), ids, pads)
    return {"input_ids": ids, "attention_mask": mask,
            "labels": torch.where(mask.bool(), ids, -100)}


def _llama_run(kind, pad_seed, checkpointing, token_mask="attention_mask"):
    model = _llama()
    if checkpointing is not None:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    pre = _wrap(kind, model, token_mask=token_mask)
    for t in range(2):
        model(**_padded(t, pad_seed)).loss.backward()
        pre.step()
        pre.zero_grad()
    return snapshot(model), pre


@pytest.mark.parametrize("kind", ["mkor", "kfac"])
def test_reentrant_checkpointing_keeps_padded_positions_out(kind):
    """Llama with HF's reentrant gradient checkpointing: the statistics are captured in the
    recompute during backward, after the model's forward has returned; the recompute finds
    its call's attention_mask again, so changing only the ids at padded positions leaves the
    parameters bit-identical, and they equal the run without checkpointing (float64, the
    same operations in the same order). Without the mask the two streams differ: the test
    has teeth."""
    a, _ = _llama_run(kind, 0, "reentrant")
    b, pre = _llama_run(kind, 77, "reentrant")
    assert all(torch.equal(a[n], b[n]) for n in a)
    plain, _ = _llama_run(kind, 0, None)
    assert all(torch.equal(a[n], plain[n]) for n in a)
    assert pre.unmasked_reasons == {}
    a0, _ = _llama_run(kind, 0, "reentrant", token_mask=None)
    b0, _ = _llama_run(kind, 77, "reentrant", token_mask=None)
    assert not all(torch.equal(a0[n], b0[n]) for n in a0)


# -- masks from where a layer sits: T5 ------------------------------------------------------
def _t5(seed=0):
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=40, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                   num_decoder_layers=1, num_heads=2, dropout_rate=0.0,
                   decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(cfg).to(f64).train()


def _t5_batch():
    """Encoder and decoder padded to the same length (6), with different masks."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 40, (2, 6), generator=g)
    enc_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    labels = torch.randint(1, 40, (2, 6), generator=g)
    labels[0, 2:] = -100
    labels[1, 5:] = -100
    return {"input_ids": ids, "attention_mask": enc_mask, "labels": labels}


def _is_cross_kv(name):
    return "EncDecAttention" in name and name.rsplit(".", 1)[-1] in ("k", "v")


@pytest.mark.parametrize("checkpointing", [None, "reentrant"])
def test_t5_layers_read_the_mask_of_where_they_sit(checkpointing):
    """Encoder layers and cross-attention keys/values use the encoder's attention_mask;
    decoder self-attention, cross-attention queries/outputs and FFNs use labels != -100
    (no decoder_attention_mask given). Checked against a_bar computed here from each layer's
    recorded input rows and the mask its place prescribes, with the two sequences of equal
    length (the case a shape-based rule got wrong), with and without reentrant checkpointing."""
    model = _t5()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    pre = _wrap("mkor", model)
    batch = _t5_batch()
    rows = {}

    def recorder(name):
        def hook(module, args, out):
            rows.setdefault(name, args[0].detach())  # the first call (not a recompute)
        return hook
    handles = [m.register_forward_hook(recorder(name))
               for name, m in model.named_modules() if name in pre.preconditioned_modules]
    model(**batch).loss.backward()
    for h in handles:
        h.remove()
    vectors = pre.pending_vectors()
    enc, dec = batch["attention_mask"].bool(), batch["labels"] != -100
    assert set(vectors) == set(pre.preconditioned_modules) and vectors
    for name, (a_bar, _) in vectors.items():
        mask = enc if name.startswith("encoder.") or _is_cross_kv(name) else dec
        x = rows[name][mask]
        expected = x.mean(0)
        if model.get_submodule(name).bias is not None:
            expected = torch.cat([expected, torch.ones(1, dtype=f64)])
        torch.testing.assert_close(a_bar, expected, rtol=1e-13, atol=1e-15, msg=name)
    assert pre.unmasked_reasons == {}


def test_an_encoder_decoder_call_without_a_decoder_mask_lists_the_decoder_layers():
    """No decoder_attention_mask and no labels: the decoder rows cannot be matched to a mask,
    so they are all used and every decoder layer except the cross-attention keys/values is
    listed with the reason; the encoder's layers are masked as usual."""
    model = _t5()
    pre = _wrap("mkor", model)
    batch = _t5_batch()
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                decoder_input_ids=batch["input_ids"])
    out.logits.sum().backward()
    listed = pre.unmasked_reasons
    decoder = [n for n in pre.preconditioned_modules if n.startswith("decoder.")
               and not _is_cross_kv(n)]
    assert decoder and set(listed) == set(decoder)
    assert all("decoder" in why for why in listed.values())


# -- rows that are not there ----------------------------------------------------------------
class _Experts(nn.Module):
    """A trunk and two Linear experts; ``route`` says how many rows expert 1 gets (expert 0
    gets the rest); an expert is called even with 0 rows (as loops over experts do)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(4, 5)
        self.experts = nn.ModuleList([nn.Linear(5, 3), nn.Linear(5, 3, bias=False)])
        self.double()

    def forward(self, x, route):
        h = torch.tanh(self.trunk(x))
        return torch.cat([self.experts[0](h[route:]), self.experts[1](h[:route])])


def _expert_batch(t, rank):
    g = torch.Generator().manual_seed(50 * t + rank)
    return (torch.randn(6, 4, generator=g, dtype=f64), torch.randn(6, 3, generator=g, dtype=f64))


@pytest.mark.parametrize("self_check", [True, None], ids=["checked", "unchecked"])
@pytest.mark.parametrize("kind", ["mkor", "kfac"])
def test_a_layer_called_with_zero_rows_counts_no_rows_not_a_non_finite_update(kind, self_check):
    """Expert 1 gets 0 rows at every step: it contributes nothing, its factors stay I, and
    the counters say "no rows", not a non-finite skip; the other layers update. With the
    self-check on, its 0-row statistics are refused as vacuous (S = 0) before the step
    divides; off, the step's own 0-row branch decides: both count "no rows"."""
    model = _Experts()
    pre = _wrap(kind, model, self_check=self_check)
    for t in range(3):
        x, y = _expert_batch(t, 0)
        Fn.mse_loss(model(x, route=0), y).backward()
        pre.step()
        pre.zero_grad()
    counters = pre.counters()
    assert counters["experts.1"]["no_rows"].item() == 3
    assert counters["experts.1"]["non_finite"].item() == 0
    assert int(pre.skipped_updates) == 0
    assert counters["experts.0"]["no_rows"].item() == 0
    factors = factors_of(pre)
    assert all(torch.equal(J, torch.eye(len(J), dtype=f64)) for J in factors["experts.1"])
    assert not torch.equal(factors["experts.0"][1], torch.eye(6, dtype=f64))


def _routes(rank):
    return 0 if rank == 0 else 4  # expert 1: no rows on rank 0, four on rank 1


def _experts_on_ranks(rank, world):
    out = {}
    for kind in ("mkor", "kfac"):
        model = nn.parallel.DistributedDataParallel(_Experts())
        pre = _wrap(kind, model)
        for t in range(3):
            x, y = _expert_batch(t, rank)
            Fn.mse_loss(model(x, route=_routes(rank)), y).backward()
            pre.step()
            pre.zero_grad()
        out[kind] = {"factors": factors_of(pre), "params": snapshot(model.module),
                     "counters": {n: {k: v.item() for k, v in c.items()}
                                  for n, c in pre.counters().items()}}
    return out


@pytest.fixture(scope="module")
def expert_ranks():
    return run(_experts_on_ranks, 2)


@pytest.mark.parametrize("kind", ["mkor", "kfac"])
def test_an_expert_with_no_rows_on_one_rank_equals_one_process_on_the_union(kind, expert_ranks):
    """DDP on 2 gloo ranks, expert 1 routed 0 rows on rank 0 and 4 on rank 1: the row counts
    travel with the sums, so every rank's factors and parameters equal one process that runs
    both ranks' batches with the loss averaged over the ranks (what DDP's gradient averaging
    computes), to float64 rounding of the reordered sums; no update is refused."""
    model = _Experts()
    pre = _wrap(kind, model)
    for t in range(3):
        loss = sum(Fn.mse_loss(model(x, route=_routes(r)), y)
                   for r, (x, y) in ((r, _expert_batch(t, r)) for r in (0, 1))) / 2
        loss.backward()
        pre.step()
        pre.zero_grad()
    reference, params = factors_of(pre), snapshot(model)
    for res in expert_ranks:
        got = res[kind]
        assert got["factors"].keys() == reference.keys()
        for name, pair in reference.items():
            for a, b in zip(got["factors"][name], pair):
                if a is not None:  # float64: reordered sums of a few rows, 3 steps
                    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
        for name, p in params.items():
            torch.testing.assert_close(got["params"][name], p, rtol=1e-12, atol=1e-13)
        assert all(c["non_finite"] == 0 and c["no_rows"] == 0 for c in got["counters"].values())


# -- stale statistics and unmatched rows ----------------------------------------------------
@pytest.mark.parametrize("kind", ["mkor", "kfac"])
def test_statistics_whose_gradient_was_cleared_never_reach_a_step(kind):
    """Forward + backward, then the model's own zero_grad() (not the preconditioner's) and a
    step: the statistics were settled into a gradient that no longer exists, so the step
    finds none and the factors stay as they are."""
    model = _Experts()
    pre = _wrap(kind, model)
    x, y = _expert_batch(0, 0)
    Fn.mse_loss(model(x, route=3), y).backward()
    model.zero_grad()
    pre.step()
    accepted = ("updates_a", "updates_g") if kind == "mkor" else ("updates",)
    assert all(c[k].item() == 0 for c in pre.counters().values() for k in accepted)
    Fn.mse_loss(model(x, route=3), y).backward()  # the next batch is captured as usual
    pre.step()
    assert all(c[k].item() == 1 for c in pre.counters().values() for k in accepted)


class _Pooled(nn.Module):
    """Token layers, then a pooler over the sequence: the pooler's rows are (B, d)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Linear(4, 4)
        self.pool = nn.Linear(4, 2)
        self.gathered = False
        self.double()

    def forward(self, x, attention_mask):
        h = torch.tanh(self.tok(x)) * attention_mask.unsqueeze(-1)
        if self.gathered:  # the last two positions of each row, picked by an index tensor
            return self.pool(h[:, torch.tensor([3, 4])])
        return self.pool(h.sum(1))


def test_rows_that_cannot_be_matched_to_the_mask_are_all_used_and_listed():
    """The pooler runs in a call with a (B, T) mask, but its rows are (B, d), one per sample
    (the positions were reduced away): all its rows are real and used, and the report says
    "per sample"; the token layer is masked; nothing is listed. Rows the tracker cannot
    follow (advanced indexing over the tokens) are used whole and listed with the reason."""
    model = _Pooled()
    pre = _wrap("mkor", model)
    x = torch.randn(2, 5, 4, dtype=f64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    model(x, attention_mask=mask).sum().backward()
    assert pre.unmasked_reasons == {}
    report = pre.capture_report()
    assert report["pool"]["mask"] == "per sample" and report["tok"]["mask"] == "tokens"
    a_bar, _ = pre.pending_vectors()["tok"]
    torch.testing.assert_close(a_bar[:-1], x[mask.bool()].mean(0), rtol=1e-14, atol=1e-15)
    pre.zero_grad()
    model.gathered = True  # the pooler reads rows picked by an index tensor
    model(x, attention_mask=mask).sum().backward()
    assert list(pre.unmasked_reasons) == ["pool"]
    assert "index" in pre.unmasked_reasons["pool"]


# -- nested reentrant regions and a mask set by hand ----------------------------------------
class _Tokens(nn.Module):
    """Token layers a -> b -> c; ``nest``: c(b(a)) in a reentrant region with b in a region
    nested inside it; "flat": one reentrant region; None: no checkpointing."""

    def __init__(self, nest):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 5), nn.Linear(5, 5), nn.Linear(5, 3)
        self.nest = nest
        self.double()

    def _inner(self, h):
        return torch.tanh(self.b(h))

    def _outer(self, h):
        h = torch.tanh(self.a(h))
        h = checkpoint(self._inner, h, use_reentrant=True) if self.nest == "nested" else self._inner(h)
        return self.c(h)

    def forward(self, x, attention_mask=None):
        if self.nest is None:
            return self._outer(x)
        return checkpoint(self._outer, x, use_reentrant=True)


def _token_batch(t, pad_seed):
    g = torch.Generator().manual_seed(t)
    x = torch.randn(3, 6, 4, generator=g, dtype=f64)
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[0, 3:] = 0
    mask[2, 5:] = 0
    noise = torch.randn(3, 6, 4, generator=torch.Generator().manual_seed(pad_seed + t), dtype=f64)
    x = torch.where(mask.bool().unsqueeze(-1), x, noise).requires_grad_()
    y = torch.randn(3, 6, 3, generator=g, dtype=f64) * mask.unsqueeze(-1)
    return x, mask, y


def _token_run(kind, nest, pad_seed, by_hand=False):
    model = _Tokens(nest)
    pre = _wrap(kind, model)
    for t in range(2):
        x, mask, y = _token_batch(t, pad_seed)
        if by_hand:
            with pre.masked(mask):
                out = model(x)
        else:
            out = model(x, attention_mask=mask)
        ((out * mask.unsqueeze(-1) - y) ** 2).sum().backward()
        pre.step()
        pre.zero_grad()
    return snapshot(model), pre


@pytest.mark.parametrize("kind", ["mkor", "kfac"])
@pytest.mark.parametrize("nest,by_hand", [("nested", False), ("flat", True)])
def test_masks_reach_nested_regions_and_masks_set_by_hand(kind, nest, by_hand):
    """A reentrant region nested in another (its node exists only during the outer
    recompute) and a mask set with ``masked()`` around a reentrant forward: the padded rows
    stay out (the noise at padded positions does not change the parameters) and the run
    equals the one without checkpointing, bit for bit; no layer is listed as unmasked."""
    a, pre = _token_run(kind, nest, 0, by_hand)
    b, _ = _token_run(kind, nest, 99, by_hand)
    plain, _ = _token_run(kind, None, 0, by_hand)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert all(torch.equal(a[n], plain[n]) for n in a)
    assert pre.unmasked_reasons == {}
