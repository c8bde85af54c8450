"""The peers' compiled steps round by the same law as their eager ones (slow: compilation).

``theory_tests/peers/test_peer_rounding_law.py`` runs torchao's ``_AdamW`` and HeavyBall's
``AdamW`` eager, for speed; users run them compiled (torchao always compiles its step;
HeavyBall compiles its fused functions unless ``heavyball.utils.compile_mode`` is None), where
inductor generates the rounding kernel and draws its own random bits.  Here the same one-step
experiment runs compiled: the verdicts must be the eager ones, and the parameter's law the
same as the eager one's, column by column (``rounding_law.same_law``).
"""
import pytest
import torch

from theory_tests.support.heavyball_conventions import load_heavyball
from theory_tests.support.peer_rounding import heavyball_adapter, one_step, torchao_adapter
from theory_tests.support.rounding_law import Z, same_law

pytestmark = pytest.mark.slow


def _verdicts(laws):
    return {k: law.verdict for k, law in laws.items()}


def test_torchaos_compiled_step_rounds_as_its_eager_one():
    compiled, eager = one_step(torchao_adapter(compiled=True)), one_step(torchao_adapter())
    assert _verdicts(compiled) == _verdicts(eager) == dict(
        exp_avg="nearest", exp_avg_sq="nearest", param="stochastic")
    assert same_law(compiled["param"], eager["param"]) <= Z


def test_heavyballs_compiled_functions_round_as_its_eager_ones(monkeypatch):
    heavyball = load_heavyball()
    compiled = one_step(heavyball_adapter(heavyball))  # its default compile_mode
    monkeypatch.setattr(heavyball.utils, "compile_mode", None)
    eager = one_step(heavyball_adapter(heavyball))
    assert _verdicts(compiled) == _verdicts(eager) == dict(
        exp_avg="stochastic", exp_avg_sq="stochastic", param="stochastic")
    for name in compiled:
        assert same_law(compiled[name], eager[name]) <= Z
