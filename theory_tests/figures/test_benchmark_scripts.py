"""The benchmark scripts run (tiny sizes), so they cannot rot between releases.  Timings are
never asserted here: benchmarks are scripts, and these machines are too noisy for timed tests."""
import json

import pytest
import torch

from figures.bench import optimizer_step as bench
from figures.bench import capture_cost as bench_capture_cost
from figures.bench import self_check_cost as bench_self_check_cost
from figures.bench import factor_update as bench_factor_update
from figures.bench import moe_mars_m as bench_moe_mars_m


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """The suite's one thread, whatever a script asks for (capture_cost, self_check_cost and
    kfac_flavours ask for the 2 their tables are measured with): no timing is asserted here,
    and two threads on the busy 2-core machine cost ~3x the CPU time (OpenMP workers spin;
    measured on self_check_cost)."""
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)


def test_factor_update_benchmark_runs_and_reports_slopes(capsys):
    bench_factor_update.main(["--sizes", "32", "64", "--repeats", "1"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["slopes"]) == {"mkor_paper", "mkor_released", "kfac_inverse", "kfac_eigh"}


def test_memory_benchmark_counts_three_buffers_for_mars_two_for_adamw():
    report = bench.bench_memory(torch.device("cpu"))
    # fp32: AdamW keeps m, v (8 B/param); MARS-AdamW adds g_prev on matrices (< 12 B/param
    # overall, since 1-D tensors take the AdamW fallback without g_prev)
    assert report["AdamW loop"]["state_bytes_per_param"] == 8.0
    assert 8.0 < report["MARS-AdamW loop"]["state_bytes_per_param"] <= 12.0
    # one denominator at a time, plus 0-d scalars (the clip norm and its clamp): a few bytes
    # over the largest parameter (1.6 MB here), i.e. below 1 + 1e-4
    assert report["MARS-AdamW loop"]["peak_temporary_over_largest_param"] <= 1.0 + 1e-4


def test_transformers_benchmark_runs_on_tiny_models():
    from figures.bench import hf as bench_hf
    results = bench_hf.bench_models(
        1, torch.device("cpu"), bench.interleaved,
        gpt=lambda: bench_hf.gpt2_like(width=16, layers=1, heads=2, vocab=64, context=8),
        resnet=lambda: bench_hf.resnet_like(widths=(4, 8), depths=(1, 1)),
        gpt_batches=(2,), resnet_batches=(2,), context=8, image=16)
    assert set(results) == {"GPT-2-like", "ResNet-like"}
    for by_batch in results.values():
        assert set(by_batch[2]) == {"backbone", "MKOR", "KFAC"}
    assert "| GPT-2-like | 2 |" in bench_hf.table(results)


@pytest.mark.slow
def test_mars_m_benchmark_runs_on_a_tiny_list():
    """The whole MARS-M table at a tiny size (slow: it compiles Muon's and MARS-M's steps)."""
    times, ratios, compile_s = bench.bench_mars_m(1, torch.device("cpu"), vocab=16, d=8,
                                                  layers=1, ctx=8)
    assert set(ratios) == {"eager: best MARS-M eager / Muon eager",
                           "compiled: MARS-M compiled / Muon compiled"}
    assert all(t > 0 for t in times.values()) and set(compile_s) == {
        "Muon (torch) compiled", "MARS-M compiled"}


def test_mars_m_benchmark_eager_float32_on_a_tiny_list():
    """The eager half of the MARS-M table with both Newton-Schulz iterations in float32
    (torch's Muon via the figures' Float32Muon), as it runs on a CPU without bf16 units."""
    times, ratios, compile_s = bench.bench_mars_m(1, torch.device("cpu"), torch.float32,
                                                  False, vocab=16, d=8, layers=1, ctx=8)
    assert set(ratios) == {"eager: best MARS-M eager / Muon eager"} and compile_s == {}
    assert set(times) == {"Muon (torch) eager", "MARS-M loop", "MARS-M foreach"}
    assert all(t > 0 for t in times.values())


def test_capture_cost_benchmark_times_every_contender():
    """Every (model, mask, optimizer, self_check) contender ran and was timed."""
    times = bench_capture_cost.main(["--repeats", "1", "--steps", "1", "--mlp-width", "32"])
    assert len(times) == 12 and all(len(ts) == 1 and ts[0] > 0 for ts in times.values())


def test_moe_mars_m_benchmark_times_stacked_and_separate_experts(capsys):
    """Every optimizer timed on the stacks and on the separate matrices (tiny sizes)."""
    report = bench_moe_mars_m.main(["--experts", "2", "--rows", "3", "--cols", "5",
                                    "--repeats", "1"])
    assert set(report["stacked_over_separate"]) == set(bench_moe_mars_m.OPTIMIZERS)
    assert len(report["step_seconds"]) == 2 * len(bench_moe_mars_m.OPTIMIZERS)
    assert all(t > 0 for t in report["step_seconds"].values())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report


def test_orthogonalisers_benchmark_eager_tables_on_tiny_matrices():
    """Every option timed in the MARS-M, MARS-Shampoo and Newton-Schulz-alone tables (eager,
    width 8, one block), with each option's flops and a finite distance to U V^T."""
    from figures.bench import orthogonalisers as bench_orth
    report = bench_orth.main(["--repeats", "1", "--width", "8", "--layers", "1",
                              "--no-compile"])
    labels = [label for label, _, _ in bench_orth.OPTIONS]
    assert set(report["mars_m_ratios"]) == set(labels)
    assert {f"MARS-Shampoo {label}" for label in labels} <= set(report["shampoo_step_seconds"])
    assert len(report["ns_seconds"]) == 1 + 2 * len(labels)
    assert all(t > 0 for t in report["ns_seconds"].values())
    # the Gram form pays on the rectangular matrices (aspect 3 and 4): fewer flops
    details = report["ns_details"]
    assert (details["MARS-M authors Gram, per matrix"]["gflop"]
            < details["MARS-M authors NS, per matrix"]["gflop"])
    assert all(0 <= d["polar_distance"] < 1 for d in details.values())
    assert "| MARS-M polar_express Gram eager |" in bench_orth.tables(report)


def test_figures_bench_only_orthogonalisers_runs_the_orthogonalisers_tables(monkeypatch, capsys):
    """``python -m figures.bench --only orthogonalisers`` reaches the same tables (tiny: the
    list shrunk through the module's defaults)."""
    from figures.bench import orthogonalisers as bench_orth
    run = bench_orth.run
    monkeypatch.setattr(bench_orth, "run", lambda repeats, device, compiled=True: run(
        repeats, device, width=8, layers=1, compiled=compiled))
    bench.main(["--only", "orthogonalisers", "--repeats", "1", "--no-compile"])
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert set(report) == {"device", "threads", "torch", "repeats", "orthogonalisers"}
    assert "MARS-M options vs torch Muon" in out and "Newton-Schulz alone" in out


def test_self_check_cost_benchmark_times_every_contender():
    times = bench_self_check_cost.main(["--repeats", "1", "--steps", "1"])
    assert {c for _, c in times} == {"SGD", "MKOR self_check=None", "MKOR default"}
    assert {m for m, _ in times} == {"bert", "llama", "mixtral"}
    assert all(len(ts) == 1 and ts[0] > 0 for ts in times.values())


def test_kfac_flavours_benchmark_times_every_flavour(capsys):
    """The MC / type-2 K-FAC step over the empirical one, measured in the same run."""
    from figures.bench import kfac_flavours as bench_kfac_flavours
    ratios = bench_kfac_flavours.main(["--repeats", "1", "--steps", "1", "--vocab", "8",
                                       "--hidden", "8", "--layers", "1", "--batch", "2",
                                       "--seq", "4"])
    assert set(ratios) == set(bench_kfac_flavours.CONTENDERS) and ratios["empirical"] == 1.0
    assert "| type-2 |" in capsys.readouterr().out
