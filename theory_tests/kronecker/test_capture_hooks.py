"""MKOR module discovery and hook capture (K1-K6, KT8, KT10).

Vectors captured by the hooks are compared with explicit formulas computed from the
recorded layer inputs and output gradients, in float64 (tolerance 1e-12: sums of at
most a few hundred O(1) terms, so the only difference is summation order).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as Fn

from torch_impl.mkor import MKOR


f64 = torch.float64


class Mixed(nn.Module):
    """Every kind of layer discovery must sort: hooked, subclassed, skipped."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.grouped = nn.Conv2d(4, 4, 3, padding=1, groups=2)
        self.conv1d = nn.Conv1d(4, 4, 1)
        self.fc = nn.Linear(16, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = nn.LayerNorm(8)
        self.emb = nn.Embedding(5, 8)
        self.head = nn.Linear(8, 1, bias=False)

    def forward(self, x, tokens):
        h = torch.relu(self.grouped(torch.relu(self.conv(x))))   # (B, 4, 2, 2)
        h = self.conv1d(h.flatten(2)).flatten(1)                  # (B, 16)
        h = torch.relu(self.fc(h)).unsqueeze(1) + self.emb(tokens)  # (B, T, 8)
        h, _ = self.attn(h, h, h)
        return self.head(self.norm(h))


def test_discovery_lists_hooked_and_skipped_modules():
    """K1 (port): Linear and subclasses (MHA out_proj) and groups=1 Conv2d are
    preconditioned; grouped conv, Conv1d, MHA in-proj, LayerNorm, Embedding are not."""
    model = Mixed()
    mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert mkor.preconditioned_modules == ["conv", "fc", "attn.out_proj", "head"]
    assert mkor.skipped_modules == ["grouped", "conv1d", "attn", "norm", "emb"]
    wrapped = nn.DataParallel(Mixed())  # a `module.` prefix must not leak into names
    mkor = MKOR(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1))
    assert mkor.preconditioned_modules == ["conv", "fc", "attn.out_proj", "head"]
    mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1), skip_modules=["att*"])
    assert "attn.out_proj" in mkor.skipped_modules


def test_mha_out_proj_vectors_are_exact():
    """MHA never calls out_proj as a module; its vectors come through the parent.
    g_bar must equal the out_proj bias gradient (K6) and, by linearity,
    mean_rows(attn output) = a_bar[:-1] W^T + b (a_bar is the projection input mean)."""
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(8, 2, batch_first=True).double()
    mkor = MKOR(attn, torch.optim.SGD(attn.parameters(), lr=0.1), factor_dtype="float64")
    x = torch.randn(3, 5, 8, dtype=f64)
    out, _ = attn(x, x, x)
    (out.square().mean()).backward()
    a_bar, g_bar = mkor.pending_vectors()["out_proj"]
    W, b = attn.out_proj.weight, attn.out_proj.bias
    assert torch.allclose(g_bar, b.grad, rtol=0, atol=1e-12)
    assert torch.allclose(a_bar[:-1] @ W.T + b, out.detach().reshape(-1, 8).mean(0),
                          rtol=0, atol=1e-12)
    assert a_bar[-1] == 1


def test_mha_without_an_autograd_record_warns_once(monkeypatch):
    """If a future torch hides the out-projection's matmul, the layer must not be skipped
    silently: one RuntimeWarning names it, and its factors stay as they were."""
    import torch_impl.kronecker.capture.attention as attention
    monkeypatch.setattr(attention, "find_matmul_input", lambda output, weight: None)
    attn = nn.MultiheadAttention(8, 2, batch_first=True).double()
    mkor = MKOR(attn, torch.optim.SGD(attn.parameters(), lr=0.1), factor_dtype="float64")
    x = torch.randn(3, 5, 8, dtype=f64)
    with pytest.warns(RuntimeWarning, match="out_proj") as record:
        for _ in range(2):
            attn(x, x, x)[0].square().mean().backward()
    assert sum("out_proj" in str(w.message) for w in record) == 1
    assert "out_proj" not in mkor.pending_vectors()


def _record(module):
    """Record the input and output gradient of every call of ``module``."""
    seen = {"x": [], "g": []}
    module.register_forward_pre_hook(lambda m, i: seen["x"].append(i[0].detach()))
    module.register_full_backward_hook(lambda m, gi, go: seen["g"].append(go[0].detach()))
    return seen


def test_linear_vectors_with_leading_dims_match_k3_k6():
    """KT8: for a (B, T, d) input, N = B*T rows; a_bar = mean [a_i | 1],
    g_bar = sum_i g_i = the bias gradient."""
    torch.manual_seed(1)
    lin = nn.Linear(4, 3).double()
    mkor = MKOR(lin, torch.optim.SGD(lin.parameters(), lr=0.1), factor_dtype="float64")
    rec = _record(lin)
    x = torch.randn(2, 5, 4, dtype=f64)
    lin(x).pow(2).mean().backward()
    a_bar, g_bar = mkor.pending_vectors()[""]
    rows = rec["x"][0].reshape(-1, 4)
    expected_a = torch.cat([rows.mean(0), torch.ones(1, dtype=f64)])
    assert torch.allclose(a_bar, expected_a, rtol=0, atol=1e-12)
    assert torch.allclose(g_bar, rec["g"][0].reshape(-1, 3).sum(0), rtol=0, atol=1e-12)
    assert torch.allclose(g_bar, lin.bias.grad, rtol=0, atol=1e-12)


def test_conv_vectors_match_explicit_unfold():
    """KT8 / K4: a_bar = mean over samples and positions of the unfolded patches (+1),
    g_bar = (1/L) sum over samples and positions of the output gradient. Covers stride,
    dilation, zero padding, 'same' padding and a reflect padding mode."""
    torch.manual_seed(2)
    for kwargs in (dict(stride=2, padding=1, dilation=1), dict(padding="same", dilation=2),
                   dict(padding=1, padding_mode="reflect")):
        conv = nn.Conv2d(3, 4, 3, **kwargs).double()
        mkor = MKOR(conv, torch.optim.SGD(conv.parameters(), lr=0.1), factor_dtype="float64")
        x = torch.randn(2, 3, 7, 6, dtype=f64)
        out = conv(x)
        out.pow(2).mean().backward()
        a_bar, g_bar = mkor.pending_vectors()[""]
        # Explicit im2col: pad as the conv does, then gather every output's patch.
        xp = Fn.pad(x, conv._reversed_padding_repeated_twice,
                    mode="constant" if conv.padding_mode == "zeros" else conv.padding_mode)
        patches = Fn.unfold(xp, 3, dilation=conv.dilation, stride=conv.stride)
        # The patches reproduce the convolution, so the layout is the weight's.
        recon = conv.weight.reshape(4, -1) @ patches + conv.bias[:, None]
        assert torch.allclose(recon.reshape(out.shape), out, atol=1e-12)
        L = patches.shape[2]
        expected_a = torch.cat([patches.mean(dim=(0, 2)), torch.ones(1, dtype=f64)])
        assert torch.allclose(a_bar, expected_a, rtol=0, atol=1e-12)
        assert torch.allclose(g_bar, conv.bias.grad / L, rtol=0, atol=1e-12)


def test_hooks_capture_only_in_train_mode_with_grad_and_on_schedule():
    """K2: no capture in eval mode, under no_grad, or when t % inv_freq != 0; warm-up
    steps capture every step."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mkor = MKOR(model, opt, inv_freq=3, warmup_steps=2)
    x = torch.randn(6, 3)
    captured = []
    for t in range(8):
        model(x).sum().backward()
        captured.append(bool(mkor.captured_modules()))
        mkor.step()
        opt.zero_grad()
    assert captured == [t % 3 == 0 or t < 2 for t in range(8)]
    assert mkor.steps == 8
    # t = 9 is on schedule: eval mode and no_grad forwards must still not capture.
    model(x).sum().backward()
    mkor.step()
    opt.zero_grad()
    assert mkor.factor_update_due()
    model.eval()
    model(x).sum().backward()
    assert mkor.captured_modules() == []
    model.train()
    with torch.no_grad():
        model(x)
    assert mkor.captured_modules() == []
    before = {k: (L.clone(), R.clone()) for k, (L, R) in mkor.inverse_factors().items()}
    mkor.step()  # nothing captured: factors must not move
    for k, (L, R) in mkor.inverse_factors().items():
        assert torch.equal(L, before[k][0]) and torch.equal(R, before[k][1])


def test_forward_without_backward_does_not_pollute_a_bar():
    """An extra train-mode forward with grad (no backward) is dropped at the step."""
    torch.manual_seed(4)
    lin = nn.Linear(3, 2).double()
    mkor = MKOR(lin, torch.optim.SGD(lin.parameters(), lr=0.1), factor_dtype="float64")
    x, y = torch.randn(4, 3, dtype=f64), 10 + torch.randn(4, 3, dtype=f64)
    lin(y)  # forward only
    lin(x).sum().backward()
    a_bar, _ = mkor.pending_vectors()[""]
    assert torch.allclose(a_bar[:-1], x.mean(0), rtol=0, atol=1e-12)


def _accum_model():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def test_gradient_accumulation_equals_one_large_batch():
    """2 micro-batches of 8 (each mean loss divided by 2) give the same vectors, factors
    and parameters as one batch of 16 (automatic accumulation). Tolerance 1e-12: only
    the summation order differs."""
    x, y = torch.randn(16, 5, dtype=f64), torch.randn(16, 3, dtype=f64)
    results = []
    for micro in (1, 2):
        model = _accum_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        mkor = MKOR(model, opt, inv_freq=1, factor_dtype="float64")
        for _ in range(3):
            for xb, yb in zip(x.chunk(micro), y.chunk(micro)):
                (Fn.mse_loss(model(xb), yb) / micro).backward()
            vectors = mkor.pending_vectors()
            mkor.step()
            opt.zero_grad()
        results.append((vectors, mkor.inverse_factors(), [p.detach() for p in model.parameters()]))
    (v1, f1, p1), (v2, f2, p2) = results
    for name in v1:
        for a, b in zip(v1[name], v2[name]):
            assert torch.allclose(a, b, rtol=0, atol=1e-12)
        for a, b in zip(f1[name], f2[name]):
            assert torch.allclose(a, b, rtol=0, atol=1e-12)
    for a, b in zip(p1, p2):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_grad_accum_steps_divides_g_bar():
    """An explicit grad_accum_steps=k divides g_bar by k (the released convention for
    un-divided micro-batch losses); a_bar is unchanged."""
    x = torch.randn(8, 5, dtype=f64)
    vectors = []
    for k in (None, 2):
        model = _accum_model()
        mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1),
                    factor_dtype="float64", grad_accum_steps=k)
        for xb in x.chunk(2):
            model(xb).sum().backward()
        vectors.append(mkor.pending_vectors()["0"])
    assert torch.allclose(vectors[0][0], vectors[1][0], rtol=0, atol=1e-14)
    assert torch.allclose(vectors[0][1] / 2, vectors[1][1], rtol=0, atol=1e-14)


def test_tensor_grad_hooks_match_module_hooks_and_allow_inplace_successors():
    """grad_hook="tensor" captures the same vectors as full backward hooks (exactly:
    the same tensors are summed), including the MHA out-projection, and, unlike them,
    works when a layer's output is modified in place (ReLU(inplace=True))."""
    x = torch.randn(2, 3, 4, 4, dtype=f64)
    tokens = torch.randint(0, 5, (2, 1))
    vectors = []
    for mode in ("module", "tensor"):
        torch.manual_seed(6)
        model = Mixed().double()
        mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1), grad_hook=mode,
                    factor_dtype="float64")
        model(x[:, :2], tokens).sum().backward()
        vectors.append(mkor.pending_vectors())
    assert vectors[0].keys() == vectors[1].keys() == {"conv", "fc", "attn.out_proj", "head"}
    for name in vectors[0]:
        for a, b in zip(vectors[0][name], vectors[1][name]):
            assert torch.equal(a, b)
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 1)).double()
    mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1), grad_hook="tensor",
                factor_dtype="float64")
    model(torch.randn(5, 3, dtype=f64)).sum().backward()
    for name, layer in (("0", model[0]), ("2", model[2])):
        assert torch.allclose(mkor.pending_vectors()[name][1], layer.bias.grad, rtol=0, atol=1e-12)


def test_default_hooks_leave_steps_without_capture_untouched():
    """grad_hook="tensor" (the default) adds nothing to the autograd graph on a step that
    captures no statistics; "module" wraps every forward in BackwardHookFunction."""
    x = torch.randn(4, 3, dtype=f64)
    kinds = {}
    for mode in ("tensor", "module"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 2)).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mkor = MKOR(model, opt, inv_freq=10, factor_dtype="float64", grad_hook=mode)
        model(x).sum().backward()  # step 0 captures
        mkor.step()
        opt.zero_grad()
        assert not mkor.factor_update_due()
        y = model(x)
        kinds[mode] = (type(y.grad_fn).__name__, bool(y._backward_hooks))
    assert kinds["tensor"] == ("AddmmBackward0", False)
    assert kinds["module"][0] == "BackwardHookFunctionBackward"
