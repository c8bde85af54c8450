"""MKOR-H (K18, KT14): the loss-rate switch and the hand-over to the backbone."""
import copy
import io
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as Fn

from torch_impl.mkor import LossRateSwitch, MKOR


def test_switch_fires_exactly_once_at_the_predicted_step():
    """Synthetic curve: loss 1/(1+t) for t < 60, then flat. W=10, checks every 5 steps,
    tau=1e-3, patience 2. Rates while decreasing are >= 1e-3; once both windows lie on
    the plateau (t >= 79) r_t = 0. Checks at n = 80 (t=79) and n = 85 (t=84) are the
    first two slow ones, so the switch fires at t = 84, once."""
    rule = LossRateSwitch(window=10, check_every=5, threshold=1e-3, patience=2)
    history = []
    for t in range(200):
        loss = 1.0 / (1 + min(t, 60))
        history.append(rule.observe(loss))
    assert rule.switched_at == 84
    assert history.index(True) == 84 and all(history[84:]) and not any(history[:84])
    slow = [t for t, r in rule.rates if not r >= 1e-3]
    assert slow[:2] == [79, 84]
    # r_t is (mean of older window - mean of newer) / (W |mean older|).
    t, r = rule.rates[0]
    older = [1 / (1 + min(s, 60)) for s in range(t - 19, t - 9)]
    newer = [1 / (1 + min(s, 60)) for s in range(t - 9, t + 1)]
    expected = (sum(older) / 10 - sum(newer) / 10) / (10 * abs(sum(older) / 10))
    assert math.isclose(r, expected, rel_tol=1e-12)


def test_switch_step_and_nan_losses():
    rule = LossRateSwitch(window=3, check_every=1, threshold=None, patience=1, switch_step=7)
    assert [rule.observe(1.0) for _ in range(9)] == [False] * 7 + [True] * 2
    assert rule.switched_at == 7
    rule = LossRateSwitch(window=2, check_every=1, threshold=-1.0, patience=1)
    assert [rule.observe(x) for x in (1.0, 1.0, 1.0, float("nan"))] == [False] * 3 + [True]


def _setup(seed=0, **kwargs):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt, MKOR(model, opt, inv_freq=2, **kwargs)


def _batch(t):
    g = torch.Generator().manual_seed(t)
    x = torch.randn(16, 4, generator=g)
    return x, x[:, :1] * 2 - x[:, 1:2]


def _loss(model, t):
    x, y = _batch(t)
    return Fn.mse_loss(model(x), y)


@pytest.mark.parametrize("how", ["switch_step", "loss_rate"])
def test_after_the_switch_steps_are_the_backbone_bit_for_bit(how):
    """KT14: once switched, MKOR-H's steps equal the backbone alone started from the
    same parameters and optimizer state, bit for bit; hooks are gone, factors freed."""
    if how == "switch_step":
        model, opt, mkor = _setup(switch_step=6)
    else:  # a rule that is certain to fire at t = 5 (every rate is < 10)
        model, opt, mkor = _setup(hybrid_switch="loss_rate", switch_window=2,
                                  switch_check_every=1, switch_threshold=10.0,
                                  switch_patience=3)
    switched_at = None
    for t in range(6):
        loss = _loss(model, t)
        loss.backward()
        if how == "loss_rate":
            mkor.observe_loss(loss.item())
        if mkor.switched and switched_at is None:
            switched_at = t
        mkor.step()
        opt.zero_grad()
    if how == "switch_step":
        _loss(model, 6).backward()
        mkor.step()   # t = 6: the switch happens here, this step is already plain SGD
        opt.zero_grad()
    else:
        assert switched_at == 5 and mkor.switch_rule.switched_at == 5
    assert mkor.switched and not mkor.hooks_registered
    assert mkor.inverse_factors() == {} and mkor.counters() == {}
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for t in range(10, 20):
        _loss(model, t).backward()
        if how == "loss_rate":
            assert mkor.observe_loss(1.0)  # stays switched, no effect
        mkor.step()
        opt.zero_grad()
        _loss(twin, t).backward()
        twin_opt.step()
        twin_opt.zero_grad()
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q)


def test_switch_happens_once_and_survives_a_checkpoint():
    """The switched state round-trips through state_dict: a fresh MKOR loaded from it
    removes its hooks, frees its factors and then matches the original bit for bit."""
    model, opt, mkor = _setup(switch_step=4)
    for t in range(8):
        _loss(model, t).backward()
        mkor.step()
        opt.zero_grad()
    assert mkor.switched and mkor.steps == 4 and mkor.switch_rule.switched_at == 4
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "mkor": mkor.state_dict()},
               buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    model2, opt2, mkor2 = _setup(seed=7, switch_step=4)
    assert mkor2.hooks_registered
    model2.load_state_dict(saved["model"])
    mkor2.load_state_dict(saved["mkor"])
    assert mkor2.switched and not mkor2.hooks_registered and mkor2.inverse_factors() == {}
    for t in range(8, 14):
        for m, o, k in ((model, opt, mkor), (model2, opt2, mkor2)):
            _loss(m, t).backward()
            k.step()
            o.zero_grad()
        for p, q in zip(model.parameters(), model2.parameters()):
            assert torch.equal(p, q)


def test_closure_feeds_the_loss_rate_rule():
    """step(closure) reads the closure's loss for the rule (the documented sync)."""
    model, opt, mkor = _setup(hybrid_switch="loss_rate", switch_window=1,
                              switch_check_every=1, switch_threshold=10.0,
                              switch_patience=1)

    def closure():
        opt.zero_grad()
        loss = _loss(model, 0)
        loss.backward()
        return loss

    mkor.step(closure)
    assert not mkor.switched
    mkor.step(closure)   # n = 2 = 2W: the first check is slow (rate < 10): switch
    assert mkor.switched and mkor.switch_rule.switched_at == 1


class _DictModel(nn.Module):
    """Returns {"loss": ...} like a transformers model given labels."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x, y):
        return {"loss": Fn.mse_loss(self.net(x), y)}


def _run_switch(how):
    """60 steps of MKOR-H on _DictModel, the loss passed ``how``; returns the switch step,
    the rates, the parameters and how many times a tensor was read (Tensor.tolist)."""
    reads = {"n": 0}
    real_tolist = torch.Tensor.tolist

    def counting_tolist(self):
        reads["n"] += 1
        return real_tolist(self)

    torch.manual_seed(0)
    model = _DictModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # self_check=None: the reads counted here are the loss buffer's alone (the self-check
    # makes its own documented read on its check steps)
    mkor = MKOR(model, opt, inv_freq=2, hybrid_switch="loss_rate", switch_window=5,
                switch_check_every=5, switch_threshold=0.05, switch_patience=2,
                self_check=None)
    torch.Tensor.tolist = counting_tolist
    try:
        for t in range(60):
            x, y = _batch(t)
            if how == "closure":
                def closure():
                    mkor.zero_grad()
                    out = model(x, y)["loss"]
                    out.backward()
                    return out
                mkor.step(closure)
                continue
            loss = model(x, y)["loss"]
            loss.backward()
            if how == "observe_loss":
                mkor.observe_loss(loss.item())
                mkor.step()
            elif how == "step_loss":  # a tensor, buffered: read once per switch check
                mkor.observe_loss(loss)
                mkor.step()
            else:
                mkor.step()
            mkor.zero_grad()
    finally:
        torch.Tensor.tolist = real_tolist
    rule = mkor.switch_rule
    return rule.switched_at, list(rule.rates), [p.detach() for p in model.parameters()], reads["n"]


@pytest.mark.parametrize("how", ["step_loss", "closure", "model_output"])
def test_every_way_of_passing_the_loss_gives_the_same_switch(how):
    """The rule sees the same losses whether they come as floats to observe_loss, as
    tensors to observe_loss, from a closure, or from the model output's "loss"; tensors
    are read once per check (switch_check_every steps), not once per step."""
    at, rates, params, reads = _run_switch(how)
    ref_at, ref_rates, ref_params, _ = _run_switch("observe_loss")
    assert at is not None and at == ref_at and rates == ref_rates
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params))
    assert reads == len(rates) + 1  # one read per check (the first at n = 5 has no rate)


def test_a_loss_rate_switch_without_losses_warns_once():
    model, opt, mkor = _setup(hybrid_switch="loss_rate")
    with pytest.warns(UserWarning, match="got no loss") as record:
        for t in range(3):
            _loss(model, t).backward()
            mkor.step()
            mkor.zero_grad()
    assert sum("got no loss" in str(w.message) for w in record) == 1
