"""MKOR-H's loss-rate switch (KT14; K18, MKOR.md 2.6).

The switch steps are computed by hand in the comments from the rule in
``LossRateSwitch``'s docstring: windows of W losses, checks when n = t + 1 is a multiple
of check_every and n >= 2W, r_t = (lbar_{t-W} - lbar_t) / (W |lbar_{t-W}|).
"""
import math

import numpy as np
import pytest

from reference.common import first_order
from reference.mkor.preconditioner import MKORConfig
from reference.mkor.hybrid import LossRateSwitch, MKORHybridReference

ALPHA = 0.05   # decay rate of the synthetic curves
W, EVERY, TAU, PATIENCE = 5, 5, 1e-3, 2


def curve(length, flats=()):
    """loss_t = exp(-ALPHA s_t) with s_0 = 0 and s_t = s_{t-1} + 1, except that s stays
    put for start < t < end for each (start, end) in ``flats`` (end None: forever). So
    the loss is exactly flat from t = start to t = end - 1 (r_t = 0 there) and decays
    again from t = end."""
    s = np.zeros(length)
    for t in range(1, length):
        flat = any(start < t and (end is None or t < end) for start, end in flats)
        s[t] = s[t - 1] + (0 if flat else 1)
    return np.exp(-ALPHA * s)


def run(switch, losses):
    return [switch.observe(loss) for loss in losses]


def test_decay_rate_is_above_threshold():
    # On pure decay, every check gives r = (1 - exp(-ALPHA W)) / W = 0.04424 > TAU.
    assert (1 - math.exp(-ALPHA * W)) / W == pytest.approx(0.044240, abs=1e-6)


def test_switch_fires_once_at_hand_computed_step():
    """Decay, then a plateau from t = 50.

    Checks at t = 9, 14, 19, ... (n = t + 1 a multiple of 5, n >= 10).
    * t <= 49: both windows decaying, r = 0.0442 > tau.
    * t = 54: older window t = 45..49 decaying, newer 50..54 flat at exp(-2.5):
      r = (1 - exp(-2.5) / mean(exp(-0.05 * (45..49)))) / 5 ~ 0.028 > tau.
    * t = 59: both windows flat, r = 0: first slow check.
    * t = 64: r = 0 again, the 2nd consecutive slow check = patience: switch at t = 64.
    """
    older = np.mean(np.exp(-ALPHA * np.arange(45, 50)))
    assert (1 - math.exp(-2.5) / older) / W > TAU
    switch = LossRateSwitch(W, EVERY, TAU, PATIENCE)
    out = run(switch, curve(200, [(50, None)]))
    assert out.index(True) == 64 and all(out[64:]) and not any(out[:64])
    assert switch.switched_at == 64
    assert [t for t, _ in switch.rates][:3] == [9, 14, 19]
    assert switch.rates[-1] == (64, 0.0)
    # Deterministic: a second switch on the same curve does the same.
    assert run(LossRateSwitch(W, EVERY, TAU, PATIENCE), curve(200, [(50, None)])) == out


def test_no_switch_while_decaying_above_threshold():
    switch = LossRateSwitch(W, EVERY, TAU, PATIENCE)
    assert not any(run(switch, curve(2000)))
    assert len(switch.rates) == 2000 // EVERY - 1 and switch.switched_at is None


def test_single_slow_check_does_not_switch():
    """Plateau t = 50..59, decay again from t = 60: t = 59 is slow (r = 0), but at
    t = 64 the newer window 60..64 decays: r = (1 - mean(exp(-0.05 k), k = 1..5)) / 5
    = 0.0274 > tau, which resets the count; the curve decays afterwards: no switch."""
    assert (1 - np.mean(np.exp(-ALPHA * np.arange(1, 6)))) / W > TAU
    switch = LossRateSwitch(W, EVERY, TAU, PATIENCE)
    assert not any(run(switch, curve(400, [(50, 60)])))
    rates = dict(switch.rates)
    assert rates[59] == 0.0 and rates[64] > TAU


def test_slow_checks_must_be_consecutive():
    """Two isolated slow checks (t = 59 and t = 109, each a flat stretch of 10 steps)
    separated by fast ones (t = 64, 104: r ~ 0.027 and 0.028 > tau) never add up to
    patience = 2: the count restarts after every fast check."""
    switch = LossRateSwitch(W, EVERY, TAU, PATIENCE)
    assert not any(run(switch, curve(400, [(50, 60), (100, 110)])))
    rates = dict(switch.rates)
    assert rates[59] == 0.0 and rates[109] == 0.0
    assert min(rates[64], rates[104], rates[114]) > TAU


def test_switch_is_one_way():
    switch = LossRateSwitch(W, EVERY, TAU, PATIENCE)
    run(switch, curve(70, [(50, None)]))
    assert switch.switched_at == 64
    assert all(run(switch, curve(100)))      # fast decay afterwards does not undo it
    assert switch.switched_at == 64


@pytest.mark.parametrize("k", [0, 1, 37])
def test_switch_step_fires_exactly_at_k(k):
    switch = LossRateSwitch(W, EVERY, threshold=None, patience=PATIENCE, switch_step=k)
    out = run(switch, curve(100, [(3, None)]))  # a plateau the disabled rate rule ignores
    assert out == [t >= k for t in range(100)]
    assert switch.switched_at == k


def test_non_finite_loss_counts_as_slow():
    switch = LossRateSwitch(W, EVERY, TAU, patience=1)
    losses = list(curve(12))
    losses[11] = float("nan")
    out = run(switch, losses + [1.0] * 5)
    # Checks at t = 9 (fine) and t = 14 (window contains the NaN): switch at t = 14.
    assert out.index(True) == 14


def test_hybrid_returns_the_raw_gradient_after_the_switch():
    """After the switch the step hands back the very gradient arrays, so the backbone's
    trajectory is bit-equal to running the backbone alone with the same state."""
    rng = np.random.default_rng(0)
    hybrid = MKORHybridReference(MKORConfig(inv_freq=2),
                                 LossRateSwitch(W, EVERY, TAU, PATIENCE, switch_step=4))
    p_hybrid = p_alone = None
    state_hybrid, state_alone = {}, {}
    for t in range(10):
        layer = {"grad_W": rng.normal(size=(3, 2)), "grad_b": rng.normal(size=3),
                 "a_bar": rng.normal(size=3), "g_bar": rng.normal(size=3)}
        (dW, db), = hybrid.step([layer], loss=1.0)
        if t < 4:
            assert hybrid.mkor is not None
            assert not np.array_equal(dW, layer["grad_W"])  # preconditioned by MKOR
            p_hybrid = first_order.sgd(np.ones((3, 2)) if p_hybrid is None else p_hybrid, dW,
                                       state_hybrid, lr=0.1, momentum=0.9)
            if t == 3:  # hand the backbone's state over, as the BERT runs do
                p_alone, state_alone = p_hybrid.copy(), {k: np.copy(v) for k, v in state_hybrid.items()}
            continue
        assert hybrid.mkor is None and dW is layer["grad_W"] and db is layer["grad_b"]
        p_hybrid = first_order.sgd(p_hybrid, dW, state_hybrid, lr=0.1, momentum=0.9)
        p_alone = first_order.sgd(p_alone, layer["grad_W"], state_alone, lr=0.1, momentum=0.9)
        np.testing.assert_array_equal(p_hybrid, p_alone)


def test_argument_validation():
    for bad in ((0, 1, TAU, 1), (1, 0, TAU, 1), (1, 1, TAU, 0)):
        with pytest.raises(ValueError):
            LossRateSwitch(*bad)
    with pytest.raises(ValueError):
        LossRateSwitch(1, 1, TAU, 1, switch_step=-1)
