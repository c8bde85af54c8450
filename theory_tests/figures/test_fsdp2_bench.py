"""figures/bench/fsdp2.py: on 2 gloo ranks at tiny sizes, the bytes counted from the
collectives MKOR, K-FAC, FSDP2 and DDP issue equal the script's formulas and closed forms
written out here, so neither the counting nor the formulas can drift."""
import argparse

from figures.bench import fsdp2 as bench

WIDTH, LAYERS, WORLD = 8, 2, 2
G = WIDTH * (WIDTH + 1) * 4  # one layer's weight + bias bytes (float32), 288
S = (WIDTH ** 2 + (WIDTH + 1) ** 2) * 4  # one layer's K-FAC sums, G and A (d_out^2 + d_in'^2), 580
CHECK = 3 * 8  # one layer's self-check verdicts (padding, ratio, S; float64), every capture step


def test_fsdp2_bench_counts_equal_formulas_on_two_ranks():
    args = argparse.Namespace(worlds=[WORLD], width=WIDTH, layers=LAYERS, batch=4, steps=1)
    results = bench.measure(WORLD, args)
    w = bench.widths(args)
    stats = {"MKOR": LAYERS * (WIDTH + WIDTH + 1) * 4,                   # sum (d_in' + d_out)
             "K-FAC": LAYERS * S}                                        # sum (d_in'^2 + d_out^2)
    # stored per layer: MKOR's L^-1 (d_out^2) and R^-1 (d_in'^2); K-FAC's G and A as large,
    # and their eigenvectors again, and the eigenvalues (d_out + d_in')
    factors = {"MKOR": LAYERS * S, "K-FAC": LAYERS * (2 * S + (WIDTH + WIDTH + 1) * 4)}
    seen = set()
    for rank, rows in enumerate(results):
        for row in rows:
            opt, placement = row["optimizer"], row["placement"]
            seen.add((opt, placement))
            for parallel in ("fsdp2", "ddp"):
                r = row[parallel]
                assert r["unknown"] == [], r["unknown"]
                formula = bench.formulas(w, WORLD, opt, placement, parallel, r["owned"])
                for kind in bench.KINDS:
                    if kind != "other":
                        assert r["bytes"][kind] == formula[kind], (opt, placement, parallel, kind)
                assert r["payload_bytes"] == stats[opt]
                if (opt, placement, parallel) == ("K-FAC", "owner", "fsdp2"):
                    # one reduce per owner: every rank sends both packets, gets its own back
                    assert r["bytes"]["stats_all_reduce"] == [LAYERS * CHECK] * 2
                    assert r["bytes"]["stats_reduce"] == [stats[opt], S]
                    assert r["bytes"]["kl_all_reduce"] == [4, 4]  # one float32 scalar
                else:  # DDP: nothing sharded, nothing owned
                    assert r["bytes"]["stats_all_reduce"] == [stats[opt] + LAYERS * CHECK] * 2
                    assert r["bytes"]["stats_reduce"] == [0, 0]
                    assert r["bytes"]["kl_all_reduce"] == [0, 0]
            f = row["fsdp2"]["bytes"]
            assert f["fsdp_all_gather"] == [2 * LAYERS * G // 2] * 2   # forward + backward
            assert f["fsdp_reduce_scatter"] == [LAYERS * G // 2] * 2
            assert row["ddp"]["bytes"]["ddp_all_reduce"] == [LAYERS * G] * 2
            assert row["ddp"]["factor_bytes"] == factors[opt]
            assert row["ddp"]["owned"] == list(range(LAYERS))
            if placement == "replicated":
                assert f["precond_gather"] == [LAYERS * G // 2] * 2
                assert f["precond_scatter"] == [0, 0]
                assert row["fsdp2"]["factor_bytes"] == factors[opt]
                assert row["fsdp2"]["owned"] == list(range(LAYERS))
            else:  # equal costs: layer 0 on rank 0, layer 1 on rank 1
                assert row["fsdp2"]["owned"] == [rank]
                assert f["precond_gather"] == [G // 2, G // 2]     # send mine, get the other's
                assert f["precond_scatter"] == [G // 2, G // 2]
                assert 2 * row["fsdp2"]["factor_bytes"] == factors[opt]
    assert seen == set(bench.CONFIGS) == {(o, p) for o in ("MKOR", "K-FAC")
                                          for p in ("replicated", "owner")}


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
    # K-FAC owner: every rank sends the L packets, the owner of layer 0 receives one; a rank
    # owning nothing receives none; DDP all-reduces as before; one rank reduces nothing
    kown = bench.formulas(w, 4, "K-FAC", "owner", "fsdp2", owned=[0])
    assert kown["stats_reduce"] == [LAYERS * S, S]
    assert kown["stats_all_reduce"] == [LAYERS * CHECK] * 2
    assert kown["kl_all_reduce"] == [4, 4]
    assert kown["precond_gather"] == own["precond_gather"]
    assert kown["precond_scatter"] == own["precond_scatter"]
    assert bench.formulas(w, 4, "K-FAC", "owner", "fsdp2", owned=[])["stats_reduce"] == [
        LAYERS * S, 0]
    kddp = bench.formulas(w, 4, "K-FAC", "owner", "ddp")
    assert kddp["stats_all_reduce"] == [LAYERS * (S + CHECK)] * 2
    assert kddp["stats_reduce"] == kddp["kl_all_reduce"] == [0, 0]
    one = bench.formulas(w, 1, "K-FAC", "owner", "fsdp2", owned=list(range(LAYERS)))
    assert one["stats_reduce"] == one["stats_all_reduce"] == [0, 0]
    assert one["kl_all_reduce"] == [4, 4]  # the 1-rank mesh still all-reduces the scalar
