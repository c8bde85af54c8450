"""Every layer accounted for, every statistic a factor uses verified (issue 45, items 1-2).

* A layer is preconditioned only once its factors have taken a statistic; until then its
  gradient reaches the backbone unchanged (bit for bit, under MKOR and K-FAC, whose KL clip
  it takes no part in) and it is listed with the reason.
* A zero gradient proves nothing: "not yet checked", never "pass" (peft LoRA on fused
  experts, whose A has a zero gradient while B = 0).
* Every capture step whose statistics enter a factor is checked, so rows that drift after
  the first check (a learned scale on the layer's output) or a second use of the weight on
  some capture steps only are caught on the first step they are wrong, and that step's
  statistics never reach the factors.
* ``preconditioned_modules``, ``skip_reasons`` and ``capture_report`` agree at every step.
"""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_impl import KFAC, MKOR

f64 = torch.float64


def _agree(pre):
    """The three views of what is preconditioned are one."""
    report = pre.capture_report()
    listed = [n for n in report if report[n]["preconditioned"]]
    assert pre.preconditioned_modules == listed
    for name in report:
        assert (name in pre.skip_reasons) == (not report[name]["preconditioned"]), name
        if not report[name]["preconditioned"]:
            assert report[name]["reason"], name


def _make(kind, model, **kw):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    if kind is MKOR:
        kw.setdefault("factor_dtype", "float64")
    return kind(model, opt, inv_freq=1, **kw)


class _LateHead(nn.Module):
    """A body used on every step and a head first used at step ``start``."""

    def __init__(self, start):
        super().__init__()
        self.body, self.head = nn.Linear(4, 3), nn.Linear(3, 2)
        self.start, self.t = start, 0

    def forward(self, x):
        h = torch.tanh(self.body(x))
        out = h.sum(-1, keepdim=True)
        if self.t >= self.start:
            out = out + self.head(h).sum(-1, keepdim=True)
        return out


@pytest.mark.parametrize("kind", [MKOR, KFAC])
def test_factors_that_never_took_a_statistic_leave_the_gradient_unchanged(kind):
    """K-FAC captures on steps 0, 2, 4 (factor_freq=2): a head first used at step 1 has a
    gradient at step 1 but factors that never took a statistic. It reaches the backbone bit
    for bit (before: K-FAC's initial factors and the KL clip scaled it), is listed "never
    captured" at steps 0 and 1, and is preconditioned from step 2 on."""
    torch.manual_seed(0)
    model = _LateHead(start=1).double()
    kw = {"factor_freq": 2, "kl_clip": 1e-6} if kind is KFAC else {}
    pre = _make(kind, model, **kw)
    if kind is MKOR:  # MKOR captures on every inv_freq-th step: use 2 as K-FAC does; its
        # identity factors alone would give back G, but not through bf16 GEMMs
        pre = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.05), inv_freq=2,
                   factor_dtype="float64", precondition_dtype="bfloat16")
    _agree(pre)
    assert pre.preconditioned_modules == ["body", "head"]  # nothing captured yet
    for t in range(4):
        model.t = t
        model(torch.randn(6, 4, dtype=f64)).square().sum().backward()
        raw = model.head.weight.grad.clone() if model.head.weight.grad is not None else None
        body_raw = model.body.weight.grad.clone()
        pre.precondition()
        _agree(pre)
        if t < 2:
            assert "never captured" in pre.skip_reasons["head"]
            assert "head" not in pre.preconditioned_modules
            if raw is not None:
                assert torch.equal(model.head.weight.grad, raw)
        else:
            assert "head" in pre.preconditioned_modules
            assert not torch.equal(model.head.weight.grad, raw)
        assert not torch.equal(model.body.weight.grad, body_raw)  # the body is preconditioned
        pre.optimizer.step()
        pre.zero_grad()


def _lora_experts(kind):
    from peft import LoraConfig, get_peft_model

    from theory_tests.support.composition_moe import tiny_mixtral
    torch.manual_seed(0)
    model = tiny_mixtral(dtype=f64, n_layer=1)
    config = LoraConfig(r=2, target_modules=[], target_parameters=["mlp.experts.down_proj"])
    peft_model = get_peft_model(model, config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pre = _make(kind, peft_model)
    return peft_model, pre


@pytest.mark.parametrize("kind", [MKOR, KFAC])
def test_lora_on_fused_experts_zero_gradient_is_not_a_pass(kind):
    """peft LoRA on a fused experts parameter (``target_parameters``; B = 0 at init, so the
    gradient of A is exactly 0 at step 0): A is "not yet checked", listed with the reason,
    never "pass", and its update is its raw gradient. At step 1 its gradient is nonzero and
    the check runs: A's weight enters through a product no hook sees (peft adds B A to the
    experts' weight), so it is released then, never preconditioned."""
    model, pre = _lora_experts(kind)
    a_name = next(n for n in pre.preconditioned_modules if n.endswith("lora_A.default"))
    a = model.get_submodule(a_name)
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1))
    for t in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        raw = a.weight.grad.clone()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            pre.precondition()
        _agree(pre)
        verdict = pre.capture_report()[a_name]["self_check"]
        assert a_name not in pre.preconditioned_modules
        assert torch.equal(a.weight.grad, raw)
        if t == 0:
            assert raw.abs().max() == 0
            assert verdict["weight"] == "not yet checked: gradient zero"
            assert "exactly 0" in pre.skip_reasons[a_name]
        else:
            assert raw.abs().max() > 0
            assert verdict["weight"] == "fail" and "self-check" in pre.skip_reasons[a_name]
        pre.optimizer.step()
        pre.zero_grad()


class _ScaledOutput(nn.Module):
    """A Linear whose output a forward hook (registered before the preconditioner's) scales
    by a learned gain that starts at 1: its rows are right at step 0 and drift as the gain
    is learned -- the shape of transformers' ``DoryLMHead`` with a plain ``nn.Linear``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.gain = nn.Parameter(torch.ones(3))
        self.lin.register_forward_hook(lambda m, args, out: out * self.gain)

    def forward(self, x):
        return self.lin(x)


@pytest.mark.parametrize("kind", [MKOR, KFAC])
def test_rows_that_drift_after_the_first_check_are_caught_before_a_factor_takes_them(kind):
    torch.manual_seed(0)
    model = _ScaledOutput().double()
    pre = _make(kind, model)
    target = torch.randn(8, 3, dtype=f64)
    released_at = None
    for t in range(12):
        with torch.no_grad():  # the gain drifts from 1 (as a learned logit scale does)
            model.gain.add_(0.05)
        before = {k: v.clone() for k, v in pre.preconditioner_state_dict()["layers"]["lin"]
                  .items() if isinstance(v, torch.Tensor)}
        (model(torch.randn(8, 4, dtype=f64)) - target).square().sum().backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pre.step()
        pre.zero_grad()
        _agree(pre)
        if "lin" in pre._capture.check.released:
            released_at = t
            assert any("self-check" in str(w.message) for w in caught)
            after = pre.preconditioner_state_dict()["layers"]["lin"]
            for key, value in before.items():  # the failing step's statistics: refused
                if key != "no_rows":  # (counted there, as a layer without statistics)
                    assert torch.equal(after[key], value), key
            break
    assert released_at == 0  # the gain is 1.05 already at the first capture
    assert "lin" not in pre.preconditioned_modules


@pytest.mark.parametrize("kind", [MKOR, KFAC])
def test_a_second_use_on_alternate_capture_steps_is_caught_at_its_first(kind):
    """A functional second use of the weight on odd steps only (every step captures): the
    every-k-th schedule checked steps 0, 10, 20, ... and never saw it; now step 1 releases
    the layer and its statistics of step 1 never reach the factors."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    pre = _make(kind, model)
    for t in range(4):
        x = torch.randn(8, 4, dtype=f64)
        out = model(x).square().sum()
        if t % 2 == 1:
            out = out + F.linear(x, model[0].weight).square().sum()
        out.backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            pre.step()
        pre.zero_grad()
        _agree(pre)
        assert ("0" in pre.preconditioned_modules) == (t == 0), t
        if t == 1:
            verdict = pre.capture_report()["0"]["self_check"]
            assert verdict["weight"] == "fail" and verdict["step_check"] == 2


@pytest.mark.parametrize("kind", [MKOR, KFAC])
def test_a_loaded_checkpoint_accounts_for_the_same_layers(kind):
    """The list is rebuilt from the loaded factors' counters: a layer whose factors took a
    statistic is preconditioned right after the load, one that never did still waits."""
    torch.manual_seed(0)
    kw = {"factor_freq": 2} if kind is KFAC else {}
    model = _LateHead(start=3).double()
    pre = (KFAC(model, torch.optim.SGD(model.parameters(), lr=0.05), inv_freq=2, **kw)
           if kind is KFAC else MKOR(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                     inv_freq=2, factor_dtype="float64"))
    for t in range(5):
        model.t = t
        model(torch.randn(6, 4, dtype=f64)).square().sum().backward()
        pre.step()
        pre.zero_grad()
        if t in (2, 4):  # the head waits at step 2, and is preconditioned from step 4
            fresh_model = _LateHead(start=3).double()
            fresh = (KFAC(fresh_model, torch.optim.SGD(fresh_model.parameters(), lr=0.05),
                          inv_freq=2, **kw) if kind is KFAC else
                     MKOR(fresh_model, torch.optim.SGD(fresh_model.parameters(), lr=0.05),
                          inv_freq=2, factor_dtype="float64"))
            fresh.load_state_dict(pre.state_dict())
            assert fresh.preconditioned_modules == pre.preconditioned_modules
            assert ("head" in fresh.preconditioned_modules) == (t == 4)
            _agree(fresh)
