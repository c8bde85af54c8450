"""K-FAC on fused mixture-of-experts stacks (issue 31, claims row MOE-KFAC): a stack of E
experts is E independent layers, each preconditioned from its own rows.

* (a) the equations (:mod:`torch_impl.baselines.kfac_equations`): the batched statistics of
  a stack equal today's 2-D ``input_stat`` / ``grad_stat`` applied to each expert's rows, an
  expert with no rows (or only masked ones) giving zeros and 0; the batched decomposition and
  preconditioning equal the 2-D functions on each matrix, identity sides included; a matrix
  that fails is retried alone and keeps its previous decomposition (or the identity's) while
  the others keep their batched result; float64, 1e-12 of the largest entry.
* (b) the optimizer (:class:`torch_impl.baselines.KFAC`): the per-expert EMA rules (an
  expert without rows keeps its factors and counts ``no_rows``, a non-finite one is refused
  alone), the KL clip's sum includes every expert's term, state_dict round trips, payload.
* (c) end to end: K-FAC on a tiny transformers Mixtral (float64) trains as its twin whose
  experts are ``nn.Linear`` modules (``theory_tests/support/moe_twin.py``): parameters,
  every expert's A and G and counters, with the inverse form, an active KL clip, an EMA,
  a size guard and right padding (the twin unroutes padded tokens).
"""
import types

import pytest
import torch

from theory_tests.support.moe_twin import build_twin, fused_view, tiny_moe_models
from theory_tests.support.moe_twin import lm_batch as _batch
from torch_impl.baselines import KFAC
from torch_impl.baselines import kfac_equations as ke
from torch_impl.kronecker.layers import LinearType

pytest.importorskip("transformers")

f64 = torch.float64
TOL = 1e-12


def _close(a, b, tol=TOL):
    """|a - b| <= tol x the largest |b| (1 if b is all zero)."""
    scale = max(1.0, b.abs().max().item()) if b.numel() else 1.0
    return a.shape == b.shape and bool(((a - b).abs() <= tol * scale).all())


def _layer(experts=None, has_bias=False, d_in=5, d_out=4, identity_L=False, identity_R=False):
    """A stand-in for a discovered layer: what the equations read (``experts``, sides)."""
    return types.SimpleNamespace(experts=experts, has_bias=has_bias, d_in=d_in + has_bias,
                                 d_out=d_out, identity_L=identity_L, identity_R=identity_R,
                                 type=LinearType())


def _routing(S, E, seed, skew=False):
    """Expert ids (S,) with expert E - 2 routed nothing; ``skew``: most rows to expert 0 (its
    rows then span several of the batched computation's chunks)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (S,), generator=g)
    if skew:
        ids = torch.where(torch.rand(S, generator=g) < 0.8, 0, ids)
    return torch.where(ids == E - 2, E - 1, ids) if E > 1 else ids


# -- (a) the equations ------------------------------------------------------------------
@pytest.mark.parametrize("masked", [False, True], ids=["all-rows", "masked"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("S,E,skew", [(37, 5, False), (200, 8, True), (3, 6, False),
                                      (9, 1, False), (0, 3, False)])
def test_stack_statistics_are_each_experts_2d_statistics(S, E, skew, bias, masked):
    """input_stat / grad_stat of a stack, from (S, d) rows and their expert ids, equal a loop
    applying the 2-D statistics to each expert's own rows and mask; an expert with no rows,
    or only masked ones, gives a zero statistic and count 0."""
    g = torch.Generator().manual_seed(S + E)
    a, gr = torch.randn(S, 5, generator=g, dtype=f64), torch.randn(S, 4, generator=g, dtype=f64)
    ids = _routing(S, E, seed=S, skew=skew)
    mask = torch.rand(S, generator=g) < 0.7 if masked else None
    if masked and S:
        mask[ids == E - 1] = False  # an expert whose rows are all padding
    stack, one = _layer(E, bias), _layer(None, bias)
    A, n_a = ke.input_stat(stack, a, mask, experts=ids)
    G, n_g = ke.grad_stat(stack, gr, mask, experts=ids)
    assert A.shape == (E, 5 + bias, 5 + bias) and G.shape == (E, 4, 4)
    assert n_a.shape == n_g.shape == (E,)
    for e in range(E):
        rows = ids == e
        m = None if mask is None else mask[rows]
        A_e, r_e = ke.input_stat(one, a[rows], m)
        G_e, s_e = ke.grad_stat(one, gr[rows], m)
        assert _close(A[e], A_e) and _close(G[e], G_e), e
        assert float(n_a[e]) == float(r_e) and float(n_g[e]) == float(s_e), e
    if E > 1:
        assert not A[E - 2].any() and n_a[E - 2] == 0  # routed nothing
    if masked and E > 1:
        assert not G[E - 1].any() and n_g[E - 1] == 0  # routed only padding


def test_stack_statistics_at_an_identity_side_store_nothing_but_count():
    """The size guard per expert: an identity side stores nothing, the counts still come."""
    ids = torch.tensor([0, 2, 2, 0, 2])
    rows = torch.randn(5, 3, dtype=f64)
    for stat, side in ((ke.input_stat, "identity_R"), (ke.grad_stat, "identity_L")):
        out, n = stat(_layer(3, **{side: True}), rows, None, experts=ids)
        assert out.numel() == 0 and n.tolist() == [2, 0, 3]


def _spd_stack(E, d, seed):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(E, d, 2 * d, generator=g, dtype=f64)
    return X @ X.mT / (2 * d)


def _state(A, G, method, damping):
    """The decomposition entries of a layer state from factors A, G (None: identity side),
    decomposed by ``decompose`` (2-D) or ``decompose_stack`` (3-D)."""
    s = {}
    for key, F in (("A", A), ("G", G)):
        if F is None:
            continue
        if F.dim() == 2:
            result, attempts = ke.decompose(F, damping, method)
        else:
            result, attempts, failed = ke.decompose_stack(F, damping, method)
            assert not failed
        assert attempts == 0
        s[("eig_" if method == "eigen" else "inv_") + key] = result
    return s


@pytest.mark.parametrize("sides", ["both", "no-A", "no-G"])
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_stack_decomposition_and_preconditioning_are_each_matrixs(method, sides):
    """decompose_stack + preconditioned_gradient of a stack equal decompose +
    preconditioned_gradient of each matrix alone: the eigenvalues (ascending, unique), the
    inverses, and V = Q_G[(Q_G^T G_hat Q_A) / (lam_G lam_A^T + delta)]Q_A^T (or the damped
    inverses' product) of every expert, an identity side broadcast to all of them."""
    E, d_out, d_in, damping = 4, 3, 5, 1e-2
    A = None if sides == "no-A" else _spd_stack(E, d_in, 1)
    G = None if sides == "no-G" else _spd_stack(E, d_out, 2)
    G_hat = torch.randn(E, d_out, d_in, generator=torch.Generator().manual_seed(3), dtype=f64)
    s = _state(A, G, method, damping)
    V = ke.preconditioned_gradient(s, G_hat, damping, method)
    assert V.shape == G_hat.shape
    for e in range(E):
        s_e = _state(None if A is None else A[e], None if G is None else G[e], method, damping)
        assert _close(V[e], ke.preconditioned_gradient(s_e, G_hat[e], damping, method)), e
        for key, val in s_e.items():
            stacked = s[key][0][e] if method == "eigen" else s[key][e]
            alone = val[0] if method == "eigen" else val
            assert _close(stacked, alone), (key, e)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("previous", [False, True], ids=["first", "previous"])
def test_a_failing_expert_retries_alone_and_keeps_its_previous(method, previous):
    """One expert's factor is non-finite: the batched call fails, each matrix is retried on
    its own, the good ones get exactly their solo result (not a float64 or extra-damping
    one), the bad one exhausts its 5 attempts and keeps its part of the previous result, or
    the identity's (eigenvalues 1 and Q = I, or I / (1 + delta)) when there is none."""
    E, d, damping = 3, 4, 1e-2
    F = _spd_stack(E, d, 4)
    F[1, 0, 0] = float("nan")
    old = ke.decompose_stack(_spd_stack(E, d, 5), damping, method)[0] if previous else None
    result, attempts, failed = ke.decompose_stack(F, damping, method, old)
    assert failed == [1] and attempts == 5
    fallback = old if previous else ke.identity_decomposition(E, d, damping, method, f64, "cpu")
    parts = result if method == "eigen" else (result,)
    backup = fallback if method == "eigen" else (fallback,)
    for e in range(E):
        want = backup if e == 1 else ke.decompose(F[e], damping, method)[0]
        want = tuple(t[e] for t in want) if e == 1 else (
            want if method == "eigen" else (want,))
        for got, ref in zip(parts, want):
            assert torch.equal(got[e], ref), e


def test_an_expert_failing_in_float32_moves_alone_to_float64(monkeypatch):
    """An expert whose float32 eigh fails (simulated: the solver raises on its matrix) is
    decomposed in float64 on its own (1 retry); the others keep exactly their float32 solo
    result, never the stack's float64 retry."""
    real = torch.linalg.eigh

    def eigh(M):
        if M.dtype == torch.float32 and bool((M[..., 0, 0] == 123.0).any()):
            raise torch.linalg.LinAlgError("simulated float32 failure")
        return real(M)
    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    F = _spd_stack(3, 4, 13).float()
    F[1, 0, 0] = 123.0  # a larger diagonal entry: still symmetric positive definite
    result, attempts, failed = ke.decompose_stack(F, 1e-2, "eigen")
    assert attempts == 1 and failed == []
    for e in range(3):
        alone, tries = ke.decompose(F[e], 1e-2, "eigen")
        assert tries == (e == 1)
        assert all(torch.equal(r[e], a) for r, a in zip(result, alone)), e


class _Products(torch.overrides.TorchFunctionMode):
    """Records the operand shapes of every matrix product run under it."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in ("matmul", "__matmul__", "bmm"):
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("routing", ["one-expert", "round-robin"])
def test_batched_statistics_are_a_few_batched_products(routing):
    """A stack's statistic is batched products, never one per expert: at most two of at
    most E padded segments of ceil(S / E) rows, whatever the routing (all rows to one
    expert spans E segments)."""
    S, E, d = 64, 8, 3
    rows = torch.randn(S, d, dtype=f64)
    ids = torch.zeros(S, dtype=torch.long) if routing == "one-expert" else torch.arange(S) % E
    with _Products() as products:
        out = ke._expert_outer_sums(rows, ids, E)
    assert _close(out[0], rows[ids == 0].T @ rows[ids == 0])
    assert 1 <= len(products.shapes) <= 2, products.shapes
    assert all(len(s) == 3 and s[0] <= E and s[1:] == (d, S // E) for s in products.shapes)


# -- (b) the optimizer ------------------------------------------------------------------
def _mixtral(num_layers=1, seed=0):
    (_, model), = tiny_moe_models(("mixtral",), seed=seed, num_layers=num_layers).values()
    return model


def _kfac(model, **kwargs):
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    options = dict(inv_freq=1, factor_freq=1, damping=1e-2)
    options.update(kwargs)
    return KFAC(model, sgd, **options)


def _stacks(kfac):
    return [layer for layer in kfac._layers if getattr(layer, "experts", None) is not None]


def test_stack_counters_and_factors_follow_each_expert(monkeypatch):
    """The EMA per expert, from crafted batch factors: expert 0 blends, expert 1 (no rows)
    keeps its factors and counts no_rows, expert 2's non-finite statistic is refused and
    counted for it alone, expert 3 takes its first batch factor; the stack's counters are
    (E,) tensors, as are its factors (E, d, d)."""
    kfac = _kfac(_mixtral(), factor_decay=0.75)
    layer = next(l for l in _stacks(kfac) if l.name.endswith("down_proj"))
    s = kfac._state[layer.name]
    E, dA, dG = layer.experts, layer.d_in, layer.d_out
    assert s["A"].shape == (E, dA, dA) and s["G"].shape == (E, dG, dG)
    assert all(s[k].shape == (E,) for k in ("updates", "non_finite", "overflow", "no_rows"))
    A0, G0 = _spd_stack(E, dA, 6), _spd_stack(E, dG, 7)
    s["A"], s["G"] = A0.clone(), G0.clone()
    s["updates"] = torch.tensor([1, 1, 1, 0])
    A1, G1 = _spd_stack(E, dA, 8), _spd_stack(E, dG, 9)
    A1[2, 0, 1] = float("inf")
    present = torch.tensor([True, False, True, True])
    monkeypatch.setattr(kfac, "_batch_factors", lambda: [(layer, A1, G1, present)])
    kfac._update_factors()
    blend = lambda old, new: 0.75 * old + 0.25 * new  # noqa: E731
    for F, old, new in ((s["A"], A0, A1), (s["G"], G0, G1)):
        assert _close(F[0], blend(old[0], new[0]))
        assert torch.equal(F[1], old[1]) and torch.equal(F[2], old[2])
        assert torch.equal(F[3], new[3])
    assert s["updates"].tolist() == [2, 1, 1, 1]
    assert s["no_rows"].tolist() == [0, 1, 0, 0]
    assert s["non_finite"].tolist() == [0, 0, 1, 0]
    assert s["overflow"].tolist() == [0, 0, 0, 0]
    assert int(kfac.skipped_updates) == 1


def test_a_stack_failing_to_decompose_counts_per_expert(monkeypatch):
    """Experts whose factors cannot be decomposed keep their previous decomposition and
    count one failure each (a warning names them); the other experts are decomposed."""
    kfac = _kfac(_mixtral())
    layer = _stacks(kfac)[0]
    s = kfac._state[layer.name]
    s["A"] = _spd_stack(layer.experts, layer.d_in, 10)
    kfac._decompose_all()
    before = tuple(t.clone() for t in s["eig_A"])
    s["A"] = _spd_stack(layer.experts, layer.d_in, 11)
    s["A"][1:3] = float("nan")
    with pytest.warns(RuntimeWarning, match=r"experts \[1, 2\]"):
        kfac._decompose_all()
    assert kfac.decomposition_failures == 2 and kfac.decomposition_retries == 10
    for e in (1, 2):
        assert all(torch.equal(now[e], then[e]) for now, then in zip(s["eig_A"], before))
    assert not torch.equal(s["eig_A"][1][0], before[1][0])


def test_the_kl_clip_sums_every_experts_term():
    """The KL clip's sum over layers is a sum over every expert of a stack: nu from one
    stack's (G_hat, V) equals nu from its experts as E separate layers."""
    kfac = _kfac(_mixtral(), kl_clip=1e-3)
    g = torch.Generator().manual_seed(12)
    G_hat, V = (torch.randn(4, 3, 5, generator=g, dtype=f64) for _ in range(2))
    yes = torch.tensor(True)
    every = yes.expand(4, 1, 1)
    stacked = kfac._kl_clip_factor([(None, None, G_hat, V, False, every)])
    alone = kfac._kl_clip_factor([(None, None, G_hat[e], V[e], False, yes) for e in range(4)])
    assert 0 < float(stacked) < 1 and _close(stacked, alone)
    first = kfac._kl_clip_factor([(None, None, G_hat[0], V[0], False, yes)])
    assert not _close(stacked, first)
    # an expert whose factors never took a statistic is not preconditioned: no term of its
    only_first = torch.tensor([True, False, False, False]).view(4, 1, 1)
    assert _close(kfac._kl_clip_factor([(None, None, G_hat, V, False, only_first)]), first)


def test_payload_counts_each_expert_and_its_row_count():
    """payload_bytes: a stack of E experts is E layers' factors plus its E row counts (and
    the stack's own unused count slot): the twin's payload, whose E bias-free Linear experts
    each send one count, plus one entry per stack."""
    model = _mixtral()
    fused, twin = _kfac(model), _kfac(build_twin(model))
    stacks = _stacks(fused)
    assert len(stacks) == 2 and stacks[0].experts == 4
    assert fused.payload_bytes == twin.payload_bytes + len(stacks) * 8


def _train(model, kfac, steps, padded=False, start=0):
    for t in range(start, start + steps):
        ids, mask, labels = _batch(t, padded)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        kfac.step()
        kfac.zero_grad()


def test_state_dict_round_trip_continues_as_the_uninterrupted_run():
    """Saved after 2 steps and loaded into a fresh K-FAC on a copy of the model, the stack's
    (E, ...) factors, decompositions and counters continue: the third step equals the
    uninterrupted run's, bit for bit; a stack's state does not load into one layer."""
    model = _mixtral()
    kfac = _kfac(model, inv_freq=2)
    _train(model, kfac, 2)
    saved = {"model": {n: p.detach().clone() for n, p in model.named_parameters()},
             "kfac": kfac.state_dict()}
    _train(model, kfac, 1, start=2)
    other = _mixtral(seed=1)
    with torch.no_grad():
        for n, p in other.named_parameters():
            p.copy_(saved["model"][n])
    resumed = _kfac(other, inv_freq=2)
    resumed.load_state_dict(saved["kfac"])
    _train(other, resumed, 1, start=2)
    theirs = dict(other.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in model.named_parameters())
    name = _stacks(kfac)[0].name
    state = resumed.preconditioner_state_dict()
    assert state["layers"][name]["A"].dim() == 3 and state["layers"][name]["updates"].shape == (4,)
    broken = {"steps": state["steps"], "layers": dict(state["layers"])}
    broken["layers"][name] = dict(state["layers"][name], updates=torch.zeros((), dtype=torch.long),
                                  no_rows=torch.zeros((), dtype=torch.long))
    with pytest.raises(ValueError, match="counters"):
        resumed.load_preconditioner_state_dict(broken)


# -- (c) end to end against the twin ------------------------------------------------------
CASES = {
    "eigen": dict(),
    "inverse-kl-ema": dict(method="inverse", kl_clip=1e-6, factor_decay=0.5, inv_freq=2),
    "size-guard": dict(max_factor_dim=20),  # gate_up's G (2I = 24) and lm_head's G at I
}


def _twin_name(name, e):
    prefix, projection = name.rsplit(".", 1)
    return f"{prefix}.experts.{e}." + ("gate_up" if projection == "gate_up_proj" else "down")


@pytest.mark.filterwarnings("ignore:KFAC. factor sides above max_factor_dim")
@pytest.mark.parametrize("padded", [False, True], ids=["plain", "padded"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_mixtral_trains_as_its_twin(case, padded):
    """3 K-FAC steps of a float64 Mixtral with fused experts equal its twin's (experts as
    nn.Linear, padded tokens unrouted): every parameter, every expert's A and G and its
    counters (an expert routed nothing: no_rows, as the twin Linear never called), with the
    inverse form, an active KL clip (nu < 1) and an EMA, or a size guard (identity sides)."""
    model = _mixtral(num_layers=2)
    mask = _batch(0, padded)[1]
    twin = build_twin(model, unroute_mask=mask.bool() if padded else None)
    fused_k, twin_k = _kfac(model, **CASES[case]), _kfac(twin, **CASES[case])
    nus = []
    clip = fused_k._kl_clip_factor
    fused_k._kl_clip_factor = lambda work: nus.append(clip(work)) or nus[-1]
    _train(model, fused_k, 3, padded)
    _train(twin, twin_k, 3, padded)
    params = dict(model.named_parameters())
    err = max((params[n].detach() - p).abs().max().item() for n, p in fused_view(twin).items())
    initial = dict(_mixtral(num_layers=2).named_parameters())
    change = max((params[n].detach() - p).abs().max().item() for n, p in initial.items())
    factors, twin_factors = fused_k.factors(), twin_k.factors()
    counters, twin_counters = fused_k.counters(), twin_k.counters()
    ferr = 0.0
    for layer in _stacks(fused_k):
        assert (layer.identity_L, layer.identity_R) == (
            case == "size-guard" and layer.name.endswith("gate_up_proj"), False)
        for e in range(layer.experts):
            twin_name = _twin_name(layer.name, e)
            for F, F_twin in zip(factors[layer.name], twin_factors[twin_name]):
                assert (F is None) == (F_twin is None)
                if F is not None:
                    ferr = max(ferr, (F[e] - F_twin).abs().max().item()
                               / max(1.0, F_twin.abs().max().item()))
            for key, value in counters[layer.name].items():
                assert int(value[e]) == int(twin_counters[twin_name][key]), (twin_name, key)
    print(f"[kfac moe twin {case} {'padded' if padded else 'plain'}] max |fused - twin| "
          f"= {err:.1e} (largest change {change:.1e}), factors {ferr:.1e}")
    assert change > 1e-3 and err <= TOL * change and ferr <= TOL
    if case == "inverse-kl-ema":
        assert nus and all(float(nu) < 1 for nu in nus)
