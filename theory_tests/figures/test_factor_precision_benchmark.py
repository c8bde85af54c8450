"""The factor-precision benchmark (LP5's table) runs (tiny width, a few updates), so it cannot
rot; its numbers are asserted by ``theory_tests/low_precision/test_factor_precision.py``."""
import json

from figures.bench import factor_precision as bench_factor_precision


def test_factor_precision_benchmark_reports_every_stream_width_and_mode(capsys):
    bench_factor_precision.main(["--dims", "6", "--steps", "16", "--streams", "gradients",
                                 "mlp-a"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["results"]) == {"gradients", "mlp-a"}
    for by_d in report["results"].values():
        assert set(by_d["6"]) == {"float32", "bf16-nearest", "bf16-stochastic"}


def test_figures_bench_only_factor_precision_reaches_the_table(monkeypatch, capsys):
    """``python -m figures.bench --only factor_precision`` runs the script and puts its
    summaries in the report (tiny: the width and steps shrunk through its arguments)."""
    from figures.bench import optimizer_step as bench
    main = bench_factor_precision.main
    monkeypatch.setattr(bench_factor_precision, "main", lambda argv: main(
        list(argv) + ["--dims", "5", "--steps", "12", "--streams", "activations"]))
    bench.main(["--only", "factor_precision", "--repeats", "1"])
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert set(report["factor_precision"]["activations"]["5"]) == {
        "float32", "bf16-nearest", "bf16-stochastic"}
    assert "against the float64 oracle" in out
