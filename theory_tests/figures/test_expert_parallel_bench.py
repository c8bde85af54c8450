"""figures/bench/expert_parallel.py on 2 gloo ranks at a tiny size: the bytes it counts and the
factor memory it reads equal closed forms written out here (so neither the counting nor the
split between dense layers and expert stacks can drift), and its tables print. Timings are
never asserted (``test_benchmark_scripts.py``'s rule)."""
import argparse

import pytest

from figures.bench import expert_parallel as bench

E, D, WORLD = 4, 16, 2     # experts, model dim = expert hidden, ranks
STACKS = 2 * 3             # 2 layers x (w1, w3, w2), each (E, D, D), no bias
GRAD = E * D * D * 4       # one stack's float32 gradient
VERDICTS = (2 + E) * 8     # one stack's self-check verdicts (float64), every capture step
# what one stack's experts add to the statistics packet: MKOR's sums of a and g (D + D per
# expert), K-FAC's of A and G (D^2 + D^2); E row counts and the stack's unused count slot
STATS = {"MKOR": (E * (2 * D + 1) + 1) * 4, "KFAC": (E * (2 * D * D + 1) + 1) * 4}
# stored per expert: MKOR's L^-1, R^-1; K-FAC's G, A, their eigenvectors and eigenvalues
FACTORS = {"MKOR": 2 * D * D * 4, "KFAC": (4 * D * D + 2 * D) * 4}
KL = {"MKOR": 0, "KFAC": 4}  # K-FAC's KL-clip scalar, all-reduced once the experts are spread


@pytest.mark.slow
def test_expert_parallel_bench_counts_equal_closed_forms_on_two_ranks():
    args = argparse.Namespace(worlds=[WORLD], dim=D, experts=E, vocab=64, batch=4,
                              inv_freq=1, repeats=1)
    results = bench.measure(args)
    assert [name for _, name, _ in results] == ["EP 2", "FSDP2 owner", "FSDP2 replicated"]
    for _, name, ranks in results:
        for case in bench.CASES:
            for rank in ranks:
                experts = rank["bytes"][case]["experts"]
                memory = rank["memory"][case]["experts"]
                if name == "EP 2":  # nothing but the verdicts (and K-FAC's KL clip: one
                    # float32, the sum of <V, G> over the experts each rank holds)
                    assert experts == {"statistics": STACKS * VERDICTS + KL[case],
                                       "gradients": 0}
                    assert memory == STACKS * E // WORLD * FACTORS[case]
                elif name == "FSDP2 owner":  # per-expert owners: every stack's sums, no
                    # gradient moved, the experts of this rank's shard kept here
                    assert experts == {"statistics": STACKS * (STATS[case] + VERDICTS),
                                       "gradients": 0}
                    assert memory == STACKS * E // WORLD * FACTORS[case]
                else:  # every stack's sums and half of every stack's gradient sent
                    assert experts == {"statistics": STACKS * (STATS[case] + VERDICTS),
                                       "gradients": STACKS * GRAD // WORLD}
                    assert memory == STACKS * E * FACTORS[case]
                assert rank["bytes"][case]["dense"]["gradients"] > 0
        assert bool(ranks[0]["ms"]) == (name == "EP 2")
    table = bench.tables(results, args)
    assert table.count("| 2 | EP 2 |") == 4  # bytes (MKOR, K-FAC), memory, time
