"""Communication, factor memory and step time of MKOR and K-FAC under FSDP2 and DDP
(issue 23.5).

``python -m figures.bench.fsdp2 [--worlds 1 2 4] [--width 512] [--layers 4] [--batch 64]
[--steps 8] [--json PATH]`` forks gloo CPU ranks (one thread each) and trains an MLP of
``--layers`` x ``Linear(width, width)`` (ReLU between, every width divisible by the world
sizes) with SGD under MKOR (factors updated every step: ``inv_freq=1``) and K-FAC (factor
EMAs every step: ``factor_freq=1``), each with ``factor_placement`` ``"replicated"`` and
``"owner"``, each under FSDP2 (``fully_shard`` per Linear, then the root) and under DDP
(where there is nothing sharded to own, so both placements replicate), the same model, seed
and per-rank batch.

Bytes: one step (after one warm-up step) runs under a ``TorchDispatchMode`` that sees every
``c10d`` / ``_c10d_functional`` collective this process issues (nothing in the library is
changed) and files it by the phase it ran in and its kind: in forward/backward, FSDP2's
parameter all-gathers and gradient reduce-scatters (or DDP's gradient all-reduce); in
``step()``, the statistics (MKOR's O(d) (a_bar, g_bar) buffer and replicated K-FAC's O(d^2)
sums: ``all_reduce``; owner-placed K-FAC: one ``reduce`` per owning rank of the packet of its
layers), owner-placed K-FAC's KL-clip (one ``all_reduce`` of a 0-d tensor: the owners'
partial sums), and the preconditioning's gradient moves (replicated: ``full_tensor``
all-gathers; owner: ``gather`` to the owner and ``scatter`` back). Logical bytes per rank:
an all-reduce counts its buffer as sent and received (``communicated_bytes``' convention,
what a rank contributes and gets back; a ring moves 2(P-1)/P of it each way); a reduce
counts the buffer as sent by every rank, the root included (what it contributes to the sum:
``payload_bytes``' convention), and as received on the root alone (a tree or ring moves
about (P-1)/P of it per link, not modelled); an all-gather (reduce-scatter) the P-1 shards
the rank receives (sends); a ``gather`` / ``scatter`` the rows actually sent to or from the
root. :func:`formulas` gives the same numbers from the layer shapes alone; the test
``theory_tests/figures/test_fsdp2_bench.py`` holds the counts to it.

Factor memory: the bytes of every tensor (but the 0-d counters) in the rank's
``preconditioner_state_dict()["layers"]``: MKOR's inverse factors L^-1, R^-1; K-FAC's EMAs
A, G *and* their decompositions (``eig_A``, ``eig_G``: eigenvalues and eigenvectors), about
twice MKOR's. A rank keeps an empty state for a layer another rank owns. Time: steps of
FSDP2 and DDP interleaved, each the slowest rank's wall time, the ratio of the medians.
Times on a machine with fewer cores than ranks are indicative only; bytes are exact.
"""
import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed.tensor  # noqa: F401  (imported before the fork)
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

from figures.bench.forked_ranks import run_ranks
from torch_impl import KFAC, MKOR

CONFIGS = (("MKOR", "replicated"), ("MKOR", "owner"), ("K-FAC", "replicated"),
           ("K-FAC", "owner"))
KINDS = ("stats_all_reduce", "stats_reduce", "kl_all_reduce", "precond_gather",
         "precond_scatter", "fsdp_all_gather", "fsdp_reduce_scatter", "ddp_all_reduce", "other")
ITEMSIZE = 4  # float32


class CommCounter(TorchDispatchMode):
    """Logical bytes {kind: [sent, received]} of the collectives this process issues while
    active, filed by ``self.phase`` ("fwd_bwd" or "step") and the collective."""

    def __init__(self):
        super().__init__()
        self.phase = "fwd_bwd"
        self.bytes = {k: [0, 0] for k in KINDS}
        self.unknown = []

    def _add(self, kind, sent, received):
        self.bytes[kind][0] += sent
        self.bytes[kind][1] += received

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            self._count(func.__name__.split(".")[0], args)
        return func(*args, **(kwargs or {}))

    def _count(self, name, args):
        step = self.phase == "step"
        if name == "allreduce_":  # (tensors, group, op, ...)
            n = sum(t.nbytes for t in args[0])
            if not step:
                kind = "ddp_all_reduce"
            elif all(t.ndim == 0 for t in args[0]):  # K-FAC owner's KL-clip partial sums
                kind = "kl_all_reduce"
            else:                                    # a flat statistics packet
                kind = "stats_all_reduce"
            self._add(kind, n, n)
        elif name == "reduce_" and step:  # (tensors, group, op, root's rank in group, ...)
            n = sum(t.nbytes for t in args[0])  # K-FAC owner: a packet to its owner
            root = dist.ProcessGroup.unbox(args[1]).rank() == args[3]
            self._add("stats_reduce", n, n if root else 0)
        elif name == "_allgather_base_":  # (output, input, group): FSDP2's parameters
            out, inp = args[0], args[1]
            n = out.nbytes - inp.nbytes
            self._add("precond_gather" if step else "fsdp_all_gather", n, n)
        elif name == "_reduce_scatter_base_":  # (output, input, group): FSDP2's gradients
            out, inp = args[0], args[1]
            n = inp.nbytes - out.nbytes
            self._add("fsdp_reduce_scatter", n, n)
        elif name == "all_gather_into_tensor":  # (input, group_size, group_name): full_tensor
            n = (args[1] - 1) * args[0].nbytes
            self._add("precond_gather" if step else "fsdp_all_gather", n, n)
        elif name == "gather_":  # (outputs[[...]], inputs[...], group, root, ...)
            outs, inp = args[0], args[1][0]
            if outs and outs[0]:  # the root: receives every other rank's padded rows
                self._add("precond_gather", 0, (len(outs[0]) - 1) * inp.nbytes)
            else:
                self._add("precond_gather", inp.nbytes, 0)
        elif name == "scatter_":  # (outputs[...], inputs[[...]], group, root, ...)
            out, ins = args[0][0], args[1]
            if ins and ins[0]:
                self._add("precond_scatter", (len(ins[0]) - 1) * out.nbytes, 0)
            else:
                self._add("precond_scatter", 0, out.nbytes)
        elif name == "broadcast_" and not step:  # DDP's few-byte per-forward broadcasts
            n = sum(t.nbytes for t in args[0])
            self._add("other", n, n)
        elif name in ("wait_tensor", "_wrap_tensor_autograd", "barrier"):
            pass
        else:
            self.unknown.append(f"{name}@{self.phase}:" + str([
                getattr(a, "shape", None) for a in args if isinstance(a, torch.Tensor)] + [
                [tuple(t.shape) for t in a if isinstance(t, torch.Tensor)]
                for a in args if isinstance(a, (list, tuple))]))


def widths(args):
    return [args.width] * (args.layers + 1)


def build(args, parallel, optimizer, placement):
    torch.manual_seed(0)
    w = widths(args)
    mods = []
    for i in range(args.layers):
        mods.append(torch.nn.Linear(w[i], w[i + 1]))
        if i < args.layers - 1:
            mods.append(torch.nn.ReLU())
    net = torch.nn.Sequential(*mods)
    if parallel == "fsdp2":
        for m in net:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m)
        fully_shard(net)
        model = net
    else:
        model = DistributedDataParallel(net)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    if optimizer == "MKOR":
        pre = MKOR(model, sgd, inv_freq=1, factor_placement=placement)
    else:
        pre = KFAC(model, sgd, factor_freq=1, factor_placement=placement)
    return model, pre


def _layer_states(pre):
    """{layer name: state dict} of MKOR or K-FAC; {} for a layer another rank owns."""
    return pre.preconditioner_state_dict()["layers"]


def factor_bytes(pre):
    """Bytes of every matrix (and vector) the preconditioner stores on this rank: MKOR's
    inverse factors, K-FAC's EMAs A, G and their decompositions (``eig_*``: eigenvalues and
    eigenvectors, or ``inv_*``); the 0-d counters are left out."""
    total = 0
    for state in _layer_states(pre).values():
        for value in state.values():
            for t in value if isinstance(value, tuple) else (value,):
                if isinstance(t, torch.Tensor) and t.ndim > 0:
                    total += t.nbytes
    return total


def owned_layers(pre):
    """Indices of the layers whose factors this rank stores (a non-empty state)."""
    return sorted(int(name.split(".")[-1]) // 2
                  for name, state in _layer_states(pre).items() if state)


def formulas(w, world, optimizer, placement, parallel, owned=None, itemsize=ITEMSIZE):
    """{kind: [sent, received]} per rank and step from the shapes alone, for Linear layers
    w[i] -> w[i+1] with biases (d_in' = d_in + 1), every d_out divisible by ``world``;
    ``owned``: the layers whose factors this rank owns (owner placement)."""
    P = world
    dims = [(w[i + 1], w[i] + 1) for i in range(len(w) - 1)]  # (d_out, d_in')
    out = {k: [0, 0] for k in KINDS}
    if optimizer == "MKOR":
        per_layer = [(d_out + d_in) * itemsize for d_out, d_in in dims]
    else:
        per_layer = [(d_out ** 2 + d_in ** 2) * itemsize for d_out, d_in in dims]
    stats = sum(per_layer)
    if optimizer == "K-FAC" and placement == "owner" and parallel == "fsdp2":
        # every Linear is sharded, so owner-placed: one reduce per owning rank of its layers'
        # packet (no extra count entries: with a bias, A's corner carries the row count);
        # every rank contributes every packet, and receives the packet of the layers it owns
        if P > 1:
            out["stats_reduce"] = [stats, sum(per_layer[i] for i in owned)]
        # the KL-clip's one 0-d all-reduce of the owners' partial sums (on one rank too)
        out["kl_all_reduce"] = [itemsize, itemsize]
    elif P > 1:
        out["stats_all_reduce"] = [stats, stats]
    if P > 1:  # the self-check's verdicts: 3 float64 per layer, MAX-all-reduced every capture
        check = 3 * 8 * len(dims)
        out["stats_all_reduce"] = [b + check for b in out["stats_all_reduce"]]
    if parallel == "ddp":
        grads = sum(d_out * d_in for d_out, d_in in dims) * itemsize
        out["ddp_all_reduce"] = [grads, grads]  # DDP all-reduces on one rank too
        return out
    for i, (d_out, d_in) in enumerate(dims):
        g = d_out * d_in * itemsize  # weight and bias gradient (parameter) bytes
        others = (P - 1) * g // P    # the P-1 shards of the other ranks
        for kind, times in (("fsdp_all_gather", 2), ("fsdp_reduce_scatter", 1)):
            out[kind][0] += times * others  # forward and backward all-gather
            out[kind][1] += times * others
        if placement == "replicated":
            out["precond_gather"][0] += others
            out["precond_gather"][1] += others
        elif i in owned:  # gather P-1 shards in, scatter P-1 shards out
            out["precond_gather"][1] += others
            out["precond_scatter"][0] += others
        else:            # send my shard, get my rows back
            out["precond_gather"][0] += g // P
            out["precond_scatter"][1] += g // P
    return out


def _timed_step(model, pre, x, y, counter=None):
    dist.barrier()
    start = time.perf_counter()
    if counter is not None:
        counter.phase = "fwd_bwd"
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    if counter is not None:
        counter.phase = "step"
    pre.step()
    pre.optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _slowest(elapsed):
    t = torch.tensor([elapsed], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time
    return t.item()


def _rank(rank, world, args):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1 + rank)
    w = widths(args)
    x = torch.randn(args.batch, w[0], generator=g)
    y = torch.randn(args.batch, w[-1], generator=g)
    out = []
    for optimizer, placement in CONFIGS:
        runs = {p: build(args, p, optimizer, placement) for p in ("fsdp2", "ddp")}
        row = dict(optimizer=optimizer, placement=placement, world=world, rank=rank)
        for parallel, (model, pre) in runs.items():
            _timed_step(model, pre, x, y)  # warm-up: first factors, lazy init
            counter = CommCounter()
            with counter:
                _timed_step(model, pre, x, y, counter)
            row[parallel] = dict(bytes=counter.bytes, unknown=counter.unknown,
                                 factor_bytes=factor_bytes(pre), times=[])
            row[parallel]["payload_bytes"] = pre.payload_bytes
            row[parallel]["owned"] = owned_layers(pre)
        for _ in range(args.steps):  # interleaved
            for parallel, (model, pre) in runs.items():
                row[parallel]["times"].append(_slowest(_timed_step(model, pre, x, y)))
        for model, pre in runs.values():
            if hasattr(pre, "remove"):
                pre.remove()
        out.append(row)
    return out


def measure(world, args):
    """Every rank's list of result rows (one per optimizer x placement) for ``world`` forked
    gloo ranks."""
    return run_ranks(_rank, world, args, prefix="fsdp2_bench_")


def _kb(n):
    return f"{n / 1024:.1f}"


def summarise(args):
    """Rows of the tables (rank maxima) with the formula next to each count."""
    rows = []
    w = widths(args)
    for world in args.worlds:
        results = measure(world, args)
        for i, (optimizer, placement) in enumerate(CONFIGS):
            ranks = [r[i] for r in results]
            row = dict(optimizer=optimizer, placement=placement, world=world)
            for parallel in ("fsdp2", "ddp"):
                per = [r[parallel] for r in ranks]
                counted = [p["bytes"] for p in per]
                formula = [formulas(w, world, optimizer, placement, parallel, p["owned"])
                           for p in per]
                row[parallel] = dict(
                    counted_max={k: [max(c[k][j] for c in counted) for j in (0, 1)]
                                 for k in KINDS},
                    formula_max={k: [max(f[k][j] for f in formula) for j in (0, 1)]
                                 for k in KINDS},
                    exact=all(c[k] == f[k] for c, f in zip(counted, formula)
                              for k in KINDS if k != "other"),
                    unknown=sorted({u for p in per for u in p["unknown"]}),
                    factor_bytes=[p["factor_bytes"] for p in per],
                    payload_bytes=per[0]["payload_bytes"],
                    ms=statistics.median(per[0]["times"]) * 1e3)
            row["ratio"] = row["fsdp2"]["ms"] / row["ddp"]["ms"]
            rows.append(row)
    return rows


def tables(rows, args):
    w = widths(args)
    params = sum(w[i + 1] * (w[i] + 1) for i in range(len(w) - 1))
    lines = [f"MLP {args.layers} x Linear({args.width}, {args.width}) with biases "
             f"({params * ITEMSIZE / 2**20:.2f} MB of float32 parameters), per-rank batch "
             f"{args.batch}; KB per rank and step, the largest over the ranks, "
             f"counted (formula):", "",
             "| optimizer | placement | ranks | statistics all-reduce | statistics reduce "
             "sent / recv | KL-clip all-reduce (B) | precond. gather sent / recv "
             "| precond. scatter sent / recv | FSDP2 all-gather recv "
             "| FSDP2 reduce-scatter sent | DDP grad all-reduce | counts = formula |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def cf(row, parallel, kind, j, unit=_kb):
        c = row[parallel]["counted_max"][kind][j]
        f = row[parallel]["formula_max"][kind][j]
        return f"{unit(c)} ({unit(f)})"

    for r in rows:
        lines.append(
            f"| {r['optimizer']} | {r['placement']} | {r['world']} "
            f"| {cf(r, 'fsdp2', 'stats_all_reduce', 0)} "
            f"| {cf(r, 'fsdp2', 'stats_reduce', 0)} / {cf(r, 'fsdp2', 'stats_reduce', 1)} "
            f"| {cf(r, 'fsdp2', 'kl_all_reduce', 0, str)} "
            f"| {cf(r, 'fsdp2', 'precond_gather', 0)} / {cf(r, 'fsdp2', 'precond_gather', 1)} "
            f"| {cf(r, 'fsdp2', 'precond_scatter', 0)} / {cf(r, 'fsdp2', 'precond_scatter', 1)} "
            f"| {cf(r, 'fsdp2', 'fsdp_all_gather', 1)} "
            f"| {cf(r, 'fsdp2', 'fsdp_reduce_scatter', 0)} "
            f"| {cf(r, 'ddp', 'ddp_all_reduce', 0)} "
            f"| {'yes' if r['fsdp2']['exact'] and r['ddp']['exact'] else 'NO'} |")
    other = max(r["ddp"]["counted_max"]["other"][0] for r in rows)
    lines += ["", f"Not in the table: DDP's own broadcasts in forward, {other} B per rank "
              f"and step (not in the formulas)."]
    lines += ["", "Factor memory per rank (KB; min-max over the ranks under FSDP2; DDP) and "
              f"step time (slowest rank, median of {args.steps} interleaved steps):", "",
              "| optimizer | placement | ranks | factor KB FSDP2 | factor KB DDP "
              "| FSDP2 ms | DDP ms | FSDP2 / DDP |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fb = r["fsdp2"]["factor_bytes"]
        lines.append(
            f"| {r['optimizer']} | {r['placement']} | {r['world']} "
            f"| {_kb(min(fb))}-{_kb(max(fb))} | {_kb(max(r['ddp']['factor_bytes']))} "
            f"| {r['fsdp2']['ms']:.0f} | {r['ddp']['ms']:.0f} | {r['ratio']:.2f} |")
    unknown = sorted({u for r in rows for p in ("fsdp2", "ddp") for u in r[p]["unknown"]})
    if unknown:
        lines += ["", f"Uncounted collectives: {', '.join(unknown)}"]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if any(args.width % p for p in args.worlds):
        parser.error("--width must be divisible by every world size")
    print(f"`python -m figures.bench.fsdp2` "
          f"({datetime.date.today().isoformat()}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, gloo, one thread per rank)\n")
    rows = summarise(args)
    print(tables(rows, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
