"""The rank-k benchmark script runs (tiny width, one repeat), so it cannot rot; timings are
never asserted (``test_benchmark_scripts.py``'s rule)."""
import json

from figures.bench import rank_k as bench_rank_k


def test_rank_k_benchmark_reports_a_ratio_per_rank(capsys):
    bench_rank_k.main(["--d", "16", "--ranks", "1", "3", "--repeats", "1"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["ratios"]) == {"1", "3"}
    assert set(report["seconds"]) == {"rank1", "rank 1", "rank 3"}


def test_figures_bench_only_rank_k_reaches_the_rank_k_table(monkeypatch, capsys):
    """``python -m figures.bench --only rank_k`` runs the rank-k script and puts its ratios in
    the report (tiny: the width and ranks shrunk through the script's defaults)."""
    from figures.bench import optimizer_step as bench
    main = bench_rank_k.main
    monkeypatch.setattr(bench_rank_k, "main", lambda argv: main(
        list(argv) + ["--d", "16", "--ranks", "1", "2"]))
    bench.main(["--only", "rank_k", "--repeats", "1"])
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert set(report["rank_k_over_rank_1"]["ratios"]) == {"1", "2"}  # JSON keys
    assert "MKOR rank-k factor update over rank 1" in out
