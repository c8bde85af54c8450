"""Figure ``curvature_distance`` (issue 46 item 7): its numbers are what the figure and its
README section say they are (claims row FIG-CURVATURE).

Recomputed here on the figure's own networks (float64 brute force, a few seconds), so that a
change to the figure's computation fails a test, not only a stale committed output:

* the order every number must keep: best Kronecker ≤ each method's scaled distance ≤ its raw
  one, on every layer (the best product minimises over every G ⊗ A, scale included);
* the exactness anchors: K-FAC type-2 expand on the deep linear net with per-token targets,
  type-2 reduce on the conv net's layers after which nothing mixes positions;
* MKOR rank k's two endpoints (KC7): one row per group gives K-FAC empirical expand's own
  factors, one group per sample K-FAC empirical reduce's (G up to the factor S);
* the cancelled statistics (the key projection's reduce and whole-sequence MKOR groups);
* the committed outputs hold the same statements.
"""
import json

import torch

from figures import common as C
from figures import curvature_methods as M
from figures.curvature_rows import Forward
from figures.experiments import curvature_distance as CD
from theory_tests.support import curvature_nets as nets


def _net(title, table=CD.NETS):
    builder, kwargs, kind = table[title]
    net = builder(**kwargs)
    loss = nets.make_loss(kind, "mean")
    with torch.no_grad():
        targets = nets.make_targets(kind, net.model(net.inputs))
    return net, loss, targets


def _by(records):
    return {(r["method"], r["layer"]): r for r in records}


def _order(found):
    """Best Kronecker ≤ every method's scaled distance ≤ its raw one, on every layer."""
    for title, records in found.items():
        best = {r["layer"]: r["scaled"] for r in records if r["method"] == "best Kronecker"}
        assert len(best) == len({r["layer"] for r in records})
        for r in records:
            assert best[r["layer"]] <= r["scaled"] + 1e-12, (title, r)
            if r["raw"] is not None:
                assert r["scaled"] <= r["raw"] + 1e-12, (title, r)
        methods = {r["method"] for r in records}
        assert len(methods) == 6 + len(CD.RANKS) + 1  # every flavour, rank and the best


def _anchors(found):
    """Type-2 expand is the GGN on the deep linear net with per-token targets (raw distance
    ~1e-16, c* = 1) and no other flavour is there; on the conv net (positions summed before
    the loss) type-2 reduce is exact on the second conv and the head, expand on neither conv."""
    deep = _by(found["deep linear (tokens, MSE)"])
    layers = {layer for _, layer in deep}
    for layer in layers:
        assert deep["K-FAC type-2 expand", layer]["raw"] < 1e-12
        assert abs(deep["K-FAC type-2 expand", layer]["scale"] - 1) < 1e-12
        for other in ("K-FAC empirical expand", "K-FAC mc expand", "K-FAC type-2 reduce"):
            assert deep[other, layer]["raw"] > 0.05, (other, layer)
    conv = _by(found["conv net (summed, MSE)"])
    first, second, head = sorted({layer for _, layer in conv})
    for layer in (second, head):
        assert conv["K-FAC type-2 reduce", layer]["raw"] < 1e-12
    assert conv["K-FAC type-2 expand", second]["raw"] > 0.1
    assert conv["K-FAC type-2 reduce", first]["raw"] > 0.1  # conv 2 mixes its positions


def test_mkor_rank_k_endpoints_are_kfacs_empirical_factors():
    """KC7 on the transformer block (cross-entropy per token, N = 4 sequences of S = 4
    tokens, R = 16 rows): k = R gives K-FAC empirical expand's A and G; k = N (one group per
    sequence) gives empirical reduce's A, and its G / S."""
    net, loss, targets = _net("transformer block (CE)")
    N, S = net.inputs.shape[:2]
    fwd = Forward(net.model, net.layers, net.inputs)
    expand = M.oracle_kfac_factors(net.model, loss, net.inputs, targets,
                                   fisher_type="empirical", kfac_approx="expand")
    reduce = M.oracle_kfac_factors(net.model, loss, net.inputs, targets,
                                   fisher_type="empirical", kfac_approx="reduce")
    train_loss = loss(fwd.output, targets)
    rows = M.mkor_rank_k_factors(fwd, train_loss, N * S)
    groups = M.mkor_rank_k_factors(fwd, train_loss, N)
    for name in expand:
        for got, want in ((rows[name][0], expand[name][0]), (rows[name][1], expand[name][1]),
                          (groups[name][0], reduce[name][0]),
                          (groups[name][1] * S, reduce[name][1])):
            assert torch.allclose(got, want, rtol=1e-10, atol=1e-14), name


def _cancelled(found):
    """The key projection: the rows of a whole sequence sum to zero (softmax is shift
    invariant), so reduce's G and MKOR's whole-sequence groups (k <= N = 4) are noise; rank 8
    (groups of 2 tokens) and every expand are not."""
    tf = _by(found["transformer block (CE)"])
    key = "0.k"
    for method in ("K-FAC empirical reduce", "K-FAC mc reduce", "K-FAC type-2 reduce",
                   "MKOR rank 1", "MKOR rank 2", "MKOR rank 4"):
        assert tf[method, key]["vanished"] and tf[method, key]["scaled"] == 1.0, method
    for method in ("K-FAC empirical expand", "K-FAC type-2 expand", "MKOR rank 8"):
        assert not tf[method, key]["vanished"] and tf[method, key]["scaled"] < 1.0, method
    assert not any(r["vanished"] for title, rs in found.items() if title != "transformer block (CE)"
                   for r in rs)


def test_the_figures_distances_hold_their_claims():
    """One computation of panel 1 (a few seconds), three kinds of statement on it."""
    found = CD.distances(CD.NETS)
    _order(found)
    _anchors(found)
    _cancelled(found)


def test_the_scaled_distance_fits_the_best_scalar():
    B = torch.tensor([[2.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
    scaled, c = M.scaled_distance(B, 0.5 * B)
    assert abs(c - 2.0) < 1e-15 and scaled < 1e-15
    assert abs(M.raw_distance(B, 0.5 * B) - 0.5) < 1e-15
    K = torch.eye(2, dtype=torch.float64)
    scaled, c = M.scaled_distance(B, K)
    assert abs(c - 2.5) < 1e-15  # <B, I> / <I, I> = 5 / 2
    assert abs(scaled - float(torch.linalg.norm(B - 2.5 * K) / torch.linalg.norm(B))) < 1e-15


def test_the_training_hook_runs_between_the_loss_and_its_backward():
    """``common.train``'s ``before_backward`` sees the step's output and targets while the
    output still has its graph and before any gradient exists; a curve whose option the
    installed library lacks is named, not built."""
    seen = []

    def hook(stepper, output, targets):
        params = list(stepper.optimizers[0].param_groups[0]["params"])
        seen.append((output.requires_grad, targets.shape, all(p.grad is None for p in params)))

    x = torch.randn(8, 3)
    ctx = C.Context(mode="tiny", progress=False)
    C.train(ctx, lambda: torch.nn.Linear(3, 2), C.Spec("SGD", "SGD"), 0.1, 0, 2,
            lambda gen: (x, torch.zeros(8, dtype=torch.long)), torch.nn.functional.cross_entropy,
            lambda model: dict(val_loss=0.0), 1, before_backward=hook)
    assert seen == [(True, (8,), True)] * 2
    assert CD.missing_options(C.Spec("x", "K-FAC", (("no_such_option", 1),))) == [
        "no_such_option"]
    assert CD.missing_options(C.Spec("x", "MKOR")) == []


def test_the_committed_outputs_say_the_same():
    meta = json.loads((C.committed_dir("quick") / f"{CD.NAME}.json").read_text())
    dist = meta["distances"]
    assert list(dist) == list(CD.NETS)
    for title, layers in dist.items():
        for layer, methods in layers.items():
            best = methods["best Kronecker"]["scaled"]
            assert all(best <= m["scaled"] + 1e-12 for m in methods.values()), (title, layer)
    for layer, methods in dist["deep linear (tokens, MSE)"].items():
        assert methods["K-FAC type-2 expand"]["raw"] < 1e-12
    assert meta["summary"] and meta["summary"][0]["reference"] in {
        s.label for s in CD.CURVES}


def test_the_ports_cut_is_the_figures_stated_cut():
    """The group means the figure draws (the port's ``group_row_sums``, what MKOR(rank=k)
    runs) are KC7's contiguous ``tensor_split`` groups, for sizes that divide and that do not
    (a wrong cut, e.g. strided groups, or a mean over k, would differ)."""
    rows = torch.randn(13, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for k in (1, 2, 4, 5, 13):
        assert torch.allclose(M.port_group_means(rows, k), M.split_group_means(rows, k),
                              rtol=0, atol=1e-15), k
