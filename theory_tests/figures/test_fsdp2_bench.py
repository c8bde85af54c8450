"""figures/bench/fsdp2.py: on 2 gloo ranks at tiny sizes, the bytes counted from the
collectives MKOR, K-FAC, FSDP2 and DDP issue equal the script's formulas and closed forms
written out here, so neither the counting nor the formulas can drift."""
import argparse

from figures.bench import fsdp2 as bench

WIDTH, LAYERS, WORLD = 8, 2, 2
G = WIDTH * (WIDTH + 1) * 4  # one layer's weight + bias bytes (float32), 288


def test_fsdp2_bench_counts_equal_formulas_on_two_ranks():
    args = argparse.Namespace(worlds=[WORLD], width=WIDTH, layers=LAYERS, batch=4, steps=1)
    results = bench.measure(WORLD, args)
    w = bench.widths(args)
    stats = {"MKOR": LAYERS * (WIDTH + WIDTH + 1) * 4,                   # sum (d_in' + d_out)
             "K-FAC": LAYERS * (WIDTH ** 2 + (WIDTH + 1) ** 2) * 4}      # sum (d_in'^2 + d_out^2)
    for rank, rows in enumerate(results):
        for row in rows:
            opt, placement = row["optimizer"], row["placement"]
            for parallel in ("fsdp2", "ddp"):
                r = row[parallel]
                assert r["unknown"] == [], r["unknown"]
                formula = bench.formulas(w, WORLD, opt, placement, parallel, r["owned"])
                for kind in bench.KINDS:
                    if kind != "other":
                        assert r["bytes"][kind] == formula[kind], (opt, placement, parallel, kind)
                assert r["bytes"]["stats_all_reduce"] == [stats[opt]] * 2
                assert r["payload_bytes"] == stats[opt]
            f = row["fsdp2"]["bytes"]
            assert f["fsdp_all_gather"] == [2 * LAYERS * G // 2] * 2   # forward + backward
            assert f["fsdp_reduce_scatter"] == [LAYERS * G // 2] * 2
            assert row["ddp"]["bytes"]["ddp_all_reduce"] == [LAYERS * G] * 2
            if placement == "replicated":
                assert f["precond_gather"] == [LAYERS * G // 2] * 2
                assert f["precond_scatter"] == [0, 0]
                assert row["fsdp2"]["factor_bytes"] == row["ddp"]["factor_bytes"]
                # L^-1 (d_out^2) and R^-1 (d_in'^2) per layer; K-FAC's A and G the same size
                assert row["ddp"]["factor_bytes"] == LAYERS * (WIDTH ** 2 + (WIDTH + 1) ** 2) * 4
            else:  # equal costs: layer 0 on rank 0, layer 1 on rank 1
                assert row["fsdp2"]["owned"] == [rank]
                assert f["precond_gather"] == [G // 2, G // 2]     # send mine, get the other's
                assert f["precond_scatter"] == [G // 2, G // 2]
                assert 2 * row["fsdp2"]["factor_bytes"] == row["ddp"]["factor_bytes"]


def test_fsdp2_bench_formulas_at_four_ranks():
    """(P-1)/P and 1/P coincide at P = 2: the formulas at P = 4, written out."""
    w = [WIDTH] * (LAYERS + 1)
    rep = bench.formulas(w, 4, "MKOR", "replicated", "fsdp2")
    assert rep["precond_gather"] == [LAYERS * 3 * G // 4] * 2
    assert rep["fsdp_all_gather"] == [2 * LAYERS * 3 * G // 4] * 2
    assert rep["fsdp_reduce_scatter"] == [LAYERS * 3 * G // 4] * 2
    own = bench.formulas(w, 4, "MKOR", "owner", "fsdp2", owned=[0])
    assert own["precond_gather"] == [(LAYERS - 1) * G // 4, 3 * G // 4]
    assert own["precond_scatter"] == [3 * G // 4, (LAYERS - 1) * G // 4]
    none = bench.formulas(w, 4, "MKOR", "owner", "fsdp2", owned=[])
    assert none["precond_gather"] == [LAYERS * G // 4, 0]
