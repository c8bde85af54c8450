"""FACTOR-ROUNDING-PORT: MKOR's 16-bit inverse factors written by LP1 from the LP2 stream
(``factor_rounding="stochastic"``), the seed in the state dict, the options validated; and
round-to-nearest (the default) unchanged."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as Fn

from torch_impl import MKOR
from torch_impl.common.rounding import name_word, stochastic_round, stream_seed
from torch_impl.mkor.factors import factor_update

bf16 = torch.bfloat16


def _model(seed=0):
    torch.manual_seed(seed)
    # two hidden layers of the same shape: the same statistics' shapes, different streams
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 8))


def _batch(t):
    g = torch.Generator().manual_seed(100 + t)
    return torch.randn(16, 6, generator=g), torch.randn(16, 8, generator=g)


def _mkor(model, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return MKOR(model, opt, inv_freq=1, factor_dtype=bf16, **kw), opt


def _step(model, mkor, t):
    x, y = _batch(t)
    Fn.mse_loss(model(x), y).backward()
    mkor.step()
    mkor.zero_grad()


def _expected_write(J_prev, v, seed, first, options):
    """The documented write: the float32 update of the stored factor, its upper triangle
    rounded by LP1 with ``seed``, mirrored."""
    computed, _ = factor_update(J_prev.float(), v, first=first, **options)
    if seed is None:
        return computed.to(bf16)
    upper = torch.triu(stochastic_round(computed, bf16, seed))
    return upper + torch.triu(upper, 1).mT


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_each_write_is_the_documented_rounding_of_the_float32_update(rounding):
    """Every factor of every layer at every step (3 steps) is, bit for bit, the float32 K8
    update of the stored bf16 factor written to nearest, or (stochastic) LP1 of it with
    the seed stream_seed(rounding_seed, layer index, name_word("L_inv" | "R_inv"), step),
    upper triangle mirrored: so the layer index, the side and the step all enter the stream,
    and two layers of the same shape fed the same kind of statistics never share it."""
    model = _model()
    mkor, _ = _mkor(model, factor_rounding=rounding, rounding_seed=2024)
    o = mkor.options
    options = dict(variant=o.variant, stat_decay=o.stat_decay, zeta=o.zeta,
                   threshold=o.threshold, stabilizer_timing=o.stabilizer_timing,
                   stabilizer_reset=o.stabilizer_reset, first_update=o.first_update)
    names = mkor.preconditioned_modules
    assert len(names) == 3
    for t in range(3):
        x, y = _batch(t)
        Fn.mse_loss(model(x), y).backward()
        before = {n: tuple(f.clone() for f in pair) for n, pair in mkor.inverse_factors().items()}
        vectors = mkor.pending_vectors()
        mkor.step()
        mkor.zero_grad()
        for index, name in enumerate(names):
            L_prev, R_prev = before[name]
            a_bar, g_bar = vectors[name]
            L_now, R_now = mkor.inverse_factors()[name]
            for key, prev, v, now in (("R_inv", R_prev, a_bar, R_now),
                                      ("L_inv", L_prev, g_bar, L_now)):
                seed = None if rounding == "nearest" else stream_seed(
                    2024, index, name_word(key), t)
                want = _expected_write(prev, v, seed, t == 0, options)
                assert now.dtype == bf16 and torch.equal(now, want), (t, name, key)
                assert torch.equal(now, now.mT)  # stored exactly symmetric


def test_stochastic_writes_differ_from_nearest_and_between_seeds():
    """The option acts: the stochastic run's factors are not the nearest run's, and another
    rounding_seed gives other factors (same data, same float32 arithmetic)."""
    runs = {}
    for key, kw in {"nearest": {}, "s1": dict(factor_rounding="stochastic", rounding_seed=1),
                    "s2": dict(factor_rounding="stochastic", rounding_seed=2)}.items():
        model = _model()
        mkor, _ = _mkor(model, **kw)
        for t in range(2):
            _step(model, mkor, t)
        runs[key] = [f for pair in mkor.inverse_factors().values() for f in pair]
    for a, b in (("nearest", "s1"), ("s1", "s2")):
        assert not all(torch.equal(x, y) for x, y in zip(runs[a], runs[b])), (a, b)


def test_rank_k_writes_are_stochastic_symmetric_and_seeded():
    """Rank k (KC8) shares the write: symmetric bf16 factors, a function of the seed."""
    out = []
    for seed in (5, 5, 6):
        model = _model()
        mkor, _ = _mkor(model, rank=2, factor_rounding="stochastic", rounding_seed=seed)
        for t in range(2):
            _step(model, mkor, t)
        factors = [f for pair in mkor.inverse_factors().values() for f in pair]
        assert all(f.dtype == bf16 and torch.equal(f, f.mT) for f in factors)
        out.append(factors)
    assert all(torch.equal(a, b) for a, b in zip(out[0], out[1]))
    assert not all(torch.equal(a, b) for a, b in zip(out[0], out[2]))


def _factors(mkor):
    return [f for pair in mkor.inverse_factors().values() for f in pair]


def test_the_seed_is_in_the_state_dict_and_a_resumed_run_is_the_uninterrupted_one():
    """6 steps in one go equal 3 steps, ``state_dict``, a fresh MKOR built under another
    torch seed (so its own default rounding_seed differs), ``load_state_dict``, 3 steps:
    factors and parameters bit for bit. The seed rides in the run entry (``mkor_run``)."""
    model = _model()
    torch.manual_seed(11)
    mkor, _ = _mkor(model, factor_rounding="stochastic")
    for t in range(6):
        _step(model, mkor, t)
    params, factors = [p.detach() for p in model.parameters()], _factors(mkor)

    model = _model()
    torch.manual_seed(11)
    first, _ = _mkor(model, factor_rounding="stochastic")
    for t in range(3):
        _step(model, first, t)
    saved = first.state_dict()
    run_entries = [e["mkor_run"] for e in saved["state"].values() if "mkor_run" in e]
    assert len(run_entries) == 1 and run_entries[0]["rounding_seed"] == first.rounding_seed
    model2 = _model()
    with torch.no_grad():
        for p, q in zip(model2.parameters(), model.parameters()):
            p.copy_(q)
    torch.manual_seed(12)
    resumed, _ = _mkor(model2, factor_rounding="stochastic")
    assert resumed.rounding_seed != first.rounding_seed
    resumed.load_state_dict(saved)
    assert resumed.rounding_seed == first.rounding_seed
    for t in range(3, 6):
        _step(model2, resumed, t)
    assert all(torch.equal(a, b) for a, b in zip(_factors(resumed), factors))
    assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), params))


def test_the_default_seed_follows_torch_manual_seed():
    """rounding_seed=None: one draw of torch's default generator at construction (LP2), so
    torch.manual_seed fixes it and two MKORs built in sequence get different streams."""
    seeds = []
    for _ in range(2):
        models = _model(), _model()  # (each draws its weights under torch.manual_seed(0))
        torch.manual_seed(3)
        a, _ = _mkor(models[0], factor_rounding="stochastic")
        b, _ = _mkor(models[1], factor_rounding="stochastic")
        seeds.append((a.rounding_seed, b.rounding_seed))
    assert seeds[0] == seeds[1] and seeds[0][0] != seeds[0][1]
    nearest, _ = _mkor(_model())
    assert nearest.rounding_seed is None  # nothing drawn, nothing in the state dict
    assert all("rounding_seed" not in e.get("mkor_run", {})
               for e in nearest.state_dict()["state"].values())


@pytest.mark.parametrize("kw, name", [
    (dict(factor_rounding="stochastic", factor_dtype=torch.float32), "factor_rounding"),
    (dict(factor_rounding="stochastic", factor_dtype=torch.float64), "factor_rounding"),
    (dict(factor_rounding="stochastic"), "factor_rounding"),  # the paper column: float32
    (dict(factor_rounding="toward_zero", factor_dtype=bf16), "factor_rounding"),
    (dict(factor_rounding="stochastic", factor_dtype=bf16, rounding_seed=-1), "rounding_seed"),
    (dict(factor_rounding="stochastic", factor_dtype=bf16, rounding_seed=2 ** 63),
     "rounding_seed"),
    (dict(factor_rounding="stochastic", factor_dtype=bf16, rounding_seed=1.5), "rounding_seed"),
])
def test_bad_options_are_refused_by_name(kw, name):
    model = _model()
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1), **kw)


def test_the_released_column_takes_stochastic_float16():
    """variant="released" stores float16 factors (its column): stochastic rounding applies
    to them (the general LP1 path) and keeps them symmetric."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mkor = MKOR(model, opt, inv_freq=1, variant="released", factor_rounding="stochastic",
                rounding_seed=9)
    for t in range(3):
        _step(model, mkor, t)
    factors = _factors(mkor)
    assert all(f.dtype == torch.float16 and torch.equal(f, f.mT) for f in factors)
