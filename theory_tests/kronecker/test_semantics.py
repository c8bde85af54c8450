"""Training-loop semantics shared by MKOR and K-FAC (spec MKOR.md K1-K6; issue: "MKOR and
K-FAC on the models and training loops people actually use").

Discovery reasons, complex layers, frozen biases, forward/gradient pairing, token masks,
stale statistics, warnings when nothing is preconditioned, hook ownership and removal, and
the layer-type extension point. Models are float64 so that equalities are exact or hold to
1e-12 (sums of a few hundred O(1) terms).
"""
import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as Fn

from torch_impl.baselines import KFAC

from torch_impl.mkor import MKOR, LayerType, register_layer_type, unregister_layer_type

f64 = torch.float64
KINDS = [MKOR, KFAC]


def _options(cls):
    return dict(factor_dtype="float64") if cls is MKOR else dict(kl_clip=None)


def _mlp(seed=0, bias=True):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6, bias=bias), nn.Tanh(), nn.Linear(6, 3)).double()


def _make(cls, model, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return opt, cls(model, opt, inv_freq=1, **_options(cls), **kwargs)


def _batch(t, n=8):
    g = torch.Generator().manual_seed(t)
    return torch.randn(n, 4, generator=g, dtype=f64), torch.randn(n, 3, generator=g, dtype=f64)


def _step(model, pre, t):
    x, y = _batch(t)
    Fn.mse_loss(model(x), y).backward()
    pre.step()
    pre.zero_grad()


def _hook_count(module):
    return len(module._forward_hooks) + len(module._backward_hooks)


# -- discovery -----------------------------------------------------------------------------
@pytest.mark.parametrize("cls", KINDS)
def test_complex_layers_raise_naming_the_layer_and_the_way_out(cls):
    model = nn.Sequential(nn.Linear(3, 3, dtype=torch.cfloat))
    with pytest.raises(ValueError, match=r"'0'.*complex.*skip_modules=\['0'\]"):
        cls(model, torch.optim.SGD(model.parameters(), lr=0.1))
    pre = cls(model, torch.optim.SGD(model.parameters(), lr=0.1), skip_modules=["0"])
    assert pre.skip_reasons == {"0": "skipped by the skip_modules pattern '0'"}


@pytest.mark.parametrize("cls", KINDS)
def test_every_skipped_module_has_its_reason(cls):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 4)
            self.norm = nn.LayerNorm(4)
            self.dw = nn.Conv2d(4, 4, 3, groups=4)
            self.grouped = nn.Conv2d(4, 8, 3, groups=2)
            self.gru = nn.GRU(4, 4)
            self.frozen = nn.Linear(4, 4).requires_grad_(False)
            self.head = nn.Linear(4, 5)
            self.head.weight = self.emb.weight  # tied, as GPT-2's lm_head
            self.fc = nn.Linear(4, 4)

    net = Net()
    pre = cls(net, torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1))
    reasons = pre.skip_reasons
    assert pre.preconditioned_modules == ["fc"]
    assert reasons["emb"].startswith("embedding")
    assert reasons["norm"].startswith("normalisation")
    assert reasons["dw"].startswith("depthwise convolution (groups=4)")
    assert reasons["grouped"].startswith("grouped convolution (groups=2)")
    assert "GRU is not a registered layer type" in reasons["gru"]
    assert reasons["frozen"] == "frozen weight (requires_grad=False)"
    assert reasons["head"].startswith("weight tied to emb")
    assert set(reasons) == {"emb", "norm", "dw", "grouped", "gru", "frozen", "head"}


@pytest.mark.parametrize("cls", KINDS)
def test_layers_the_optimizer_does_not_hold_are_skipped_and_nothing_left_warns(cls):
    model, other = _mlp(), _mlp(1)
    with pytest.warns(UserWarning, match="nothing is preconditioned"):
        pre = cls(model, torch.optim.SGD(other.parameters(), lr=0.1))
    assert pre.preconditioned_modules == []
    assert pre.skip_reasons["0"] == "weight not in the optimizer's param_groups"
    partial = torch.optim.SGD(model[2].parameters(), lr=0.1)
    pre = cls(model, partial)
    assert pre.preconditioned_modules == ["2"]


@pytest.mark.parametrize("cls", KINDS)
def test_a_model_without_supported_layers_warns(cls):
    model = nn.Sequential(nn.Embedding(4, 3), nn.LayerNorm(3))
    with pytest.warns(UserWarning, match=r"nothing is preconditioned.*0: embedding"):
        cls(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("cls", KINDS)
def test_a_model_in_eval_mode_warns_at_the_factor_update(cls):
    model = _mlp()
    opt, pre = _make(cls, model)
    model.eval()
    x, y = _batch(0)
    Fn.mse_loss(model(x), y).backward()
    with pytest.warns(UserWarning, match=r"eval\(\) mode"):
        pre.step()


def test_frozen_bias_is_a_constant_and_the_rescale_is_exact():
    """A bias with requires_grad=False has no column in R (d_in' = d_in) and the rescaled
    step has exactly the weight gradient's norm (it was 0.93-0.99 of it when the frozen
    bias's zero column entered the joint norm). A bias frozen after construction (no .grad)
    still owns R's column but is left out of the rescale."""
    for freeze_before in (True, False):
        model = _mlp()
        if freeze_before:
            model[0].bias.requires_grad_(False)
        opt, mkor = _make(MKOR, model)
        if not freeze_before:
            model[0].bias.requires_grad_(False)
        for t in range(4):
            x, y = _batch(t)
            Fn.mse_loss(model(x), y).backward()
            raw = model[0].weight.grad.norm()
            mkor.precondition()
            assert torch.isclose(model[0].weight.grad.norm(), raw, rtol=1e-12, atol=0)
            opt.step()
            mkor.zero_grad()
        L, R = mkor.inverse_factors()["0"]
        assert R.shape == ((4, 4) if freeze_before else (5, 5))
        assert not torch.equal(R, torch.eye(R.shape[0], dtype=f64))


# -- pairing, stale statistics, masks --------------------------------------------------------
def _vectors_after(model, mkor, forwards):
    """Run ``forwards`` (callables returning a loss or None), back-propagate the losses."""
    losses = [f() for f in forwards]
    sum(l for l in losses if l is not None).backward()
    return mkor.pending_vectors()


def test_an_extra_forward_without_backward_is_left_out_exactly():
    """grad_hook="tensor" pairs each gradient with the forward that produced it: an extra
    train-mode forward after the real one (its output discarded) leaves the vectors and
    the step bit-identical. Under grad_hook="module" the pairing is ambiguous: a clear
    error at the step."""
    x, y = _batch(0)
    z = 5 + _batch(1)[0]
    results = []
    for extra in (False, True):
        model = _mlp()
        opt, mkor = _make(MKOR, model)
        out = model(x)
        if extra:
            model(z)
        Fn.mse_loss(out, y).backward()
        results.append(mkor.pending_vectors())
        mkor.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(results[0]["0"] + results[0]["2"], results[2]["0"] + results[2]["2"]):
        assert torch.equal(a, b)
    assert all(torch.equal(p, q) for p, q in zip(results[1], results[3]))
    model = _mlp()
    opt, mkor = _make(MKOR, model, grad_hook="module")
    out = model(x)
    model(z)
    Fn.mse_loss(out, y).backward()
    with pytest.raises(RuntimeError, match="never got a backward.*grad_hook='tensor'"):
        mkor.step()


@pytest.mark.parametrize("grad_hook", ["tensor", "module"])
def test_a_layer_used_twice_in_one_graph_counts_both_uses(grad_hook):
    """Weight sharing inside one forward (a layer applied twice): a_bar is the mean over
    both uses' rows, g_bar the sum of both output gradients (= the bias gradient)."""
    torch.manual_seed(2)
    lin = nn.Linear(4, 4).double()
    mkor = MKOR(lin, torch.optim.SGD(lin.parameters(), lr=0.1), factor_dtype="float64",
                grad_hook=grad_hook)
    x = torch.randn(6, 4, dtype=f64)
    h = torch.tanh(lin(x))
    lin(h).square().sum().backward()
    a_bar, g_bar = mkor.pending_vectors()[""]
    assert torch.allclose(a_bar[:-1], torch.cat([x, h.detach()]).mean(0), rtol=0, atol=1e-12)
    assert torch.allclose(g_bar, lin.bias.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("cls", KINDS)
def test_statistics_of_a_zeroed_unstepped_batch_are_dropped(cls):
    """A batch whose step never happened (e.g. skipped by GradScaler) followed by
    model.zero_grad() (grads set to None) leaves nothing behind: the next step equals a
    run that never saw that batch."""
    params = []
    for poisoned in (False, True):
        model = _mlp()
        opt, pre = _make(cls, model)
        _step(model, pre, 0)
        if poisoned:
            x, y = _batch(99)
            Fn.mse_loss(model(x * 1e3), y).backward()
            model.zero_grad()  # not pre.zero_grad(): the preconditioner is not told
        _step(model, pre, 1)
        params.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(p, q) for p, q in zip(*params))


@pytest.mark.parametrize("cls", KINDS)
def test_a_token_mask_keeps_padded_rows_out_and_the_step_bit_identical(cls):
    """(B, T, d) inputs with a (B, T) mask given by masked(): changing the padded rows
    changes nothing (the loss ignores them); without the mask the step changes."""
    torch.manual_seed(3)
    x = torch.randn(2, 5, 4, dtype=f64)
    y = torch.randn(2, 5, 3, dtype=f64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    runs = {}
    for use_mask in (True, False):
        for pad in (0.0, 7.0):
            model = _mlp()
            opt, pre = _make(cls, model)
            xp = torch.where(mask[..., None], x, pad)
            for _ in range(2):
                ctx = pre.masked(mask) if use_mask else torch.enable_grad()
                with ctx:
                    out = model(xp)
                ((out - y).square() * mask[..., None]).sum().backward()
                pre.step()
                pre.zero_grad()
            runs[use_mask, pad] = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(p, q) for p, q in zip(runs[True, 0.0], runs[True, 7.0]))
    assert not all(torch.equal(p, q) for p, q in zip(runs[False, 0.0], runs[False, 7.0]))


def test_masked_a_bar_is_the_mean_over_real_rows():
    model = _mlp()
    opt, mkor = _make(MKOR, model)
    x = torch.randn(3, 4, 4, dtype=f64)
    mask = torch.rand(3, 4) > 0.4
    mask[0, 0] = True
    with mkor.masked(mask):
        model(x).sum().backward()
    a_bar, _ = mkor.pending_vectors()["0"]
    assert torch.allclose(a_bar[:-1], x[mask].mean(0), rtol=0, atol=1e-12)
    assert a_bar[-1] == 1


@pytest.mark.parametrize("batch_first", [True, False])
def test_mha_out_projection_is_masked_in_its_own_row_order(batch_first):
    """nn.MultiheadAttention multiplies (T*B, E) rows in (T, B) order; the (B, T) mask must
    select the same tokens: a_bar equals the mean over real tokens of the attention
    values the projection multiplies, recomputed from a_bar's linearity."""
    torch.manual_seed(4)
    attn = nn.MultiheadAttention(8, 2, batch_first=batch_first).double()
    mkor = MKOR(attn, torch.optim.SGD(attn.parameters(), lr=0.1), factor_dtype="float64")
    x = torch.randn(3, 5, 8, dtype=f64)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 3:] = False
    mask[2, 1:] = False
    xi = x if batch_first else x.transpose(0, 1)
    with mkor.masked(mask):
        out, _ = attn(xi, xi, xi, key_padding_mask=~mask)
    out.square().sum().backward()
    a_bar, _ = mkor.pending_vectors()["out_proj"]
    W, b = attn.out_proj.weight, attn.out_proj.bias
    out_btE = out.detach() if batch_first else out.detach().transpose(0, 1)
    assert torch.allclose(a_bar[:-1] @ W.T + b, out_btE[mask].mean(0), rtol=0, atol=1e-12)


# -- hook ownership --------------------------------------------------------------------------
@pytest.mark.parametrize("cls", KINDS)
def test_remove_and_with_block_detach_the_hooks(cls):
    model = _mlp()
    before = _hook_count(model[0])
    with cls(model, torch.optim.SGD(model.parameters(), lr=0.1)) as pre:
        assert _hook_count(model[0]) > before
    assert _hook_count(model[0]) == before and not pre.hooks_registered
    x, y = _batch(0)
    Fn.mse_loss(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    params = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(UserWarning, match="stepping the backbone without preconditioning"):
        pre.step()
    for p, q, g in zip(model.parameters(), params, grads):
        assert torch.equal(p, q.add(g, alpha=-0.1))  # plain SGD on the raw gradient


@pytest.mark.parametrize("cls", KINDS)
def test_a_second_preconditioner_on_the_same_model_takes_over(cls):
    """Pasting a setup twice leaves one hook set: the new object detaches the old one (with
    a warning); dropping an object removes its hooks."""
    model = _mlp()
    base = _hook_count(model[0])
    first = cls(model, torch.optim.SGD(model.parameters(), lr=0.1))
    one_set = _hook_count(model[0]) - base
    with pytest.warns(UserWarning, match="already carried the hooks"):
        second = cls(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert _hook_count(model[0]) - base == one_set
    assert not first.hooks_registered and second.hooks_registered
    del first, second
    gc.collect()
    assert _hook_count(model[0]) == base


def test_a_registered_layer_type_is_preconditioned_like_the_linear_it_mirrors():
    """The extension point: a module storing W transposed (in x out) with its own type
    gets exactly the update an nn.Linear holding W gets."""
    class TLinear(nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.weight = nn.Parameter(lin.weight.detach().T.clone())
            self.bias = nn.Parameter(lin.bias.detach().clone())

        def forward(self, x):
            return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]),
                               self.weight).reshape(*x.shape[:-1], -1)

    class TLinearType(LayerType):
        name = "tlinear"

        def matches(self, module):
            return isinstance(module, TLinear)

        def shape(self, module):
            return module.weight.shape[1], module.weight.shape[0]

        def input_rows(self, module, x):
            return x

        def grad_rows(self, module, g):
            return g

        def grad_matrix(self, module):
            return module.weight.grad.T

    model = _mlp()
    twin = nn.Sequential(TLinear(model[0]), nn.Tanh(), TLinear(model[2])).double()
    kind = register_layer_type(TLinearType())
    try:
        opt, mkor = _make(MKOR, model)
        opt2, mkor2 = _make(MKOR, twin)
        assert mkor2.preconditioned_modules == ["0", "2"]
        for t in range(3):
            _step(model, mkor, t)
            _step(twin, mkor2, t)
        for (lin_name, a), (_, b) in zip(model.named_parameters(), twin.named_parameters()):
            b = b.T if b.dim() == 2 else b
            assert torch.allclose(a, b, rtol=0, atol=1e-12), lin_name
    finally:
        unregister_layer_type(kind)
    unregistered = MKOR(twin, torch.optim.SGD(twin.parameters(), lr=0.1))
    assert "TLinear is not a registered layer type" in unregistered.skip_reasons["0"]
