"""Optimizer state in bytes per parameter, and step time over torch's AdamW, for every
optimizer and option (issue 47 item 5; the rows: ``figures.bench.state_rows``).

    python -m figures.bench.state_memory [--sizes mlp gpt5m gpt25m] [--repeats 5]
        [--device cpu] [--ns-dtype float32|bfloat16] [--json PATH] [--write-page]
    python -m figures.bench --only state_memory     (the same, defaults)

* Bytes: ``measured_bytes`` sums ``nbytes`` of every tensor of at least one dimension in
  ``optimizer.state_dict()["state"]`` (the backbone's and, for MKOR / K-FAC, the
  preconditioner's per-layer entries), divided by the model's parameter count. 0-d tensors
  (step counters, MKOR's and K-FAC's per-layer counters and flags) are counted apart, in bytes
  per optimizer (JSON ``scalar_bytes``); Python numbers (MKOR-H's loss window) not at all. Each
  row's count is checked against its closed form (LP6, ``figures.bench.state_closed_form``).
* Time: ``optimizer.step()`` alone, in the same run as ``torch.optim.AdamW(foreach=True)`` on
  the same model: rounds interleave AdamW and up to ``GROUP - 1`` rows (models alive at once
  stay few), median over rounds, each row divided by its round's AdamW. First-order rows step
  on a fixed gradient (as ``optimizer_step.py``), as many steps per round as last
  ``MIN_ROUND_SECONDS``; MKOR and K-FAC rows take a fresh forward and
  backward (untimed: their capture hooks' cost is ``capture_cost.py``'s) before each of
  ``INV_FREQ`` timed steps per round, so a round holds one factor update. MARS exact mode is
  measured for memory only (its step is two forward-backward passes).
* Models: ``mlp`` (2 hidden layers of 512, 0.53M parameters, batch 64), ``gpt5m`` (the figures'
  GPT, width 256, 6 blocks, vocab 1024: 5.3M, batch 2 x 32 tokens) and ``gpt11m`` (width 384,
  6 blocks: 11.4M). With a 25.6M GPT (width 384, 14 blocks) instead, one repeat had not
  finished after 50 minutes on this shared 2-core machine (K-FAC's 28 eigendecompositions of
  1537 x 1537 per factor update, MKOR's forward-backward passes): the sizes keep the bench to
  minutes on an idle machine.

Prints a Markdown table and a JSON line; ``--write-page`` also writes them into
figures/bench/README.md (between the state-memory markers) and figures/bench/state_memory.json.
"""
import argparse
import datetime
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time

import torch
from torch.nn import functional as F

from figures.bench.state_rows import INV_FREQ, ROWS
from figures.bench.timing import emit_json
from figures.models import GPT, mlp

__all__ = ["measured_bytes", "SIZES", "run", "table", "main"]

HERE = pathlib.Path(__file__).parent
PAGE, JSON_OUT = HERE / "README.md", HERE / "state_memory.json"
BEGIN, END = "<!-- state_memory: begin -->", "<!-- state_memory: end -->"
GROUP = 5  # AdamW + 4 rows alive at once
# a first-order row times consecutive steps until a round lasts this long (a step of a small
# model takes about a millisecond, the size of a scheduler's time slice on a loaded machine)
MIN_ROUND_SECONDS = 0.05


def measured_bytes(optimizer):
    """({state key: bytes} over tensors of >= 1 dimension, bytes of 0-d tensors) of
    ``optimizer.state_dict()["state"]``; nested keys are joined as ``mkor.L_inv``,
    ``kfac.eig_A[0]``."""
    by_key, scalars = {}, 0

    def walk(value, key):
        nonlocal scalars
        if isinstance(value, torch.Tensor):
            if value.ndim == 0:
                scalars += value.element_size()
            else:
                by_key[key] = by_key.get(key, 0) + value.numel() * value.element_size()
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{key}[{i}]")

    for entry in optimizer.state_dict()["state"].values():
        walk(entry, "")
    return by_key, scalars


def _gpt_size(width, depth):
    def make():
        model = GPT(vocab=1024, block=32, width=width, depth=depth, heads=4)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 1024, (2, 33), generator=g)
        return model, (ids[:, :-1],), ids[:, 1:].flatten(), \
            lambda out, y: F.cross_entropy(out.flatten(0, 1), y)
    return make


def _mlp_size():
    model = mlp(256, 512, 256, depth=2)
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(64, 256, generator=g),), torch.randn(64, 256, generator=g), \
        F.mse_loss


# name -> (label, make() -> (model, inputs, target, loss_fn))
SIZES = {"mlp": ("MLP 0.53M", _mlp_size), "gpt5m": ("GPT 5.3M", _gpt_size(256, 6)),
         "gpt11m": ("GPT 11.4M", _gpt_size(384, 6))}


class Contender:
    """One row on its own copy of a model: ``prepare()`` (untimed) then ``step()`` (timed)."""

    def __init__(self, row, make, device, ns_dtype):
        torch.manual_seed(0)
        model, inputs, target, loss_fn = make()
        self.row, self.n = row, sum(p.numel() for p in model.parameters())
        self.model = model.to(device=device, dtype=row.param_dtype)
        self.inputs = [x.to(device, row.param_dtype) if x.is_floating_point() else x.to(device)
                       for x in inputs]
        self.target = target.to(device, row.param_dtype) if target.is_floating_point() \
            else target.to(device)
        self.loss_fn = loss_fn
        self.opt = row.build(self.model, ns_dtype)
        self.steps_per_round = INV_FREQ if row.kronecker else 1
        self.prepare(force=True)

    def loss(self):
        return self.loss_fn(self.model(*self.inputs), self.target)

    def prepare(self, force=False):
        """A fresh gradient for the Kronecker rows (each step), else once."""
        if not (force or self.row.kronecker):
            return
        self.model.zero_grad(set_to_none=True)
        loss = self.loss()
        loss.backward()
        if self.row.hybrid:
            self.opt.observe_loss(loss.detach())

    def closure(self):
        self.opt.zero_grad()
        loss = self.loss()
        loss.backward()
        return loss

    def step(self):
        if self.row.closure:
            self.opt.step(self.closure)
        else:
            self.opt.step()

    def close(self):
        if hasattr(self.opt, "remove_hooks"):
            self.opt.remove_hooks()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _round(contender, device):
    """Seconds per step over one round of ``steps_per_round`` steps (preparation untimed)."""
    total, k = 0.0, contender.steps_per_round
    for _ in range(k):
        contender.prepare()
        _sync(device)
        start = time.perf_counter()
        contender.step()
        _sync(device)
        total += time.perf_counter() - start
    return total / k


def _memory(contender):
    by_key, scalars = measured_bytes(contender.opt)
    closed = contender.row.closed_form(contender.model)
    return {"bytes_per_param": sum(by_key.values()) / contender.n,
            "closed_form_bytes_per_param": sum(closed.values()) / contender.n,
            "by_key": by_key, "closed_form_by_key": closed, "scalar_bytes": scalars,
            "matches": by_key == closed}


def run_size(rows, make, repeats, device, ns_dtype, group=GROUP):
    """{row name: {memory..., "seconds", "adamw_seconds", "ratio"}} on one model size."""
    baseline, results = rows[0], {}
    timed = [r for r in rows[1:] if not r.closure]
    for r in rows[1:]:
        if r.closure:  # memory only: two steps through the closure
            c = Contender(r, make, device, ns_dtype)
            c.step(), c.step()
            results[r.name] = {**_memory(c), "seconds": None, "ratio": None}
            c.close()
    for start in range(0, max(len(timed), 1), group - 1):
        chunk = [baseline] + timed[start:start + group - 1]
        contenders = [Contender(r, make, device, ns_dtype) for r in chunk]
        times = {c.row.name: [] for c in contenders}
        for c in contenders:  # warm-up: state creation, the first factor update (any
            c.prepare()       # INV_FREQ consecutive steps after it hold one more)
            c.step()
            if not c.row.kronecker:
                one = _round(c, device)
                c.steps_per_round = max(1, min(100, math.ceil(MIN_ROUND_SECONDS / one)))
        for _ in range(repeats):
            for c in contenders:
                times[c.row.name].append(_round(c, device))
        ref = statistics.median(times[baseline.name])
        print(f"  timed: {', '.join(c.row.name for c in contenders[1:])}", file=sys.stderr,
              flush=True)
        for c in contenders:
            t = statistics.median(times[c.row.name])
            entry = {**_memory(c), "seconds": t, "adamw_seconds": ref, "ratio": t / ref,
                     "steps_per_round": c.steps_per_round}
            if c.row is baseline:
                results.setdefault(baseline.name, {**entry, "runs": []})["runs"].append(t)
            else:
                results[c.row.name] = entry
            c.close()
        del contenders
    if baseline.name in results:  # AdamW's time: the median over its groups
        results[baseline.name]["seconds"] = statistics.median(results[baseline.name]["runs"])
        results[baseline.name]["ratio"] = 1.0
    return {r.name: results[r.name] for r in rows if r.name in results}


def run(sizes, repeats, device, ns_dtype, rows=None, on_size=None):
    """The report: machine line, rows not available in this tree, and per size the results
    (``rows``: default ``ROWS``; ``on_size(report)`` after each size: a partial report)."""
    rows = ROWS if rows is None else rows
    available = [r for r in rows if not r.missing()]
    report = {"date": datetime.date.today().isoformat(), "device": str(device),
              "cpu": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "torch": torch.__version__,
              "load_average": os.getloadavg()[0], "repeats": repeats,
              "ns_dtype": str(ns_dtype).replace("torch.", ""),
              "not_available": {r.name: r.missing() for r in rows if r.missing()},
              "sizes": {}}
    for name in sizes:
        label, make = SIZES[name]
        n_params = sum(p.numel() for p in make()[0].parameters())
        start = time.perf_counter()
        print(f"{label}: {len(available)} rows", file=sys.stderr, flush=True)
        results = run_size(available, make, repeats, device, ns_dtype)
        report["sizes"][name] = {"label": label, "params": n_params,
                                 "seconds_to_run": time.perf_counter() - start, "rows": results}
        report["load_average_end"] = os.getloadavg()[0]
        if on_size is not None:
            on_size(report)
    return report


def _cell(entry):
    if entry["seconds"] is None:
        return "— | —"
    return f"{entry['seconds'] * 1e3:.2f} | {entry['ratio']:.2f}"


def table(report):
    """The Markdown table: per size bytes/param measured (= or ≠ the closed form), step ms,
    ÷ AdamW."""
    sizes = report["sizes"]
    head = "| optimizer, option | " + " | ".join(
        f"{s['label']}: B/param | ms | ÷ AdamW" for s in sizes.values()) + " |"
    lines = [head, "|---" * (1 + 3 * len(sizes)) + "|"]
    names = list(next(iter(sizes.values()))["rows"]) if sizes else []
    for name in names:
        cells = []
        for s in sizes.values():
            e = s["rows"][name]
            mark = "" if e["matches"] else f" ≠ {e['closed_form_bytes_per_param']:.3f}"
            cells.append(f"{e['bytes_per_param']:.3f}{mark} | {_cell(e)}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    machine = (f"{report['date']}, {report['device']} ({report['cpu']}), torch threads "
               f"{report['threads']}, torch {report['torch']}, load average {report['load_average']:.1f} "
               f"at the start and {report.get('load_average_end', float('nan')):.1f} at the "
               f"end, median of {report['repeats']} interleaved rounds, Newton–Schulz "
               f"in {report['ns_dtype']}")
    missing = "; ".join(f"{n} (needs {', '.join(m)})"
                        for n, m in report["not_available"].items()) or "none"
    every = all(e["matches"] for s in sizes.values() for e in s["rows"].values())
    return "\n".join([f"Measured {machine}.", "", *lines, "",
                      "Every measured count equals its closed form." if every else
                      "**A measured count differs from its closed form (≠ above).**",
                      f"Rows not available in this tree: {missing}."])


def write_page(report, page=PAGE, json_out=JSON_OUT):
    """Replace the text between the markers of ``page`` with the table; write the JSON."""
    text = page.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"{page}: needs exactly one {BEGIN!r} and one {END!r}")
    before, rest = text.split(BEGIN)
    after = rest.split(END)[1]
    page.write_text(f"{before}{BEGIN}\n{table(report)}\n{END}{after}")
    json_out.write_text(json.dumps(report, indent=1) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m figures.bench.state_memory",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ns-dtype", choices=["float32", "bfloat16"], default=None,
                        help="Newton-Schulz of MARS-Shampoo / MARS-M (default: bfloat16 on "
                             "CUDA, float32 on a CPU, where bf16 matmuls may be emulated)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's); 1 is steadier on a machine "
                             "that other jobs load")
    parser.add_argument("--json", help="also write the JSON document here")
    parser.add_argument("--write-page", action="store_true",
                        help="write the table into figures/bench/README.md and the JSON into "
                             "figures/bench/state_memory.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    ns = args.ns_dtype or ("bfloat16" if device.type == "cuda" else "float32")
    def save(partial):  # a long run keeps what it measured so far
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(partial, indent=1) + "\n")
    report = run(args.sizes, args.repeats, device, getattr(torch, ns), on_size=save)
    print(table(report))
    if args.write_page:
        write_page(report)
    emit_json(report, args.json)
    return report


if __name__ == "__main__":
    main()
