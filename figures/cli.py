"""``python -m figures``: regenerate every convergence figure (PNG + CSV + JSON) and
``summary.md``, and compare them with the committed outputs (``DESCRIPTION`` and ``EPILOG``
below are the ``--help`` text; figures/README.md has the measured running times and what
each figure reproduces).
"""
import argparse
import concurrent.futures
import contextlib
import importlib
import io
import json
import multiprocessing
import pathlib
import shlex
import shutil
import sys
import time

from . import common as C
from . import repro
from .progress import HEARTBEAT, Progress
from .catalogue import FIGURES  # the figures' names, in summary.md's order
from .summary import write_summary, write_tuned

# The --help text: complete sentences, paragraphs kept as written (a test checks that none
# is cut off).
DESCRIPTION = """\
Regenerate every convergence figure (a PNG, a CSV and a JSON per figure, and summary.md) and
compare the new outputs with the committed ones. While it runs, a [progress] line says when
each figure starts and finishes and about how long is left (from recorded durations, in quick
mode).

Quick mode (the default) runs on a CPU in minutes, with the learning rates committed in
figures/out/quick/tuned_lr.json (swept at the quick budgets). --full runs the paper-quality
budgets and sweeps every learning rate itself (hours on a CPU); --tune sweeps at the chosen
mode's budget.

Outputs go to the git-ignored folder figures/out/fresh/quick (figures/out/fresh/full with
--full), so that a regeneration leaves every tracked file as it was. --update writes into the
committed folder figures/out/quick (figures/out/full) instead, and a tuning run's learning
rates into the committed tuned JSON."""
EPILOG = """\
Reproduction: after the run, every figure built is compared with its committed outputs
(not after --seeds, --tuned-json, --tune-curves, --tune in quick mode, a --device other than
cpu, --tiny or --no-compare: those are not the committed configuration). In the environment
those were made in (the same CPU model and instruction set, torch thread count and library
versions) every value must agree bit for bit, a number to within 4 units in its last place;
elsewhere every curve point must lie within
the figure's declared tolerance (figures/repro.py). Timings, dates and the PNGs are not
compared. A figure that moved further is reported as DRIFT and the command exits non-zero;
with --update the comparison only reports what changed. What each figure reproduces, and
how each tolerance was derived: figures/README.md, section "Reproducibility"."""

# Relative cost of each quick figure (seconds of one measured run of ``python -m figures
# --jobs 2``, see figures/README.md), to start the slowest first when ``--jobs`` builds
# figures in parallel and for the progress lines' estimate (which rescales them by the speed
# of the run at hand).
QUICK_SECONDS = {"orthogonalisers": 304, "shakespeare_gpt": 251, "budget_scan": 38,
                 "mnist1d_mlp": 34, "bert_mlm": 16, "digits_cnn": 12, "rank1_approximation": 7,
                 "cost": 5, "noisy_quadratic": 5, "variance_reduction": 3,
                 "curvature_distance": 30, "low_precision": 30}
# Seconds of drawing a split figure from its saved parts (nothing is trained; under a second
# measured), for the progress estimate only.
DRAW_SECONDS = 1
# Figures whose runs are trained in --jobs parts by parallel_figures (every run of theirs goes
# through common.run_curves): the char-GPT alone would take longer than all the others.
SPLIT = ("shakespeare_gpt",)


def parser():
    """The command line's parser (``--help`` prints ``DESCRIPTION``, the options, ``EPILOG``)."""
    p = argparse.ArgumentParser(prog="python -m figures", description=DESCRIPTION,
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true",
                   help="Paper-quality budgets, more seeds and lr sweeps (far longer than quick "
                        "mode).")
    p.add_argument("--tiny", action="store_true",
                   help="A few steps of everything, for the tests (written to figures/out/tiny; "
                        "nothing is compared).")
    p.add_argument("--only", action="append", choices=FIGURES, metavar="NAME",
                   help=f"Build only this figure (repeatable): {', '.join(FIGURES)}.")
    p.add_argument("--device", default="cpu", help="Torch device, e.g. cuda.")
    p.add_argument("--seeds", type=int, default=None, help="Seeds per curve (default by mode).")
    p.add_argument("--out", default=None,
                   help="Output folder (default: figures/out/fresh/quick, figures/out/fresh/full "
                        "with --full, figures/out/tiny with --tiny; all git-ignored).")
    p.add_argument("--update", action="store_true",
                   help="Write into the committed outputs (figures/out/quick, figures/out/full "
                        "with --full) and, when tuning, the committed tuned JSON; the comparison "
                        "then reports what changed and does not fail the command.")
    p.add_argument("--no-compare", action="store_true",
                   help="Do not compare the outputs with the committed ones.")
    p.add_argument("--tune", action="store_true",
                   help="Sweep every lr at this mode's budget (implied by --full) and write "
                        "the tuned JSON (to the output folder; with --update, the committed "
                        "one).")
    p.add_argument("--tune-curves", nargs="+", metavar="LABEL",
                   help="With --tune: re-tune only these curve labels, keep the rest.")
    p.add_argument("--tuned-json", default=None,
                   help="Tuned-lr JSON to read (and, when tuning, to write); default "
                        "figures/out/full/tuned_lr.json with --full, else "
                        "figures/out/quick/tuned_lr.json, each falling back to the other for "
                        "curves it lacks.")
    p.add_argument("--threads", type=int, default=1,
                   help="Torch CPU threads (default 1: these models are small, so extra "
                        "threads mostly add overhead, and the committed outputs were made with "
                        "one).")
    p.add_argument("--jobs", type=int, default=1,
                   help="With --tune or --full: run the lr sweeps in this many subprocesses, "
                        "one curve each at a time (results identical to --jobs 1), then draw "
                        "the figures with the tuned values (the char-GPT's reported runs "
                        "trained in this many parts); budget_scan runs all its training "
                        "runs, sweeps included, on this many processes. Without tuning: "
                        "build the figures on this many worker processes, slowest first, the "
                        "char-GPT's runs split among them.")
    # the --jobs workers' options: sweep only; train part K of N of a figure's runs (saved
    # to --parts-dir) or draw it from the saved parts; leave summary.md (and the comparison)
    # to the parent; read the lrs from the tuned JSON even with --full (the parent swept
    # them), from --read-tuned when the parent wrote them there (the fallback kept)
    p.add_argument("--sweep-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--parts-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-summary", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-tune", action="store_true", help=argparse.SUPPRESS)  # parent swept
    p.add_argument("--read-tuned", default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-progress", action="store_true",
                   help="No progress bars (the [progress] lines stay).")
    return p


def parse(argv):
    p = parser()
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.update and args.tiny:
        p.error("--update: tiny mode has no committed outputs")
    if args.update and args.out:
        p.error("--update writes the committed outputs; --out names another folder")
    return args


def not_compared(args, mode):
    """Why this run is not compared with the committed outputs (None: it is)."""
    if C.committed_dir(mode) is None:
        return "tiny mode has no committed outputs"
    if args.no_compare:
        return "--no-compare"
    if args.device != "cpu":
        return f"the committed outputs are CPU runs, this one ran on {args.device}"
    if args.seeds is not None:
        return "--seeds: not the committed seeds"
    if args.tuned_json or args.tune_curves or (args.tune and mode != "full"):
        return "the learning rates are not the committed ones (--tune, --tuned-json)"
    return None


def command_line(argv):
    """The command as typed, recorded in every figure JSON and summary.md (a --jobs worker
    records its parent's: a command that reruns as written)."""
    return " ".join(["python -m figures"] + [shlex.quote(a) for a in argv])


def main(argv=None, command=None):
    """``python -m figures ARGV``; ``command``: the command line to record (default: this
    one; a --jobs worker is given its parent's)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    mode = "tiny" if args.tiny else "full" if args.full else "quick"
    tune = (args.tune or args.full) and not args.no_tune
    out = pathlib.Path(args.out) if args.out else C.out_dir(mode, args.update)
    own, other = C.tuned_paths(mode)
    tuned_path = pathlib.Path(args.tuned_json or args.read_tuned or own)  # read
    # written when tuning: the committed JSON only when asked (--update or --tuned-json)
    tuned_out = (pathlib.Path(args.tuned_json) if args.tuned_json else
                 own if args.update else out / own.name)
    fallback = {} if args.tuned_json else C.load_tuned(other)
    if args.device == "cpu":
        import torch
        torch.set_num_threads(args.threads)
    committed = C.load_tuned(tuned_path)
    ctx = C.Context(mode=mode, device=args.device, seeds=args.seeds, out=out,
                    tune=tune, tuned=json.loads(json.dumps(committed)), tuned_path=tuned_out,
                    fallback=fallback,
                    tune_labels=frozenset(args.tune_curves) if args.tune_curves else None,
                    progress=not args.no_progress,
                    command=command or command_line(argv))
    ctx.sweep_only = args.sweep_only
    ctx.jobs = args.jobs  # budget_scan runs its own training runs on this many processes
    if args.part:
        k, n = map(int, args.part.split("/"))
        ctx.part = (k, n)
    ctx.parts_dir = pathlib.Path(args.parts_dir) if args.parts_dir else None
    worker = args.sweep_only or args.no_summary  # a --jobs worker: the parent compares
    why_not = None if worker else not_compared(args, mode)
    names = args.only or FIGURES
    built = list(names)
    # with --update the committed outputs are overwritten: compare with a copy made first
    before = (repro.snapshot(C.committed_dir(mode), built)
              if args.update and not worker and why_not is None else None)
    how = committed.get("meta", {}).get("how", "missing: grid centres, UNTUNED")
    lr_note = "lr swept now" if tune else f"lr from {tuned_path.name}: {how}"
    print(f"python -m figures: mode {mode}, device {args.device}; {lr_note}")
    if not worker:
        print(f"python -m figures: writing to {out}"
              + (" (the committed outputs: --update)" if args.update else ""))
    start = time.perf_counter()
    records = {}  # {task: how its sweeps were made}, for the tuned JSON
    blocked = []  # figures that could not be built: the exit status says so

    def record(name):
        module = importlib.import_module(f"figures.experiments.{name}")
        records[name] = dict(mode=mode, budget=getattr(module, "BUDGET", {}).get(mode),
                             date=C.stamp(), command=ctx.command, curves=sorted(ctx.swept[name]))

    if tune and args.jobs > 1 and not args.sweep_only:
        for task, entries in parallel_sweeps(args, mode, names).items():
            ctx.tuned.setdefault("tasks", {}).setdefault(task, {}).update(entries)
            ctx.tuned.setdefault("tasks_meta", {})[task] = dict(mode=mode)
            ctx.swept[task] = entries
            record(task)
        # written now, so the sweeps survive if the figure runs below are cut short
        if ctx.swept:  # (budget_scan alone sweeps nothing here: it tunes inside its run)
            write_tuned(ctx.swept, records, ctx.tune_labels, committed, tuned_out)
        ctx.tune = False  # the figures below use the values just swept
    parts = {}  # {figure: folder of its runs, trained in parts by the --jobs workers}
    if args.jobs > 1 and not args.sweep_only:
        if not tune and len(names) > 1:
            blocked = parallel_figures(args, argv, names, mode)
            names = ()  # built by the workers; the summary below reads their JSONs
        elif tune and any(n in SPLIT for n in names):  # the reported runs, after the sweeps
            read = tuned_out if ctx.swept else None  # where the parent wrote the sweeps
            parts = parallel_parts(args, argv, [n for n in names if n in SPLIT], read)
    progress = (Progress(names, 1, QUICK_SECONDS if mode == "quick" else {})
                if not worker and names else None)
    for name in names:
        t0 = time.perf_counter()
        if progress:
            progress.started(name)
        module = importlib.import_module(f"figures.experiments.{name}")
        ctx.parts_dir = parts.get(name, ctx.parts_dir)
        try:
            line, _ = module.run(ctx)
        except C.SweepFinished as done:
            line = f"swept {', '.join(done.args[0]) or 'nothing'}"
        except C.PartFinished as done:
            line = done.args[0]
        except ModuleNotFoundError as err:  # an optional data package is missing: say so
            line = f"BLOCKED: {err}"
            blocked.append(name)
        print(f"[{name}] {line} ({time.perf_counter() - t0:.0f} s)", flush=True)
        if progress:
            progress.finished(name)
        if name in ctx.swept and name not in records:
            record(name)
    if ctx.swept:
        write_tuned(ctx.swept, records, ctx.tune_labels, committed, tuned_out)
    for folder in parts.values():
        shutil.rmtree(folder, ignore_errors=True)
    if worker:
        if blocked:
            sys.exit(f"python -m figures: could not {'sweep' if ctx.sweep_only else 'build'} "
                     f"{', '.join(blocked)}")
        return
    lrs = tuned_out if ctx.swept and tuned_out.exists() else tuned_path
    write_summary(ctx.out, FIGURES, C.load_tuned(lrs), sorted(ctx.swept) if tune else [],
                  fallback, (lrs.name, other.name))
    print(f"python -m figures: done in {time.perf_counter() - start:.0f} s; "
          f"summary in {ctx.out / 'summary.md'}")
    drifted = []
    if why_not is None:
        against = before.name if before else C.committed_dir(mode)
        results = repro.compare([n for n in built if n not in blocked], out, against)
        for result in results:
            print(result.line(), flush=True)
        drifted = [r.figure for r in results if not r.ok]
        if before:
            before.cleanup()
            if drifted:
                print(f"python -m figures: --update rewrote {', '.join(drifted)} in {out}; "
                      f"`git diff --stat {out}` shows the files that changed")
    else:
        print(f"python -m figures: not compared with the committed outputs ({why_not})")
    if blocked:
        sys.exit(f"python -m figures: could not build {', '.join(blocked)}")
    if drifted and not args.update:
        sys.exit(f"python -m figures: {', '.join(drifted)} did not reproduce the committed "
                 f"outputs in {C.committed_dir(mode)} (DRIFT or MISSING above); if the change "
                 f"is intended, `python -m figures --update{' --full' if mode == 'full' else ''}"
                 f"` rewrites them")


def _worker_argv(argv):
    """``argv`` without --only NAME / --jobs N, plus what every worker runs with (once)."""
    rest, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
        elif a in ("--only", "--jobs"):
            skip = 1
        elif not a.startswith(("--only=", "--jobs=")):
            rest.append(a)
    return rest + [flag for flag in ("--no-progress", "--no-summary") if flag not in rest]


def _part_tasks(names, n_parts):
    """(seconds, name, extra argv) of each figure, a figure of ``SPLIT`` as ``n_parts``
    tasks, slowest first."""
    tasks = []
    for name in names:
        seconds = QUICK_SECONDS.get(name, 0)
        if name in SPLIT:
            tasks += [(seconds / n_parts, name, ["--part", f"{k}/{n_parts}"])
                      for k in range(n_parts)]
        else:
            tasks.append((seconds, name, []))
    return sorted(tasks, key=lambda t: -t[0])


def task_label(name, extra, n_parts):
    """How the progress lines name a task: the figure, one part of it, or its drawing."""
    if "--part" in extra:
        k = int(extra[extra.index("--part") + 1].split("/")[0])
        return f"{name} part {k + 1} of {n_parts}"
    return f"{name} (drawn from its parts)" if name in SPLIT else name


def _planned(names, n_parts):
    """Every task of :func:`parallel_figures` in the order submitted, the drawing of a split
    figure last, and {label: recorded seconds} (quick mode's)."""
    tasks = [(task_label(name, extra, n_parts), seconds)
             for seconds, name, extra in _part_tasks(names, n_parts)]
    tasks += [(task_label(name, [], n_parts), DRAW_SECONDS) for name in names if name in SPLIT]
    return [label for label, _ in tasks], dict(tasks)


def parallel_figures(args, argv, names, mode="quick"):
    """Build the figures on ``args.jobs`` worker processes, slowest first; a figure in
    ``SPLIT`` has its runs trained in ``args.jobs`` parts (saved to a temporary folder) and is
    drawn from them once all are in. Each run is seeded on its own, so the outputs are the
    serial ones (wall-clock aside). Workers are spawned once each, not one process per figure.
    Returns the figures that were BLOCKED; any other failure raises with the worker's error."""
    import tempfile

    rest = _worker_argv(argv)
    parts_dir = pathlib.Path(tempfile.mkdtemp(prefix="figures-parts-"))
    waiting = {name: args.jobs for name in names if name in SPLIT}  # parts still running
    blocked = []
    labels, recorded = _planned(names, args.jobs)
    progress = Progress(labels, args.jobs, recorded if mode == "quick" else {})
    starts = multiprocessing.get_context("spawn").Queue()  # each worker's task, as it starts
    pool = worker_pool(args.jobs, starts)
    try:
        def submit(name, extra):
            split = ["--parts-dir", str(parts_dir)] if name in SPLIT else []
            return pool.submit(build, name, [*rest, "--only", name, *split, *extra],
                               command_line(argv), task_label(name, extra, args.jobs))
        pending = {submit(name, extra): (name, extra)
                   for _, name, extra in _part_tasks(names, args.jobs)}
        while pending:
            done, _ = concurrent.futures.wait(pending, timeout=min(5.0, HEARTBEAT),
                                              return_when="FIRST_COMPLETED")
            _say_started(starts, progress)
            for future in done:
                name, extra = pending.pop(future)
                lines = future.result()
                label = task_label(name, extra, args.jobs)
                if label not in progress.running:  # its start is still in the queue's pipe
                    _say_started(starts, progress, until=label)
                progress.finished(label)
                if extra:  # a part: draw the figure once every part is saved (or say
                    waiting[name] -= 1  # BLOCKED, as the parts did)
                    if waiting[name] == 0:
                        pending[submit(name, [])] = (name, [])
                    continue
                for line in lines:
                    print(line, flush=True)
                if any("BLOCKED" in line for line in lines) and name not in blocked:
                    blocked.append(name)
            progress.heartbeat()
    finally:
        pool.shutdown(cancel_futures=True)
        shutil.rmtree(parts_dir, ignore_errors=True)
    return blocked


def _say_started(starts, progress, until=None, wait_s=10.0):
    """Report the tasks the workers said they started (``until``: wait for that one)."""
    import queue

    while True:
        try:
            label = starts.get(timeout=wait_s) if until else starts.get_nowait()
        except queue.Empty:
            return
        progress.started(label)
        if label == until:
            until = None


def parallel_parts(args, argv, names, read=None):
    """With tuning, after the sweeps: train the reported runs of each ``SPLIT`` figure in
    ``args.jobs`` parts on worker processes, at the lrs just written to the tuned JSON
    ``read`` (``--no-tune``). Returns {figure: folder of its saved parts}; the caller draws
    the figures from them and removes the folders."""
    import tempfile

    rest = _worker_argv(argv) + ["--no-tune"] + (["--read-tuned", str(read)] if read else [])
    folders = {name: pathlib.Path(tempfile.mkdtemp(prefix=f"figures-parts-{name}-"))
               for name in names}
    with worker_pool(args.jobs) as pool:
        futures = [pool.submit(build, name,
                               [*rest, "--only", name, "--parts-dir", str(folders[name]),
                                *extra], command_line(argv))
                   for _, name, extra in _part_tasks(names, args.jobs)]
        for future in futures:
            for line in future.result():
                print(line, flush=True)
    return folders


def parallel_sweeps(args, mode, names):
    """The lr sweeps of every tunable curve of ``names``, each in its own
    ``python -m figures --sweep-only`` subprocess, ``args.jobs`` at a time. The sweeps are
    the serial ones (same grids, tuning seeds and scores); returns {task: {label: sweep}}."""
    import subprocess
    import tempfile

    work = []
    for name in names:
        for spec in getattr(importlib.import_module(f"figures.experiments.{name}"), "SPECS", ()):
            if not spec.lr_from and (not args.tune_curves or spec.label in args.tune_curves):
                work.append((name, spec.label))
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="figures-sweeps-"))
    flags = {"full": ["--full"], "tiny": ["--tiny"]}.get(mode, [])

    def sweep(i, name, label):
        out = tmp / f"{i}.json"
        cmd = [sys.executable, "-m", "figures", "--sweep-only", "--tune", *flags, "--only", name,
               "--tune-curves", label, "--device", args.device, "--threads", str(args.threads),
               "--tuned-json", str(out), "--out", str(tmp / str(i)), "--no-progress"]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the sweep of {name} / {label} failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())["tasks"][name][label], time.perf_counter() - t0

    swept = {}
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(sweep, i, n, l): (n, l) for i, (n, l) in enumerate(work)}
        for k, future in enumerate(concurrent.futures.as_completed(futures), 1):
            (name, label), (entry, seconds) = futures[future], future.result()
            swept.setdefault(name, {})[label] = entry
            print(f"[sweep {k}/{len(work)}] {name} / {label}: lr {entry['lr']:.3g}"
                  f"{' (on the edge)' if entry['edge'] else ''} ({seconds:.0f} s)", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return {name: dict(sorted(entries.items())) for name, entries in swept.items()}


# -- the --jobs workers (spawned: they find build() by its module, figures.cli) --

_STARTS = None  # in a worker: the queue on which build() says which task it starts


def _remember(starts):
    global _STARTS
    _STARTS = starts


def worker_pool(jobs, starts=None):
    """``jobs`` spawned worker processes (each imports torch once); ``starts``: a queue
    each worker puts a task's label on as it starts it."""
    return concurrent.futures.ProcessPoolExecutor(
        jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_remember,
        initargs=(starts,))


def build(name, argv, command=None, label=None):
    """One ``python -m figures ARGV`` inside a worker, recording ``command`` (the parent's);
    returns its lines about ``name``."""
    if _STARTS is not None and label is not None:
        _STARTS.put(label)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(argv, command)
        except SystemExit as exit:  # BLOCKED: main says so in its lines, then exits non-zero
            if "BLOCKED" not in out.getvalue():
                raise RuntimeError(f"python -m figures {' '.join(argv)} exited ({exit.code}):\n"
                                   f"{out.getvalue()[-3000:]}") from None
    return [line for line in out.getvalue().splitlines() if line.startswith(f"[{name}]")]
