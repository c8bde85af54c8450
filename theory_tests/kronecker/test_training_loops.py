"""MKOR and K-FAC inside real training loops: torch lr schedulers, transformers.Trainer (with checkpoint resume and accumulation), PyTorch Lightning,
ResNet, bf16 autocast and checkpoints through torch.save / torch.load(weights_only=True).

Every model is a tiny transformers model built offline from a config (random weights,
dropout off, :mod:`hf_cases`). Where the claim is bit-identity the tests use
``torch.equal``. GradScaler: ``kronecker/test_grad_scaler.py``.
"""
import io
import warnings

import pytest
import torch
import torch.nn as nn

from torch_impl.mkor import MKOR

from theory_tests.support.hf_cases import (equal_factors, factors_of, image_batch, is_identity, lm_batch, snapshot,
                      tiny_bert, tiny_gpt2, tiny_resnet, wrap)


def _schedulers():
    from transformers import get_linear_schedule_with_warmup
    return {
        "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
        "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda t: 1.0 / (t + 1)),
        "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1,
                                                                  total_steps=6),
        "hf_linear": lambda o: get_linear_schedule_with_warmup(o, 2, 6),
    }


@pytest.mark.parametrize("name", ["step", "lambda", "onecycle", "hf_linear"])
def test_lr_scheduler_drives_backbone_lr(name):
    """A torch / transformers scheduler built on MKOR sets the *backbone's* lr at every step
    (the same schedule as on a plain SGD), raises no "lr_scheduler.step() before
    optimizer.step()" warning in the proper order, and does raise it in the wrong order
    (so the scheduler really tracks MKOR's step)."""
    make = _schedulers()[name]
    ref_opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)
    ref = make(ref_opt)
    model = tiny_gpt2(dtype=torch.float32, n_layer=1)
    mkor = wrap("mkor", model, lr=0.1)
    sched = make(mkor)
    seen, expected = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(5):
            model(**lm_batch(t, batch=2)).loss.backward()
            seen.append(mkor.optimizer.param_groups[0]["lr"])
            expected.append(ref_opt.param_groups[0]["lr"])
            mkor.step()
            mkor.zero_grad()
            sched.step()
            ref_opt.step()
            ref.step()
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert seen == expected and len(set(seen)) > 1
    assert mkor.steps == 5
    # the wrong order is detected through MKOR's step
    model = tiny_gpt2(dtype=torch.float32, n_layer=1)
    mkor = wrap("mkor", model, lr=0.1)
    sched = make(mkor)
    with pytest.warns(UserWarning, match=r"lr_scheduler.step\(\)"):
        sched.step()
        model(**lm_batch(0, batch=2)).loss.backward()
        mkor.step()


# -- 8. transformers.Trainer ----------------------------------------------------------------
class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n=24):
        self.items = [{k: v[0] for k, v in lm_batch(100 + i, batch=1).items()} for i in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _trainer(tmp_path, accum=1, batch=4, resume=None, **mkor_kwargs):
    from transformers import Trainer, TrainingArguments
    model = tiny_gpt2(dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mkor = MKOR(model, opt, inv_freq=1, **mkor_kwargs)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=6,
                             per_device_train_batch_size=batch,
                             gradient_accumulation_steps=accum, save_steps=3,
                             save_strategy="steps", report_to=[], use_cpu=True,
                             logging_steps=1, seed=0, learning_rate=0.05,
                             disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(),
                      optimizers=(mkor, None))
    trainer.train(resume_from_checkpoint=resume)
    return model, mkor


def test_trainer_trains_and_resumes_bitwise(tmp_path):
    """``Trainer(optimizers=(mkor, None))``: 6 steps are 6 MKOR steps with factors moved from
    the identity and the scheduler driving the backbone lr; resuming from checkpoint-3
    (fresh model + MKOR, optimizer.pt holding the "mkor" entries on the weights) ends bit-identical to the
    uninterrupted run."""
    model, mkor = _trainer(tmp_path / "full")
    assert mkor.steps == 6
    assert all(not is_identity(L) and not is_identity(R)
               for L, R in mkor.inverse_factors().values())
    assert mkor.optimizer.param_groups[0]["lr"] == 0.0  # the linear schedule reached 0
    ckpt = tmp_path / "full" / "checkpoint-3"
    saved = torch.load(ckpt / "optimizer.pt", weights_only=True)["state"]
    assert sum("mkor" in entry for entry in saved.values()) == len(mkor.inverse_factors())
    assert sum("mkor_run" in entry for entry in saved.values()) == 1
    model2, mkor2 = _trainer(tmp_path / "resumed", resume=str(ckpt))
    assert mkor2.steps == 6
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    assert equal_factors(factors_of(mkor), factors_of(mkor2))


def test_trainer_gradient_accumulation(tmp_path, capsys):
    """``gradient_accumulation_steps=2`` with batch 2: 6 optimizer steps are 6 MKOR steps
    (statistics accumulate over the two backward passes), and the result equals batch 4
    without accumulation to float32 rounding (Trainer normalises by the tokens of the
    whole step, so the loss is the same function; only summation order differs):
    1e-5 of the largest parameter change."""
    from theory_tests.support.hf_cases import update_rel_err
    model, mkor = _trainer(tmp_path / "acc", accum=2, batch=2)
    assert mkor.steps == 6
    full, _ = _trainer(tmp_path / "one", accum=1, batch=4)
    init = snapshot(tiny_gpt2(dtype=torch.float32))
    rel = update_rel_err(snapshot(model), snapshot(full), init)
    with capsys.disabled():
        print(f"\n[Trainer accumulation 2x2 vs 4] rel. error {rel:.2e}")
    assert rel < 1e-5


def test_trainer_feeds_mkor_h_from_model_output(tmp_path):
    """MKOR-H inside Trainer reads each step's loss from the model output's ``.loss``: no
    "got no loss" warning, and the rule saw all 6 losses (check_every=2)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, mkor = _trainer(tmp_path, hybrid_switch="loss_rate", switch_window=4,
                           switch_check_every=2)
    assert not [w for w in caught if "got no loss" in str(w.message)]
    assert mkor.switch_rule.t == 6


# -- 9. Lightning ----------------------------------------------------------------------------
@pytest.mark.parametrize("grad_hook", ["tensor", "module"])
def test_lightning_trains_mkor_with_scheduler(grad_hook):
    """A LightningModule whose configure_optimizers returns {"optimizer": mkor,
    "lr_scheduler": StepLR(mkor)} trains 4 steps: MKOR's steps advance to 4 (Lightning's
    closure runs inside MKOR.step, its zero_grad between forward and backward keeps the
    forward's statistics), the factors move, and the scheduler halved the lr 4 times."""
    pl = pytest.importorskip("pytorch_lightning")

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_gpt2(dtype=torch.float32, n_layer=1)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
            self.mkor = MKOR(self.model, opt, inv_freq=1, grad_hook=grad_hook)
            sched = torch.optim.lr_scheduler.StepLR(self.mkor, step_size=1, gamma=0.5)
            return {"optimizer": self.mkor,
                    "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    lit = Lit()
    loader = torch.utils.data.DataLoader(_Tokens(16), batch_size=4)
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(lit, loader)
    assert lit.mkor.steps == 4
    assert lit.mkor.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 4)
    assert all(not is_identity(L) and not is_identity(R)
               for L, R in lit.mkor.inverse_factors().values())


@pytest.mark.parametrize("grad_hook", ["tensor", "module"])
@pytest.mark.parametrize("kind", ["mkor", "kfac"])
def test_zero_grad_between_forward_and_backward_keeps_statistics(kind, grad_hook):
    """The Lightning order without Lightning: forward, ``zero_grad()``, backward, step. The
    forward's statistics belong to the coming step (nothing was accumulated before the
    zero_grad), so the factors equal those of the usual order (zero_grad after step):
    bit-identical parameters and factors after 2 steps."""
    runs = []
    for late_zero in (False, True):
        model = tiny_gpt2(dtype=torch.float32, n_layer=1)
        pre = wrap(kind, model, grad_hook=grad_hook)
        for t in range(2):
            loss = model(**lm_batch(t)).loss
            if late_zero:
                pre.zero_grad()
            loss.backward()
            pre.step()
            if not late_zero:
                pre.zero_grad()
        runs.append((model, pre))
    (m0, p0), (m1, p1) = runs
    assert not is_identity(next(iter(factors_of(p0).values()))[1])
    assert equal_factors(factors_of(p0), factors_of(p1))
    assert all(torch.equal(a, b) for a, b in zip(m0.parameters(), m1.parameters()))


def test_mkor_h_zero_grad_between_forward_and_backward_keeps_loss():
    """MKOR-H reads the model output's ``.loss`` also when ``zero_grad()`` runs between the
    forward and the backward (the PyTorch quick-start order): no "got no loss" warning, and
    the rule saw every step's loss (check_every=2, 4 steps)."""
    model = tiny_gpt2(dtype=torch.float32, n_layer=1)
    mkor = wrap("mkor", model, hybrid_switch="loss_rate", switch_window=2,
                 switch_check_every=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(4):
            loss = model(**lm_batch(t)).loss
            mkor.zero_grad()
            loss.backward()
            mkor.step()
    assert not [w for w in caught if "got no loss" in str(w.message)]
    assert mkor.switch_rule.t == 4


# -- 10. ResNet ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mkor", "kfac"])
def test_resnet_trains(kind):
    """transformers ResNetForImageClassification (tiny config, 32x32 inputs): every Conv2d
    (groups=1) and the classifier Linear are preconditioned, BatchNorms are skipped as
    normalisation layers, and 3 steps (K-FAC: default eigen method) run with finite
    parameters and factors moved."""
    model = tiny_resnet()
    pre = wrap(kind, model)
    convs = [n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert pre.preconditioned_modules == convs and "classifier.1" in convs
    bns = [n for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)]
    assert bns and all(pre.skip_reasons[n].startswith("normalisation") for n in bns)
    assert set(pre.skipped_modules) == set(bns)
    before = snapshot(model)
    for t in range(3):
        x, y = image_batch(t)
        model(pixel_values=x, labels=y).loss.backward()
        pre.step()
        pre.zero_grad()
    assert pre.steps == 3
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not torch.equal(before["classifier.1.weight"], model.classifier[1].weight)
    moved = [n for n, pair in factors_of(pre).items() if not is_identity(pair[0])]
    assert moved == convs


# -- 11. autocast ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mkor", "kfac"])
def test_bf16_autocast_statistics_are_float32(kind):
    """Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` on a tiny BERT the statistics
    are float32 (K-FAC ``factors()``, MKOR ``inverse_factors()``), and they are computed in
    float32 from the bf16 rows: the input statistic of a layer fed bf16 activations equals
    the float64 computation from those rows to 1e-5 (a bf16 product would be off by
    ~1e-2); the step works."""
    model = tiny_bert(dtype=torch.float32)
    pre = wrap(kind, model, lr=0.01)
    name = "bert.encoder.layer.0.output.dense"
    rows = []
    handle = model.get_submodule(name).register_forward_hook(
        lambda m, args, out: rows.append(args[0].detach()))
    batch = lm_batch(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**batch).loss
    loss.backward()
    handle.remove()
    x = rows[0].reshape(-1, rows[0].shape[-1]).double()
    assert rows[0].dtype == torch.bfloat16
    x1 = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)
    if kind == "mkor":
        a_bar = pre.pending_vectors()[name][0]
        assert a_bar.dtype == torch.float32
        expected = x1.mean(0)
        got = a_bar.double()
    pre.step()
    pre.zero_grad()
    if kind == "kfac":
        A, G = pre.factors()[name]
        expected = x1.T @ x1 / x.shape[0]
        got = A.double()
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    dtypes = {t.dtype for pair in factors_of(pre).values() for t in pair if t is not None}
    assert dtypes == {torch.float32}
    assert all(torch.isfinite(p).all() for p in model.parameters())


# -- 12. checkpoints -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mkor", "kfac"])
def test_checkpoint_round_trip_through_torch_save(kind):
    """``torch.save(pre.state_dict())`` + ``torch.load(weights_only=True)`` into a fresh model
    and preconditioner continues bit-identically (parameters and factors after 2 more
    steps)."""
    def steps(model, pre, ts):
        for t in ts:
            model(**lm_batch(t)).loss.backward()
            pre.step()
            pre.zero_grad()

    model = tiny_gpt2(dtype=torch.float32)
    pre = wrap(kind, model, **({"inv_freq": 2} if kind == "kfac" else {}))
    steps(model, pre, range(3))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": pre.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model2 = tiny_gpt2(seed=1, dtype=torch.float32)
    pre2 = wrap(kind, model2, **({"inv_freq": 2} if kind == "kfac" else {}))
    model2.load_state_dict(saved["model"])
    pre2.load_state_dict(saved["opt"])
    steps(model, pre, range(3, 5))
    steps(model2, pre2, range(3, 5))
    assert pre2.steps == pre.steps == 5
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    assert equal_factors(factors_of(pre), factors_of(pre2))
