"""The fused-experts oracle (issue 31: the forward model and its rows in
``reference/common/moe.py``, MKOR's per-expert equations in ``reference/mkor/experts.py``,
K-FAC's in ``reference/baselines/kfac.py``) against its reference semantics: a twin of the
model whose experts are ``nn.Linear`` layers (``support/moe_twin``).

* (a) ``expert_rows`` from the fused model's weights, its router's choices (a forward
  pre-hook on the fused experts module) and the gradient of that module's output equals, in
  order, each twin Linear's input rows and output-gradient rows (plain torch hooks written
  here), for Mixtral, Qwen2-MoE and GPT-OSS (bias, transposed, interleaved, clamped gate),
  for a random batch, a right-padded batch (the twin unroutes the padding, the oracle masks
  it) and a one-token batch (two experts of each layer routed nothing: empty rows, and the
  twin's Linear not called); the rows' weight gradients and rank-1 vectors are the fused
  model's .grad and bias gradients (K6).
* (b) the fused model and its twin have the same loss and gradients (``twin_grads_as_fused``),
  for the three families and, on synthetic decorated modules run by transformers' own
  ``batched_mm`` forward, the layouts their models are too heavy to build here (no gate with
  a post-expert norm; transposed with biases).
* (c) ``expert_factor_updates``: one paper-variant update from J = I is the inverse of
  rho I + (1-rho) v v^T (K8) for each present expert; absent experts are unchanged.
* (d) ``expert_kfac_factors`` is the einsum of each expert's rows (K19 with K3's scaling).
* (e) ``expert_precondition`` is L^-1 [G | b] R^-1 rescaled to the gradient's norm, per
  expert (K13, K14).
"""
import copy
import inspect
import types

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from reference.baselines.kfac import expert_kfac_factors
from reference.common import moe
from reference.mkor import experts as ox
from theory_tests.support.moe_twin import (FAMILIES, TwinExperts, build_twin,
                                           fused_experts_modules, fused_view, tiny_moe_models,
                                           twin_grads_as_fused)

transformers = pytest.importorskip("transformers")

f64 = torch.float64
TOL = 1e-12
VOCAB = 64


@pytest.fixture(scope="module")
def models():
    return tiny_moe_models()


def _batch(seed, batch, seq, lengths=None):
    """(input_ids, attention_mask (long), targets): random tokens, right padding after
    ``lengths[b]`` real tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    targets = torch.randint(0, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if lengths is not None:
        for row, n in enumerate(lengths):
            mask[row, n:] = 0
    return ids, mask, targets


CASES = {"random": (2, 6, None), "padded": (3, 5, [5, 2, 3]), "one_token": (1, 1, None)}


def _loss(model, ids, mask, targets):
    """Mean cross-entropy of the logits at the real tokens (no shift, so one token is a
    batch): padded positions are in no loss term."""
    logits = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    return F.cross_entropy(logits[real], targets[real])


def _rel(x, ref):
    x, ref = np.asarray(x, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if ref.size == 0:
        assert x.size == 0
        return 0.0
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-300))


def _capture_fused(model):
    """{experts module name: record} filled by a forward pre-hook (the call's hidden_states,
    top_k_index, top_k_weights, bound by the forward's own signature) and a tensor hook on
    its output (dL/dout)."""
    records, handles = {}, []
    for name, module in fused_experts_modules(model):
        rec = records.setdefault(name, {})
        signature = inspect.signature(type(module).forward)

        def pre(mod, args, kwargs, rec=rec, signature=signature):
            bound = signature.bind(mod, *args, **kwargs)
            rec["hidden"], rec["index"], rec["weights"] = list(bound.arguments.values())[1:4]

        def post(mod, args, output, rec=rec):
            output.register_hook(lambda g: rec.__setitem__("grad_out", g.detach().clone()))

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post))
    return records, handles


def _capture_twin(twin):
    """{(experts module name, expert, "up" | "down"): {"a": input rows, "g": output-gradient
    rows}} of every twin Linear that was called, by a forward hook and a tensor hook."""
    records, handles = {}, []
    for name, module in twin.named_modules():
        if not isinstance(module, TwinExperts):
            continue
        for e, expert in enumerate(module.experts):
            for projection, linear in (("up", expert.up_linear), ("down", expert.down)):
                key = (name, e, projection)

                def hook(mod, args, output, key=key):
                    assert key not in records, "a twin Linear called twice in one forward"
                    rec = records[key] = {"a": args[0].detach().clone()}
                    output.register_hook(lambda g: rec.__setitem__("g", g.detach().clone()))

                handles.append(linear.register_forward_hook(hook))
    return records, handles


def _numpy(t):
    return None if t is None else t.detach().double().numpy()


def _oracle_rows(module, rec, token_mask, gate):
    up, down = ("gate_up_proj" if module.has_gate else "up_proj"), "down_proj"
    bias = (lambda n: _numpy(getattr(module, n + "_bias"))) if module.has_bias else (lambda n: None)
    return moe.expert_rows(
        _numpy(rec["hidden"]), rec["index"].numpy(), _numpy(rec["weights"]),
        _numpy(rec["grad_out"]), _numpy(getattr(module, up)), _numpy(getattr(module, down)),
        b_gu=bias(up), b_d=bias(down), gate=gate, has_gate=module.has_gate,
        transposed=module.is_transposed, token_mask=token_mask)


def _gate_of(family, config):
    if family == "gpt_oss":
        return moe.clamped_swiglu_gate(config.swiglu_alpha, config.swiglu_limit, "interleaved")
    assert config.hidden_act == "silu"
    return "silu_concatenated"


def _run_case(models, family, case):
    config, model = models[family]
    batch, seq, lengths = CASES[case]
    ids, mask, targets = _batch(7, batch, seq, lengths)
    fused = copy.deepcopy(model)
    twin = build_twin(fused, unroute_mask=mask.bool() if lengths else None)
    f_rec, f_handles = _capture_fused(fused)
    loss_f = _loss(fused, ids, mask, targets)
    loss_f.backward()
    t_rec, t_handles = _capture_twin(twin)
    loss_t = _loss(twin, ids, mask, targets)
    loss_t.backward()
    for h in f_handles + t_handles:
        h.remove()
    return (config, fused, twin, mask, f_rec, t_rec, float(loss_f.detach()),
            float(loss_t.detach()))


# ---------------------------------------------------------------- (a) rows against the twin

@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("family", FAMILIES)
def test_expert_rows_are_the_twin_linears_rows(models, family, case):
    """Each expert's (a, g) rows of both projections, in the eager loop's order: the oracle
    from the fused model's captured inputs equals the twin's nn.Linear hooks to 1e-12; an
    expert routed nothing has (0, d) rows and its twin Linear is never called."""
    config, fused, twin, mask, f_rec, t_rec, _, _ = _run_case(models, family, case)
    token_mask = mask.bool().numpy() if CASES[case][2] else None
    worst, empty = 0.0, 0
    for name, module in fused_experts_modules(fused):
        rows = _oracle_rows(module, f_rec[name], token_mask, _gate_of(family, config))
        assert len(rows) == module.num_experts
        for e, r in enumerate(rows):
            n_e = r["tokens"].shape[0]
            for projection, (a_key, g_key) in moe.PROJECTIONS.items():
                key = (name, e, projection)
                if n_e == 0:
                    assert key not in t_rec
                    linear = getattr(twin.get_submodule(name).experts[e],
                                     "up_linear" if projection == "up" else "down")
                    assert r[a_key].shape == (0, linear.in_features)
                    assert r[g_key].shape == (0, linear.out_features)
                    continue
                worst = max(worst, _rel(r[a_key], t_rec[key]["a"].numpy()),
                            _rel(r[g_key], t_rec[key]["g"].numpy()))
            empty += n_e == 0
        if token_mask is not None:  # every row is a real token's; every real pair is there
            kept = sum(r["tokens"].shape[0] for r in rows)
            assert kept == int(mask.sum()) * config.num_experts_per_tok
            assert all(token_mask.reshape(-1)[r["tokens"]].all() for r in rows)
    assert worst <= TOL, worst
    if case == "one_token":  # 1 token, top-2 of 4: exactly two experts of each layer idle
        assert empty == 2 * len(fused_experts_modules(fused))


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_give_the_fused_gradients_and_k6_bias_vectors(models, family):
    """From the oracle's rows alone: sum_i g_i a_i^T is each expert's slice of the fused
    parameter's .grad (zeros for an idle expert; transposed layout for GPT-OSS), and with
    biases g_bar of ``expert_rank1_vectors`` is the expert's bias gradient (K6)."""
    config, fused, _, _, f_rec, _, _, _ = _run_case(models, family, "padded")
    mask = _batch(7, *CASES["padded"])[1].bool().numpy()
    worst = 0.0
    for name, module in fused_experts_modules(fused):
        rows = _oracle_rows(module, f_rec[name], mask, _gate_of(family, config))
        for projection, weight_name in (("up", "gate_up_proj"), ("down", "down_proj")):
            weight = getattr(module, weight_name)
            grad_W, grad_b = moe.expert_weight_grads(rows, module.has_bias, module.is_transposed,
                                                    projection=projection)
            worst = max(worst, _rel(grad_W, weight.grad.numpy()))
            if module.has_bias:
                bias_grad = getattr(module, weight_name + "_bias").grad.numpy()
                worst = max(worst, _rel(grad_b, bias_grad))
                vectors = ox.expert_rank1_vectors(rows, True, projection=projection)
                for e, vec in enumerate(vectors):
                    if vec is not None:
                        worst = max(worst, _rel(vec[1], bias_grad[e]))
                        assert vec[0][-1] == 1.0  # the bias column of a_bar
    assert worst <= TOL, worst


def test_routed_pairs_follow_the_eager_loops_slot_major_order():
    """Pairs of an expert: every slot-0 token (ascending), then slot 1's; sentinel ids
    (expert parallelism) belong to no expert."""
    index = np.array([[1, 0], [0, 2], [2, 1], [0, 4]])
    pairs = moe.routed_pairs(index, 4)
    assert [t.tolist() for t, _ in pairs] == [[1, 3, 0], [0, 2], [2, 1], []]
    assert [s.tolist() for _, s in pairs] == [[0, 0, 1], [0, 1], [0, 1], []]


# -------------------------------------------------------- (b) the fused model is its twin

@pytest.mark.parametrize("case", ["random", "padded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_model_and_twin_have_the_same_loss_and_gradients(models, family, case):
    """Same parameters (``fused_view`` has the fused names, order and layout), same loss, and
    every gradient equal to 1e-12 (``twin_grads_as_fused``); with padding the twin also
    unroutes the padded tokens, which changes no gradient."""
    _, fused, twin, _, _, _, loss_f, loss_t = _run_case(models, family, case)
    params = dict(fused.named_parameters())
    view, grads = fused_view(twin), twin_grads_as_fused(twin)
    assert list(view) == list(params) == list(grads)
    assert all(torch.equal(view[n], p.detach()) for n, p in params.items())
    assert abs(loss_f - loss_t) <= TOL * abs(loss_f)
    worst = max(_rel(grads[n].numpy(), p.grad.numpy()) for n, p in params.items())
    assert worst <= TOL, worst


class _RMSNorm(nn.Module):
    def __init__(self, weight, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(weight), eps

    def forward(self, y):
        return self.weight * y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)


class _ReLU2(nn.Module):
    def forward(self, h):
        return torch.relu(h) ** 2


SYNTHETIC = {
    # NemotronH's (no gate, relu2) with MuseSpark's post-expert norm
    "no_gate_post_norm": dict(has_gate=False, has_post_expert_norm=True),
    # openai_privacy_filter's / Aria's storage: (E, d_in, d_out) with biases, SwiGLU
    "transposed_bias": dict(is_transposed=True, has_bias=True),
}


def _synthetic_experts(flags, E=4, H=16, I=12, seed=0):
    """A decorated experts module with ``flags``, run by transformers' ``batched_mm``."""
    from transformers.integrations.moe import use_experts_implementation

    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return nn.Parameter(0.3 * torch.randn(*shape, generator=g, dtype=f64))

    @use_experts_implementation(**flags)
    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = E
            d_up = I if flags.get("has_gate", True) is False else 2 * I
            up = "up_proj" if d_up == I else "gate_up_proj"
            transposed = flags.get("is_transposed", False)
            setattr(self, up, rand(E, H, d_up) if transposed else rand(E, d_up, H))
            if flags.get("has_bias"):
                setattr(self, up + "_bias", rand(E, d_up))
                self.down_proj_bias = rand(E, H)
            self.down_proj = rand(E, I, H) if transposed else rand(E, H, I)
            self.act_fn = _ReLU2() if d_up == I else nn.SiLU()
            if flags.get("has_post_expert_norm"):
                self.post_expert_norm = _RMSNorm(1.0 + 0.1 * torch.randn(H, generator=g,
                                                                         dtype=f64))

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise AssertionError("dispatched to batched_mm")

    return Experts(types.SimpleNamespace(_experts_implementation="batched_mm"))


@pytest.mark.parametrize("layout", sorted(SYNTHETIC))
def test_other_declared_layouts_fused_twin_and_oracle_agree(layout):
    """Layouts of families too heavy to build here, on a decorated module run by
    transformers' batched_mm: the twin's output and gradients equal the fused module's, and
    the oracle's rows (relu2 activation, numpy RMSNorm VJP; or transposed with biases) equal
    the twin Linears'."""
    fused = _synthetic_experts(SYNTHETIC[layout])
    twin = build_twin(fused)
    assert isinstance(twin, TwinExperts)
    g = torch.Generator().manual_seed(3)
    T, k = 9, 2
    hidden = torch.randn(T, 16, generator=g, dtype=f64)
    logits = torch.randn(T, 4, generator=g, dtype=f64)
    logits[:, 3] -= 100.0  # expert 3 is never in the top 2: routed nothing
    top_w, top_i = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    cotangent = torch.randn(T, 16, generator=g, dtype=f64)
    out_f = fused(hidden, top_i, top_w)
    (out_f * cotangent).sum().backward()
    t_rec, handles = _capture_twin(twin)
    out_t = twin(hidden, top_i, top_w)
    (out_t * cotangent).sum().backward()
    for h in handles:
        h.remove()
    assert _rel(out_t.detach().numpy(), out_f.detach().numpy()) <= TOL
    grads = twin_grads_as_fused(twin)
    assert list(grads) == [n for n, _ in fused.named_parameters()]
    worst = max(_rel(grads[n].numpy(), p.grad.numpy()) for n, p in fused.named_parameters())
    assert worst <= TOL, worst
    norm = None
    if fused.has_post_expert_norm:
        norm = moe.rms_norm(_numpy(fused.post_expert_norm.weight), fused.post_expert_norm.eps)
    up = "gate_up_proj" if fused.has_gate else "up_proj"
    bias = (lambda n: _numpy(getattr(fused, n + "_bias"))) if fused.has_bias else (lambda n: None)
    rows = moe.expert_rows(_numpy(hidden), top_i.numpy(), _numpy(top_w),
                          _numpy(cotangent), _numpy(getattr(fused, up)), _numpy(fused.down_proj),
                          b_gu=bias(up), b_d=bias("down_proj"),
                          gate="silu_concatenated" if fused.has_gate else "relu2",
                          has_gate=fused.has_gate, transposed=fused.is_transposed,
                          post_norm=norm)
    assert rows[3]["a_gu"].shape[0] == 0 and ("", 3, "up") not in t_rec
    worst = 0.0
    for e, r in enumerate(rows[:3]):
        for projection, (a_key, g_key) in moe.PROJECTIONS.items():
            worst = max(worst, _rel(r[a_key], t_rec[("", e, projection)]["a"].numpy()),
                        _rel(r[g_key], t_rec[("", e, projection)]["g"].numpy()))
    assert worst <= TOL, worst


# ------------------------------------------------ (c)-(e) per-expert updates, closed forms

def _spd(rng, d):
    A = rng.standard_normal((d, d))
    return A @ A.T / d + np.eye(d)


def test_expert_factor_updates_first_paper_update_is_the_ema_inverse():
    """From J = I, one paper-variant update of a present expert is
    inv(rho I + (1-rho) v v^T) (K8, numpy.linalg.inv); an absent expert keeps its J (here
    not I) and reports no stabiliser firing."""
    rng = np.random.default_rng(0)
    E, d, rho = 4, 5, 0.9
    present = np.array([True, False, True, True])
    J = np.stack([np.eye(d) if p else _spd(rng, d) for p in present])
    V = rng.standard_normal((E, d))
    J_new, fired = ox.expert_factor_updates(J, V, present, variant="paper", stat_decay=rho)
    for e in range(E):
        if present[e]:
            ref = np.linalg.inv(rho * np.eye(d) + (1 - rho) * np.outer(V[e], V[e]))
            assert _rel(J_new[e], ref) <= TOL
        else:
            assert np.array_equal(J_new[e], J[e]) and not fired[e]
    vectors = [V[0], None, V[2], V[3]]
    stacked, mask = ox.present_stack(vectors, d)
    assert np.array_equal(mask, present) and not stacked[1].any()
    J_list, _ = ox.expert_factor_updates(J, vectors, mask, variant="paper", stat_decay=rho)
    assert np.array_equal(J_list, J_new)


def test_expert_kfac_factors_are_the_einsum_of_each_experts_rows():
    """A_e = (1/n_e) sum_i [a_i|1][a_i|1]^T and G_e = n_e sum_i g_i g_i^T (K19 with K3's
    per-sample scaling), None for an expert without rows."""
    rng = np.random.default_rng(1)
    counts = [3, 0, 7, 1]
    rows = [(rng.standard_normal((n, 5)), rng.standard_normal((n, 3))) for n in counts]
    factors = expert_kfac_factors(rows, has_bias=True)
    for (a, g), n, f in zip(rows, counts, factors):
        if n == 0:
            assert f is None
            continue
        a1 = np.concatenate([a, np.ones((n, 1))], axis=1)
        assert _rel(f[0], np.einsum("ni,nj->ij", a1, a1) / n) <= TOL
        assert _rel(f[1], n * np.einsum("ni,nj->ij", g, g)) <= TOL
    vectors = ox.expert_rank1_vectors(rows, has_bias=True)
    assert vectors[1] is None
    assert _rel(vectors[2][1], rows[2][1].sum(0)) <= TOL  # g_bar = sum of the rows (K6)


@pytest.mark.parametrize("mode", ["joint", "sum_of_norms"])
@pytest.mark.parametrize("transposed", [False, True])
def test_expert_precondition_is_each_experts_own_kronecker_step(mode, transposed):
    """Delta_e = L_e^-1 [G_e | b_e] R_e^-1 times ||[G_e|b_e]|| / ||Delta_e|| (K13, K14), each
    expert with its own factors and scale; the transposed layout in, the transposed out."""
    rng = np.random.default_rng(2)
    E, d_out, d_in = 3, 4, 5
    L = np.stack([np.linalg.inv(_spd(rng, d_out)) for _ in range(E)])
    R = np.stack([np.linalg.inv(_spd(rng, d_in + 1)) for _ in range(E)])
    G = rng.standard_normal((E, d_out, d_in)) * np.array([1.0, 10.0, 0.01])[:, None, None]
    b = rng.standard_normal((E, d_out))
    dW, db = ox.expert_precondition(L, R, G.transpose(0, 2, 1) if transposed else G, b,
                                    mode=mode, transposed=transposed)
    for e in range(E):
        delta = L[e] @ np.concatenate([G[e], b[e][:, None]], axis=1) @ R[e]
        if mode == "joint":
            s = np.linalg.norm(np.concatenate([G[e], b[e][:, None]], 1)) / np.linalg.norm(delta)
        else:
            s = ((np.linalg.norm(G[e]) + np.linalg.norm(b[e]))
                 / (np.linalg.norm(delta[:, :-1]) + np.linalg.norm(delta[:, -1])))
        got = dW[e].T if transposed else dW[e]
        assert _rel(got, s * delta[:, :-1]) <= TOL and _rel(db[e], s * delta[:, -1]) <= TOL
