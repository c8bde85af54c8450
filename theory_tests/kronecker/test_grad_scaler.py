"""MKOR and K-FAC under torch.amp.GradScaler (CPU): a scaled loop equals the unscaled one,
an overflow step changes nothing, and the unscale_-then-clip path with ``grad_scaler=``
equals ``scaler.step`` alone. A loss scale that is a power of two multiplies every gradient
and every statistic exactly, so scaled and unscaled loops agree bit for bit (``torch.equal``).
Tiny float32 GPT-2 from a config (:mod:`hf_cases`)."""
import math

import pytest
import torch
import torch.nn as nn

from torch_impl.mkor import MKOR

from theory_tests.support.hf_cases import equal_factors, factors_of, is_identity, lm_batch, snapshot, tiny_gpt2, wrap


def _full_state(model, pre):
    """Everything a step could change: parameters, backbone state, factors, counters, steps."""
    state = {"params": snapshot(model),
             "opt": {n: {k: v.clone() for k, v in pre.optimizer.state[p].items()}
                     for n, p in model.named_parameters() if p in pre.optimizer.state},
             "factors": factors_of(pre), "steps": pre.steps}
    if isinstance(pre, MKOR):
        state["counters"] = {n: {k: v.clone() for k, v in c.items()}
                             for n, c in pre.counters().items()}
    else:
        state["counters"] = {n: {k: s[k].clone() for k in ("updates", "non_finite", "overflow", "no_rows")}
                             for n, s in pre._state.items()}
    return state


def _states_equal(a, b):
    def eq(x, y):
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, tuple):
            return len(x) == len(y) and all(eq(u, v) for u, v in zip(x, y))
        if isinstance(x, torch.Tensor):
            return torch.equal(x, y)
        return x == y
    return eq(a, b)


# -- GradScaler ---------------------------------------------------------------------------------
BATCHES = [lm_batch(t) for t in range(4)]


def _amp_loop(kind, mode, batches=BATCHES, bad_at=None, probe=None):
    """mode: "plain" (no scaler), "scaled" (scale / backward / step / update), "unscale"
    (unscale_ + clip before step, no grad_scaler=), "unscale_gs" (the same with
    grad_scaler=scaler). ``bad_at``: that step's loss is multiplied by inf (overflow).
    ``probe(t, model, pre)`` runs after each step."""
    model = tiny_gpt2(dtype=torch.float32)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    pre = wrap(kind, model, grad_scaler=scaler if mode == "unscale_gs" else None)
    for t, batch in enumerate(batches):
        loss = model(**batch).loss
        if mode == "plain":
            loss.backward()
            pre.step()
        else:
            if t == bad_at:
                loss = loss * math.inf
            scaler.scale(loss).backward()
            if mode.startswith("unscale"):
                scaler.unscale_(pre)
                # max_norm far above the norm: the clip factor is clamped to exactly 1.0
                nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
            scaler.step(pre)
            scaler.update()
        pre.zero_grad()
        if probe is not None:
            probe(t, model, pre)
    return model, pre, scaler


@pytest.mark.parametrize("kind", ["mkor", "kfac"])
def test_grad_scaler_matches_unscaled_loop_bitwise(kind):
    """``scaler.scale(loss).backward(); scaler.step(pre); scaler.update()`` (float32, scale
    2^10) gives bit-identical parameters and factors to the same loop without a scaler: a
    power-of-two scale is exact through backward, the unscale, and the statistics
    (which MKOR/K-FAC divide by the handed-over scale)."""
    m0, p0, _ = _amp_loop(kind, "plain")
    m1, p1, scaler = _amp_loop(kind, "scaled")
    assert scaler.get_scale() == 2.0 ** 10  # no overflow happened
    assert p0.steps == p1.steps == 4
    assert all(torch.equal(a, b) for a, b in zip(m0.parameters(), m1.parameters()))
    f0, f1 = factors_of(p0), factors_of(p1)
    assert not is_identity(next(iter(f0.values()))[1])
    assert equal_factors(f0, f1)


@pytest.mark.parametrize("kind", ["mkor", "kfac"])
def test_grad_scaler_overflow_step_changes_nothing(kind):
    """An overflowing step (loss x inf: inf/NaN gradients and statistics) changes nothing:
    parameters, backbone state, factors, counters, steps; and the run then continues
    bit-identically to a twin run that never saw the bad batch (its scale is halved, which
    is exact)."""
    seen = {}

    def probe(t, model, pre):
        seen[t] = _full_state(model, pre)

    batches = BATCHES[:3] + [BATCHES[3]]
    m, p, scaler = _amp_loop(kind, "scaled", batches=batches, bad_at=2, probe=probe)
    assert scaler.get_scale() == 2.0 ** 9
    assert seen[1]["opt"]  # momentum buffers exist, so the backbone state is compared
    assert _states_equal(seen[1], seen[2])
    assert p.steps == 3
    twin_m, twin_p, _ = _amp_loop(kind, "scaled", batches=BATCHES[:2] + [BATCHES[3]])
    assert _states_equal(_full_state(m, p), _full_state(twin_m, twin_p))


def test_unscale_then_clip_with_grad_scaler_equals_scaler_step():
    """``scaler.unscale_(mkor)`` + clipping + ``scaler.step(mkor)`` with ``grad_scaler=scaler``
    is bit-identical to the plain ``scaler.step`` path (the statistics still divided by the
    scale, read from the scaler); without ``grad_scaler`` MKOR warns once that the scale is
    unknown, and its factors are then those of undivided statistics (they differ)."""
    m0, p0, _ = _amp_loop("mkor", "scaled")
    m1, p1, _ = _amp_loop("mkor", "unscale_gs")
    assert all(torch.equal(a, b) for a, b in zip(m0.parameters(), m1.parameters()))
    assert equal_factors(factors_of(p0), factors_of(p1))
    with pytest.warns(RuntimeWarning, match="grad_scaler=scaler") as record:
        _, p2, _ = _amp_loop("mkor", "unscale")
    assert sum("grad_scaler=scaler" in str(w.message) for w in record) == 1
    assert not equal_factors(factors_of(p0), factors_of(p2))


