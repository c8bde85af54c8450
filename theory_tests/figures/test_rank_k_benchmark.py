"""The rank-k benchmark script runs (tiny width, one repeat), so it cannot rot; timings are
never asserted (``test_benchmark_scripts.py``'s rule)."""
import json

from figures.bench import rank_k as bench_rank_k


def test_rank_k_benchmark_reports_a_ratio_per_rank(capsys):
    bench_rank_k.main(["--d", "16", "--ranks", "1", "3", "--repeats", "1"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["ratios"]) == {"1", "3"}
    assert set(report["seconds"]) == {"rank1", "rank 1", "rank 3"}
