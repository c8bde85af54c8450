"""MKOR and K-FAC on real transformers models (GPT-2, BERT), built offline from tiny
configs with random weights: coverage, the Conv1D layout, the size guard at GPT-2's
vocabulary, padding invariance and gradient accumulation.

float64 throughout where the claim is numerical (``model.double()``), so tolerances only
absorb different summation orders (a few ulps of 2^-52 per operation).
"""
import resource
import time
import warnings

import pytest
import torch
import torch.nn as nn

from torch_impl.baselines import KFAC

from torch_impl.mkor import MKOR

from theory_tests.support.hf_cases import (Conv1D, is_identity, lm_batch, linears, max_rel_err, snapshot, tiny_bert,
                      tiny_gpt2, update_rel_err)

f64 = torch.float64
PRECONDITIONERS = {"mkor": MKOR, "kfac": KFAC}


def _wrap(kind, model, lr=0.05, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return PRECONDITIONERS[kind](model, opt, inv_freq=1, **kwargs)


def _train(model, pre, batches, micro=1):
    for batch in batches:
        n = batch["input_ids"].shape[0]
        for k in range(micro):
            part = {key: v[k * n // micro:(k + 1) * n // micro] for key, v in batch.items()}
            (model(**part).loss / micro).backward()
        pre.step()
        pre.zero_grad()


# -- 1. coverage ----------------------------------------------------------------------------
GPT2_CONV1D = [f"transformer.h.{i}.{m}" for i in range(2)
               for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]


@pytest.mark.parametrize("kind", ["mkor", "kfac"])
def test_gpt2_coverage(kind):
    """Every attention/MLP Conv1D of a 2-layer GPT2LMHeadModel is preconditioned (8 modules,
    nothing else); the tied ``lm_head`` is skipped because of the tie; embeddings and
    LayerNorms are skipped with their reasons."""
    model = tiny_gpt2(dtype=torch.float32)
    pre = _wrap(kind, model)
    assert pre.preconditioned_modules == GPT2_CONV1D
    reasons = pre.skip_reasons
    assert "lm_head" in reasons and "tied" in reasons["lm_head"]
    assert "transformer.wte" in reasons["lm_head"]
    for name in ("transformer.wte", "transformer.wpe"):
        assert reasons[name].startswith("embedding")
    norms = [n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)]
    assert len(norms) == 5
    for name in norms:
        assert reasons[name].startswith("normalisation")
    assert set(pre.skipped_modules) == {"lm_head", "transformer.wte", "transformer.wpe", *norms}


@pytest.mark.parametrize("kind", ["mkor", "kfac"])
def test_bert_coverage(kind):
    """BertForMaskedLM: every Linear (q/k/v, attention output, intermediate, output, MLM
    transform) is preconditioned; the MLM decoder (tied to the word embeddings) is skipped
    with a tie reason; embeddings and LayerNorms are skipped."""
    model = tiny_bert(dtype=torch.float32)
    pre = _wrap(kind, model)
    expected = [n for n in linears(model) if n != "cls.predictions.decoder"]
    assert len(expected) == 2 * 6 + 1
    assert pre.preconditioned_modules == expected
    reasons = pre.skip_reasons
    assert "tied" in reasons["cls.predictions.decoder"]
    assert "bert.embeddings.word_embeddings" in reasons["cls.predictions.decoder"]
    for name in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
        assert reasons[f"bert.embeddings.{name}"].startswith("embedding")
    norms = [n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)]
    for name in norms:
        assert reasons[name].startswith("normalisation")


# -- 2. Conv1D math -------------------------------------------------------------------------
class _Head(nn.Module):
    """x -> tanh(layer(x)) -> fixed linear read-out; ``layer`` a Conv1D or an nn.Linear."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return torch.tanh(self.layer(x)).sum(-1)


def _conv1d_pair(seed=0):
    torch.manual_seed(seed)
    conv = Conv1D(5, 4).double()             # weight (nx=4, nf=5): y = x W + b
    with torch.no_grad():
        conv.weight.normal_()
        conv.bias.normal_()
    lin = nn.Linear(4, 5).double()           # weight (5, 4): y = x W^T + b
    with torch.no_grad():
        lin.weight.copy_(conv.weight.T)
        lin.bias.copy_(conv.bias)
    return conv, lin


def _xy(t):
    g = torch.Generator().manual_seed(100 + t)
    return torch.randn(3, 6, 4, generator=g, dtype=f64), torch.randn(3, 6, generator=g,
                                                                     dtype=f64)


def _run_head(layer, steps=3):
    """MKOR (inv_freq=1) on _Head(layer); returns per-step (raw grad W (d_out, d_in) matrix
    layout, raw grad b, preconditioned grad W, preconditioned grad b, L_inv, R_inv)."""
    model = _Head(layer)
    mkor = _wrap("mkor", model, lr=0.1, factor_dtype="float64")
    assert mkor.preconditioned_modules == ["layer"]
    as_matrix = (lambda w: w.T) if isinstance(layer, Conv1D) else (lambda w: w)
    out = []
    for t in range(steps):
        x, y = _xy(t)
        ((model(x) - y) ** 2).mean().backward()
        raw = (as_matrix(layer.weight.grad).clone(), layer.bias.grad.clone())
        mkor.step()
        L, R = mkor.inverse_factors()["layer"]
        out.append((*raw, as_matrix(layer.weight.grad).clone(), layer.bias.grad.clone(),
                    L.clone(), R.clone()))
        mkor.zero_grad()
    return out


def test_conv1d_preconditioned_gradient_is_the_formula():
    """On transformers' Conv1D (W stored d_in x d_out) the gradient MKOR hands the backbone
    is (s L^-1 [grad W^T | grad b] R^-1)^T with s = ||Ghat|| / ||Delta||, from the factors
    ``inverse_factors()`` holds after the step (inv_freq=1: updated before preconditioning).
    float64; 1e-12 relative covers GEMM reassociation (~d ulps)."""
    conv, _ = _conv1d_pair()
    for gW, gb, pW, pb, L, R in _run_head(conv):
        G_hat = torch.cat([gW, gb[:, None]], dim=1)
        delta = L @ G_hat @ R
        expected = delta * (G_hat.norm() / delta.norm())
        assert not is_identity(L) and not is_identity(R)
        assert torch.allclose(pW, expected[:, :-1], rtol=1e-12, atol=1e-14)
        assert torch.allclose(pb, expected[:, -1], rtol=1e-12, atol=1e-14)


def test_conv1d_equals_linear_with_transposed_weight():
    """The Conv1D layout adapter is exact: a Linear holding W^T (same bias, same inputs)
    gets the same factors and the same preconditioned gradient (transposed back) at every
    step of a 3-step run. Tolerance 1e-13 relative: the two layers' raw gradients come from
    different GEMM layouts (a^T g vs g^T a), which may round differently."""
    conv, lin = _conv1d_pair()
    for c, l in zip(_run_head(conv), _run_head(lin)):
        for a, b in zip(c, l):
            assert torch.allclose(a, b, rtol=1e-13, atol=1e-15)


# -- 3. size guard ---------------------------------------------------------------------------
def _vm_hwm_kib():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


@pytest.mark.parametrize("kind", ["mkor", "kfac"])
def test_size_guard_at_gpt2_vocabulary(kind, capsys):
    """An untied GPT2LMHeadModel with GPT-2's 50,257-token vocabulary (n_embd 32, 1 layer):
    the wrapper warns once, naming lm_head and the memory saved (50257^2 x 4 B = 9.41 GiB for
    MKOR's float32 inverse, twice that for K-FAC's factor + eigenvectors); lm_head keeps its
    32 x 32 input factor only (GPT-2's head has no bias); a step works and the peak RSS
    grows by far less than one 50257^2 factor would need."""
    model = tiny_gpt2(dtype=torch.float32, n_layer=1, vocab=50257, tie=False)
    hwm0 = _vm_hwm_kib()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pre = _wrap(kind, model, lr=0.01)
    guard = [w for w in caught if "max_factor_dim" in str(w.message)]
    assert len(guard) == 1
    msg = str(guard[0].message)
    assert "lm_head (L: 50257 x 50257)" in msg
    gib = 50257 ** 2 * 4 / 2 ** 30 * (1 if kind == "mkor" else 2)
    assert f"{gib:.2f} GiB" in msg
    assert "lm_head" in pre.preconditioned_modules
    if kind == "mkor":
        L, R = pre.inverse_factors()["lm_head"]
        assert L is None and R.shape == (32, 32)
    ids = torch.randint(0, 50257, (2, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    before = snapshot(model)
    t0 = time.perf_counter()
    model(**batch).loss.backward()
    pre.step()
    pre.zero_grad()
    seconds = time.perf_counter() - t0
    grown_gib = (_vm_hwm_kib() - hwm0) / 2 ** 20
    if kind == "kfac":
        A, G = pre.factors()["lm_head"]
        assert G is None and A.shape == (32, 32)
    else:
        assert not is_identity(pre.inverse_factors()["lm_head"][1])
    assert not torch.equal(before["lm_head.weight"], model.lm_head.weight)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert grown_gib < 2.0
    with capsys.disabled():
        print(f"\n[size guard {kind}] peak RSS growth {grown_gib * 1024:.1f} MiB, "
              f"one step {seconds * 1e3:.0f} ms")


@pytest.mark.parametrize("side", ["L", "R"])
def test_one_sided_preconditioning_formula(side):
    """With a factor side above ``max_factor_dim`` left at the identity, MKOR's gradient is
    L^-1 Ghat (side R identity) or Ghat R^-1 (side L identity), rescaled to ||Ghat||."""
    torch.manual_seed(0)
    if side == "R":   # Linear(6 -> 5): d_in' = 7 > 6 = max_factor_dim >= d_out = 5
        layer, limit, d_in = nn.Linear(6, 5).double(), 6, 6
    else:             # Linear(4 -> 9): d_out = 9 > 6 >= d_in' = 5
        layer, limit, d_in = nn.Linear(4, 9).double(), 6, 4
    model = _Head(layer)
    with pytest.warns(UserWarning, match="max_factor_dim"):
        mkor = _wrap("mkor", model, factor_dtype="float64", max_factor_dim=limit)
    g = torch.Generator().manual_seed(1)
    for t in range(3):
        x, y = torch.randn(7, d_in, generator=g, dtype=f64), torch.randn(7, generator=g,
                                                                          dtype=f64)
        ((model(x) - y) ** 2).mean().backward()
        G_hat = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1).clone()
        mkor.step()
        L, R = mkor.inverse_factors()["layer"]
        if side == "R":
            assert R is None and L.shape == (5, 5) and not is_identity(L)
            delta = L @ G_hat
        else:
            assert L is None and R.shape == (5, 5) and not is_identity(R)
            delta = G_hat @ R
        expected = delta * (G_hat.norm() / delta.norm())
        assert torch.allclose(layer.weight.grad, expected[:, :-1], rtol=1e-12, atol=1e-14)
        assert torch.allclose(layer.bias.grad, expected[:, -1], rtol=1e-12, atol=1e-14)
        mkor.zero_grad()


# -- 4. padding invariance --------------------------------------------------------------------
MODELS = {"gpt2": tiny_gpt2, "bert": tiny_bert}
LENGTHS = [8, 5, 3, 6]


def _padded_run(model_name, kind, pad_seed, token_mask="attention_mask"):
    model = MODELS[model_name]()
    pre = _wrap(kind, model, token_mask=token_mask,
                **({"factor_dtype": "float64"} if kind == "mkor" else {}))
    _train(model, pre, [lm_batch(t, lengths=LENGTHS, pad_seed=pad_seed + t) for t in range(2)])
    return snapshot(model)


@pytest.mark.parametrize("model_name", ["gpt2", "bert"])
@pytest.mark.parametrize("kind", ["mkor", "kfac"])
def test_padding_invariance(model_name, kind, capsys):
    """Two batch streams identical except the token ids at padded positions (attention_mask
    0, labels -100): with the default ``token_mask="attention_mask"`` the parameters after 2
    steps (inv_freq=1, float64) are bit-identical; with ``token_mask=None`` the padded rows
    enter the statistics and the runs differ (the comparison has teeth)."""
    a = _padded_run(model_name, kind, pad_seed=0)
    b = _padded_run(model_name, kind, pad_seed=50)
    assert all(torch.equal(a[n], b[n]) for n in a)
    a0 = _padded_run(model_name, kind, pad_seed=0, token_mask=None)
    b0 = _padded_run(model_name, kind, pad_seed=50, token_mask=None)
    rel = update_rel_err(a0, b0, snapshot(MODELS[model_name]()))
    assert rel > 1e-6
    with capsys.disabled():
        print(f"\n[padding {model_name}/{kind}] max rel. parameter difference without the "
              f"mask: {rel:.2e}")


# -- 5. accumulation ------------------------------------------------------------------------
@pytest.mark.parametrize("model_name", ["gpt2", "bert"])
@pytest.mark.parametrize("kind", ["mkor", "kfac"])
def test_accumulation_equals_full_batch(model_name, kind, capsys):
    """4 micro-batches of loss/4 per step equal the full batch of 8: parameters after 3 steps
    (inv_freq=1, float64, no padding) agree to 1e-10 relative to the largest parameter
    change (hf_cases.update_rel_err). (The gradients and statistics
    are sums in a different order, a few ulps per step; 3 steps of the preconditioned
    update amplify that by at most the factors' conditioning, far below 1e-10.)"""
    extra = {"factor_dtype": "float64"} if kind == "mkor" else {}
    batches = [lm_batch(t, batch=8) for t in range(3)]
    runs = []
    for micro in (1, 4):
        model = MODELS[model_name]()
        pre = _wrap(kind, model, **extra)
        _train(model, pre, batches, micro=micro)
        runs.append(snapshot(model))
    init = snapshot(MODELS[model_name]())
    assert max_rel_err(runs[0], init) > 1e-3  # the runs moved
    rel = update_rel_err(runs[1], runs[0], init)
    assert rel < 1e-10
    with capsys.disabled():
        print(f"\n[accumulation {model_name}/{kind}] max rel. error {rel:.2e}")
