"""bf16 stochastic rounding "in distribution": HeavyBall 3.2.1's bf16 storage and torchao 0.18's
``_AdamW(bf16_stochastic_round=True)`` against LP1 (``reference/common/rounding.py``), against
each other, and against ours (MARS with gamma = 0, ``state_rounding="stochastic"``).

No two of them share a random stream, so the comparison is of laws: one AdamW step from one
starting state written into 4,096 identical rows (``support/peer_rounding.py``), the verdict
per tensor from the counts of rounding up (``support/rounding_law.py``: Z = 5 bands from the
binomial standard error, fixed seeds).  What each rounds, measured:

* HeavyBall: its bf16 state (exp_avg, exp_avg_sq: the debiased moments) and a bf16 parameter,
  stochastically; a float16 state to nearest; float32 parameters and state unrounded;
* torchao: the bf16 parameter stochastically; its state, bf16 because it is ``zeros_like(p)``,
  to nearest;
* ours: the bf16 state (m, v) and the bf16 parameter stochastically (LP1, LP2 streams), a
  float32 parameter unrounded; through HeavyBall's map of bf16 storage, HeavyBall's verdicts;
* all three: 16 random bits added to (HeavyBall, ours) or compared with (torchao) the low 16
  bits of the float32 pattern, which is LP1 exactly for a float32 x (p = those bits / 2^16).

torchao runs eager here (``eager_torch_compile``); its compiled step is checked in
``theory_tests/integrations/test_peer_rounding_compiled.py`` (slow: 19 s of compilation).
"""
import numpy as np
import pytest
import torch

from reference.common.rounding import neighbours, stochastic_round
from theory_tests.support.heavyball_conventions import load_heavyball
from theory_tests.support.peer_rounding import (heavyball_adapter, one_step, ours_adapter,
                                                ours_as_heavyball_adapter, torchao_adapter)
from theory_tests.support.rounding_law import Z, classify, same_law

heavyball = load_heavyball()
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(autouse=True)
def eager_heavyball(monkeypatch):
    monkeypatch.setattr(heavyball.utils, "compile_mode", None)


@pytest.fixture(scope="module")
def torchao_laws():
    return one_step(torchao_adapter())


@pytest.fixture(scope="module")
def heavyball_laws():
    heavyball.utils.compile_mode, saved = None, heavyball.utils.compile_mode
    try:
        return one_step(heavyball_adapter(heavyball))
    finally:
        heavyball.utils.compile_mode = saved


def test_the_verdicts_tell_the_laws_apart():
    """The classifier on writes whose law is known: LP1 through the oracle, nearest, toward
    zero, LP1 with p shifted by 0.05, and shifted by +-0.1 in some columns only."""
    rng = np.random.default_rng(0)
    rows, x = 4096, torch.tensor(rng.uniform(-3, 3, 64), dtype=torch.float32)
    lo, hi = neighbours(x.double().numpy(), "bfloat16")
    u = rng.random((rows, 64))
    lp1 = stochastic_round(np.broadcast_to(x.double().numpy(), (rows, 64)), u, "bfloat16")
    as_bf16 = lambda a: torch.tensor(a).to(BF16)  # noqa: E731 (exact: bf16 values)
    assert classify(as_bf16(lp1), x).verdict == "stochastic"
    assert classify(x.to(BF16).expand(rows, -1), x).verdict == "nearest"
    toward_zero = np.where(np.abs(lo) < np.abs(hi), lo, hi)
    assert classify(as_bf16(np.broadcast_to(toward_zero, (rows, 64))), x).verdict == "other"
    p = (x.double().numpy() - lo) / (hi - lo)
    shifted = np.where(u < np.clip(p + 0.05, 0, 1), hi, lo)
    assert classify(as_bf16(shifted), x).verdict == "other"
    # off by +-0.1 in 16 columns each, the shifts cancelling in the mean (the same x twice),
    # right in the other 32: the per-column band alone tells it
    x2 = torch.cat([x[:16], x[:16], x[32:]])
    lo2, hi2 = neighbours(x2.double().numpy(), "bfloat16")
    p2 = (x2.double().numpy() - lo2) / (hi2 - lo2)
    p2 = np.clip(p2 + np.r_[np.full(16, 0.1), np.full(16, -0.1), np.zeros(32)], 0, 1)
    law = classify(as_bf16(np.where(u < p2, hi2, lo2)), x2)
    assert law.verdict == "other" and law.mean_z < Z


@pytest.mark.parametrize("param_dtype, storage, expected", [
    (BF16, "bfloat16", dict(exp_avg="stochastic", exp_avg_sq="stochastic", param="stochastic")),
    (F32, "bfloat16", dict(exp_avg="stochastic", exp_avg_sq="stochastic", param="unrounded")),
    (BF16, "float32", dict(exp_avg="unrounded", exp_avg_sq="unrounded", param="stochastic")),
    (BF16, "float16", dict(exp_avg="nearest", exp_avg_sq="nearest", param="stochastic")),
], ids=["bf16-params-bf16-state", "f32-params-bf16-state", "bf16-params-f32-state",
        "bf16-params-f16-state"])
def test_what_heavyball_rounds_and_how(param_dtype, storage, expected):
    laws = one_step(heavyball_adapter(heavyball, param_dtype, storage), rows=2048)
    assert {k: law.verdict for k, law in laws.items()} == expected


def test_torchao_rounds_the_parameter_stochastically_and_its_state_to_nearest(torchao_laws):
    assert {k: law.verdict for k, law in torchao_laws.items()} == dict(
        exp_avg="nearest", exp_avg_sq="nearest", param="stochastic")


def test_heavyball_and_torchao_write_the_parameter_by_one_law(heavyball_laws, torchao_laws):
    """The same x (to float32 rounding) in both: the frequencies of rounding up agree column
    by column within Z standard errors of their difference."""
    a, b = heavyball_laws["param"], torchao_laws["param"]
    assert a.verdict == b.verdict == "stochastic"
    assert np.abs(a.p - b.p).max() < 2.0 ** -14  # a few float32 ulps of x apart
    assert same_law(a, b) <= Z
    assert 0.05 < a.p.mean() < 0.95 and (a.p > 0.2).sum() > 20  # the columns are informative


@pytest.fixture(scope="module")
def our_laws():
    return one_step(ours_adapter())


def test_ours_rounds_its_bf16_state_and_parameter_by_lp1(our_laws):
    assert {k: law.verdict for k, law in our_laws.items()} == dict(
        exp_avg="stochastic", exp_avg_sq="stochastic", param="stochastic")


def test_ours_with_nearest_draws_nothing_and_leaves_float32_parameters_unrounded():
    """The controls of the experiment on our own options: with ``state_rounding="nearest"``
    (today's arithmetic in the parameter's dtype) every row writes the same value, so no
    column has a frequency strictly between 0 and 1; stochastic rounding of the state leaves
    float32 parameters as computed."""
    for law in one_step(ours_adapter("nearest"), rows=256).values():
        assert law.verdict != "stochastic" and set(np.unique(law.freq)) <= {0.0, 1.0}
    laws = one_step(ours_adapter(param_dtype=F32), rows=2048)
    assert {k: law.verdict for k, law in laws.items()} == dict(
        exp_avg="stochastic", exp_avg_sq="stochastic", param="unrounded")


def test_ours_writes_the_parameter_by_the_peers_law(our_laws, heavyball_laws, torchao_laws):
    """Ours and each peer: the same x (to float32 rounding), frequencies within Z standard
    errors column by column."""
    for peer in (heavyball_laws, torchao_laws):
        assert np.abs(our_laws["param"].p - peer["param"].p).max() < 2.0 ** -14
        assert same_law(our_laws["param"], peer["param"]) <= Z


@pytest.mark.parametrize("param_dtype, storage", [(BF16, "bfloat16"), (F32, "bfloat16")],
                         ids=["bf16-params", "f32-params"])
def test_the_heavyball_map_of_bf16_storage_rounds_what_heavyball_rounds(param_dtype, storage):
    """``from_heavyball_adamw(storage_dtype="bfloat16")`` gives ours HeavyBall's verdicts,
    and its parameter law (the state holds m, v against HeavyBall's m̂, v̂: other x)."""
    ours = one_step(ours_as_heavyball_adapter(param_dtype, storage), rows=2048)
    peer = one_step(heavyball_adapter(heavyball, param_dtype, storage), rows=2048)
    assert {k: law.verdict for k, law in ours.items()} == \
        {k: law.verdict for k, law in peer.items()}
    if param_dtype == BF16:
        assert same_law(ours["param"], peer["param"]) <= Z
