"""MKOR and K-FAC under torchtitan's expert parallelism (issue 48): bytes, factor memory, time.

    python -m figures.bench.expert_parallel [--quick] [--worlds 1 2 4] [--dim 128]
        [--experts 8] [--batch 8] [--inv-freq 10] [--repeats 5] [--json PATH]

torchtitan's qwen3 MoE (``theory_tests/support/torchtitan_ep.py``: 2 layers, ``--experts``
experts of hidden ``--dim``, top-2, float32, load balancing off), forked on gloo CPU ranks (one
thread each), the same model and global batch (``--batch`` sequences of 16 tokens, split over
the ranks) in three layouts:

* **EP**: torchtitan's own ``parallelize_qwen3`` with EP = world (each rank holds E / world
  whole experts behind the all-to-all dispatcher) and, on 4 ranks, EP 2 x efsdp 2 (each rank
  half a chunk, the chunk's rows on 2 ranks); the dense layers FSDP-sharded over every rank,
  their factors replicated (the default);
* **FSDP2 owner**: ``parallelize_qwen3`` without EP (FSDP over every rank, the stacks sharded
  ``Shard(0)`` over their experts), ``factor_placement="owner"``: each dense layer's factors on
  one rank, its gradient gathered there and scattered back; each expert's factors on the rank
  whose shard holds it, its gradient preconditioned in place (per-expert owners, issue 48);
* **FSDP2 replicated**: the same with ``factor_placement="replicated"``: every rank keeps every
  factor and all-gathers every gradient.

MKOR and K-FAC run in our torchtitan container (``torch_impl.integrations.torchtitan``,
``implementation="foreach"``) over AdamW, with ``inv_freq`` = ``--inv-freq`` (K-FAC also
updates its statistics every step, its default ``factor_freq=1``).

* **Bytes**: what each rank sends inside ``step()`` at a step with a factor update (step
  ``inv_freq``, after ``inv_freq`` warm-up steps), counted per collective by
  :class:`figures.bench.fsdp2.CommCounter` (its conventions: an all-reduce or a reduce sends
  its buffer, an all-gather the rank's shard to each other rank, a ``gather`` the rank's rows,
  a ``scatter`` the root's rows for the others), filed as statistics (the factor sums or
  vectors, the self-check's verdicts, K-FAC owner's KL-clip scalar) or gradients (the moves
  that precondition a sharded gradient). The expert stacks' share is the difference from the
  same run with the stacks left out (``skip_modules``): what preconditioning them adds. Mean
  over the ranks (owner placement loads them unevenly: the busiest rank's total is shown too).
* **Factor memory**: bytes of every floating tensor in the preconditioner's per-layer state
  on each rank (MKOR's L^-1, R^-1; K-FAC's A, G and their eigenvalues and eigenvectors).
* **Time**: one training step (forward, backward, ``step()``, ``zero_grad``) under the EP
  layout, AdamW alone, MKOR and K-FAC interleaved in rounds of ``inv_freq`` steps (one factor
  update each), each round's slowest rank, the median round per step; the ratios to AdamW are
  the result (absolute times compare only within one run).

Prints three Markdown tables and a JSON line; times on a machine with fewer cores than ranks
are indicative only, bytes and memory are exact.
"""
import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist

from figures.bench.forked_ranks import run_ranks
from figures.bench.fsdp2 import CommCounter
from figures.bench.timing import emit_json
from theory_tests.support import torchtitan_ep as T

CASES = ("MKOR", "KFAC")
STATISTICS = ("stats_all_reduce", "stats_reduce", "kl_all_reduce")
GRADIENTS = ("precond_gather", "precond_scatter")
STACKS = "*.inner_experts"  # the fused experts module: skips its three stacks


def layouts(world):
    """[(name, ep, factor placement)] measured on ``world`` ranks (ep 1: FSDP2 without EP)."""
    if world == 1:
        return [("one process", 1, "replicated")]
    ep = [(f"EP {world}", world, "replicated")]
    if world == 4:
        ep.append(("EP 2 x efsdp 2", 2, "replicated"))
    return ep + [("FSDP2 owner", 1, "owner"), ("FSDP2 replicated", 1, "replicated")]


def _model(args, world, ep):
    model = T.ep_model("qwen3", ep, dtype=torch.float32, vocab=args.vocab, dim=args.dim,
                       experts=args.experts, hidden=args.dim)
    if world > 1:
        T.sum_reductions(T.parallelize(model, "qwen3", T.parallel_dims(world, ep), torch.float32))
    return model


def _optimizers(model, case, args, placement, skip=()):
    from torchtitan.components.optimizer import ParamGroupConfig

    from torch_impl.integrations.torchtitan import Optimizers
    factory = {} if case == "AdamW" else {case: {
        "backbone": "AdamW", "inv_freq": args.inv_freq, "factor_placement": placement,
        "skip_modules": skip}}
    return Optimizers.Config(
        implementation="foreach",
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name=case,
                                       optimizer_kwargs={"lr": 1e-4})],
        optimizer_factory_kwargs_by_name=factory).build(model_parts=[model])


def _batch(args, t, rank, world):
    per = args.batch // world
    return T.tokens(t, args.batch, vocab=args.vocab)[rank * per:(rank + 1) * per]


def _sent(args, rank, world, model, opts):
    """{"statistics": bytes, "gradients": bytes} this rank sends in ``step()`` at step
    ``inv_freq`` (a factor update), after ``inv_freq`` warm-up steps."""
    for t in range(args.inv_freq):
        T.lm_step(model, opts, _batch(args, t, rank, world), world)
    T.lm_step(model, None, _batch(args, args.inv_freq, rank, world), world)
    counter = CommCounter()
    counter.phase = "step"
    with counter:
        opts.step()
    opts.zero_grad()
    others = {k: v for k, v in counter.bytes.items()
              if k not in STATISTICS + GRADIENTS and v != [0, 0]}
    if counter.unknown or others:
        raise RuntimeError(f"uncounted collectives in step(): {counter.unknown} {others}")
    return {"statistics": sum(counter.bytes[k][0] for k in STATISTICS),
            "gradients": sum(counter.bytes[k][0] for k in GRADIENTS)}


def _factor_bytes(pre):
    """{"dense": bytes, "experts": bytes} of the floating tensors in ``pre``'s per-layer
    state on this rank (empty for a layer another rank owns)."""
    out = {"dense": 0, "experts": 0}
    for layer in pre._layers:
        for value in pre._state[layer.name].values():
            for t in value if isinstance(value, tuple) else (value,):
                if torch.is_tensor(t) and t.is_floating_point() and t.ndim > 0:
                    out["experts" if layer.experts is not None else "dense"] += t.nbytes
    return out


def _round(args, rank, world, model, opts, t0):
    dist.barrier()
    start = time.perf_counter()
    for t in range(t0, t0 + args.inv_freq):
        T.lm_step(model, opts, _batch(args, t, rank, world), world)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's
    return elapsed.item() / args.inv_freq


def _rank(rank, world, job):
    """One rank of one layout: each optimizer's bytes (with and without the stacks), factor
    memory and, for the EP layouts, the interleaved step times."""
    import warnings
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    args, (_, ep, placement) = job
    out = {"bytes": {}, "memory": {}, "ms": {}}
    runs = {}
    for case in CASES:
        model = _model(args, world, ep)
        opts = _optimizers(model, case, args, placement)
        pre = opts.optimizers[0]
        if not any(l.experts is not None for l in pre._layers):
            raise RuntimeError(f"{case} preconditions no expert stack: {pre.skip_reasons}")
        full = _sent(args, rank, world, model, opts)
        out["memory"][case] = _factor_bytes(pre)
        runs[case] = (model, opts)
        bare = _model(args, world, ep)
        bare_opts = _optimizers(bare, case, args, placement, skip=(STACKS,))
        if any(l.experts is not None for l in bare_opts.optimizers[0]._layers):
            raise RuntimeError(f"{STACKS!r} left a stack preconditioned")
        dense = _sent(args, rank, world, bare, bare_opts)
        out["bytes"][case] = {"dense": dense,
                              "experts": {k: full[k] - dense[k] for k in full}}
        del bare, bare_opts
    if ep > 1 or world == 1:  # time the EP layouts (and one process)
        model = _model(args, world, ep)
        runs = {"AdamW": (model, _optimizers(model, "AdamW", args, placement)), **runs}
        for t in range(2):  # AdamW's warm-up (the others ran inv_freq + 1 steps)
            T.lm_step(model, runs["AdamW"][1], _batch(args, t, rank, world), world)
        times = {case: [] for case in runs}
        for i in range(args.repeats):
            t0 = (i + 1) * args.inv_freq  # the same batches for every contender
            for case, (model, opts) in runs.items():
                times[case].append(_round(args, rank, world, model, opts, t0))
        out["ms"] = {case: 1e3 * statistics.median(ts) for case, ts in times.items()}
    return out


def measure(args):
    """[(world, layout name, every rank's result)] for every world and layout."""
    return [(world, layout[0], run_ranks(_rank, world, (args, layout), prefix="ep_bench_"))
            for world in args.worlds for layout in layouts(world)]


def _kb(n):
    return f"{n / 1024:.1f}"


def tables(results, args):
    cases = {"MKOR": "MKOR", "KFAC": "K-FAC"}
    lines = [f"qwen3 MoE, 2 layers, dim {args.dim}, {args.experts} experts of hidden "
             f"{args.dim}, top-2, vocab {args.vocab}, float32; global batch {args.batch} x "
             f"{T.SEQ} tokens; inv_freq {args.inv_freq}.", "",
             "Bytes each rank sends in `step()` at a factor update (KB; mean over the ranks; "
             "statistics / gradients):", "",
             "| ranks | layout | optimizer | dense layers | expert stacks | total, busiest "
             "rank |", "|---|---|---|---|---|---|"]
    for world, name, ranks in results:
        for case in CASES:
            per = [r["bytes"][case] for r in ranks]

            def mean(part, kind):
                return sum(p[part][kind] for p in per) / len(per)
            cells = [f"{_kb(mean(part, 'statistics'))} / {_kb(mean(part, 'gradients'))}"
                     for part in ("dense", "experts")]
            busiest = max(sum(p[part][k] for part in p for k in p[part]) for p in per)
            lines.append(f"| {world} | {name} | {cases[case]} | {cells[0]} | {cells[1]} "
                         f"| {_kb(busiest)} |")
    lines += ["", "Factor memory per rank (KB; dense layers / expert stacks, min-max over the "
              "ranks where they differ; the busiest rank's total):", "",
              "| ranks | layout | MKOR | MKOR, busiest | K-FAC | K-FAC, busiest |",
              "|---|---|---|---|---|---|"]

    def span(values):
        lo, hi = min(values), max(values)
        return _kb(lo) if lo == hi else f"{_kb(lo)}-{_kb(hi)}"
    for world, name, ranks in results:
        cells = []
        for case in CASES:
            per = [r["memory"][case] for r in ranks]
            cells += [" / ".join(span([p[part] for p in per]) for part in ("dense", "experts")),
                      _kb(max(p["dense"] + p["experts"] for p in per))]
        lines.append(f"| {world} | {name} | {' | '.join(cells)} |")
    lines += ["", f"Training step under EP (ms, slowest rank, median of {args.repeats} "
              f"interleaved rounds of {args.inv_freq} steps):", "",
              "| ranks | layout | AdamW | MKOR | K-FAC | MKOR / AdamW | K-FAC / AdamW |",
              "|---|---|---|---|---|---|---|"]
    for world, name, ranks in results:
        ms = ranks[0]["ms"]
        if ms:
            lines.append(f"| {world} | {name} | {ms['AdamW']:.0f} | {ms['MKOR']:.0f} "
                         f"| {ms['KFAC']:.0f} | {ms['MKOR'] / ms['AdamW']:.2f} "
                         f"| {ms['KFAC'] / ms['AdamW']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="1 and 2 ranks, dim 64, inv_freq 2, 2 rounds (under a minute)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--inv-freq", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.worlds, args.dim, args.inv_freq, args.repeats = [1, 2], 64, 2, 2
    if any(args.batch % w or args.experts % w for w in args.worlds):
        parser.error("--batch and --experts must be divisible by every world size")
    T.configure()
    import torchtitan.models.qwen3  # noqa: F401  (imported once, before the fork)
    print(f"`python -m figures.bench.expert_parallel{' --quick' if args.quick else ''}` "
          f"({datetime.date.today().isoformat()}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, gloo, one thread per rank)\n")
    results = measure(args)
    print(tables(results, args))
    emit_json({"args": vars(args), "results": [
        {"world": w, "layout": n, "ranks": r} for w, n, r in results]}, args.json)
    return results


if __name__ == "__main__":
    main()
