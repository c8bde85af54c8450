"""Float64 models whose experts forwards compute in float32 stay preconditioned (issue 45):
the self-check compares each stack's weight gradient with the sum of g a^T over its
recomputed rows, so rows recomputed in another dtype than the forward's release the stack.

The privacy filter's own forward multiplies float32 rows and sums them in float32, Inkling2's
sums in float32 (and gates in float32); NemotronH's runs in float64 throughout. Rows in the
model's float64 were 932 to 5.2e5 times the self-check's rounding bound off for the first two
(both stacks released by the third step); with the forward's arithmetic every stack passes."""
import pytest
import torch

pytest.importorskip("transformers")

from theory_tests.support.moe_models import experts_of, loss_of, tiny_moe  # noqa: E402
from torch_impl import KFAC, MKOR  # noqa: E402

STEPS = 3


def _preconditioner(kind, model):
    sgd = torch.optim.SGD(model.parameters(), lr=1e-2)
    if kind == "MKOR":
        return MKOR(model, sgd, inv_freq=1, self_check=1)
    return KFAC(model, sgd, inv_freq=1, self_check=1, damping=1e-2)


@pytest.mark.parametrize("kind", ["MKOR", "KFAC"])
@pytest.mark.parametrize("family", ["openai_privacy_filter", "inkling2", "nemotron_h"])
def test_float64_models_keep_their_expert_stacks(family, kind):
    """3 steps (float64, the class's own forward, self-check on every capture): every expert
    stack is preconditioned and passes the weight check on every step, its ratio below 1."""
    model = tiny_moe(family, "eager", torch.float64)
    pre = _preconditioner(kind, model)
    stacks = [f"{name}.{p}" for name, m in experts_of(model)
              for p in ("gate_up_proj" if m.has_gate else "up_proj", "down_proj")]
    worst = 0.0
    for t in range(STEPS):
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(t))
        loss_of(model, ids).backward()
        pre.step()
        pre.zero_grad()
        report = pre.capture_report()
        for name in stacks:
            row = report[name]
            assert row["preconditioned"], (t, name, row["reason"])
            assert row["self_check"]["weight"] == "pass", (t, name, row["self_check"])
            worst = max(worst, float(row["self_check"]["ratio"]))
    print(f"[{family} {kind}] largest self-check ratio {worst:.3g}")
    assert worst < 1
