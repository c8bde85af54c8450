"""Mutation harness: every claim's tests must kill every mutant of the code the claim names.

    python -m theory_tests.mutation [--jobs 2] [--only ID ...] [--list] [--json FILE]

A mutant (``theory_tests/mutation/mutants/``, one module per code area) is a one-line bug in the math a row of
``paper_notes/claims.md`` covers: an exact text replacement in one file of ``reference/`` or
``torch_impl/``. For each mutant the harness copies the project's code to a temporary
directory (one per worker, made once), applies the replacement there (the working tree is
never touched; a mutant shared by the oracle and the port edits both files), runs the row's
tests (the ``test`` column, or the mutant's own ``tests``) against the copy with ``pytest -x``,
and reverts it. A mutant is *killed* when the tests fail, *survives* when they pass; the
command exits non-zero if any mutant not marked ``equivalent`` survives, or if one no longer
applies (its text is gone: the list must follow the code). Equivalent mutants (a change that
cannot alter behaviour) stay in the list with the reason and are expected to survive.

Why a runner of our own rather than mutmut or cosmic-ray: those generate every operator
mutation of every line and run the whole suite against each, hours on two cores, and their
mutants are not tied to a claim. Here each claim names its own curated mutants and runs only
its own tests, so the whole list runs in minutes and a surviving mutant points at the claim
whose tests are too weak.
"""
import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from theory_tests.support.claims_table import TARGET_RE, claim_rows

ROOT = Path(__file__).resolve().parents[2]

COPIED = ("reference", "torch_impl", "theory_tests", "figures", "paper_notes", "pyproject.toml",
          "README.md", "LICENSE", ".ci", ".gitignore")


def row_tests(row_id):
    """The test targets of a claims.md row (``theory_tests/<folder>/test_x.py::test_y``)."""
    for row in claim_rows():
        if row["id"] == row_id:
            return [t for t in TARGET_RE.findall(row["test"]) if "::" in t]
    raise KeyError(f"no claims.md row {row_id!r}")


def _copy_project(dest):
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "*.png", "*.csv",
                                    "*.csv.gz", "full")
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, dest / name)


def _pytest_ids(tests):
    """pytest node ids: a whole file when a target names a parametrised test's base name."""
    return [t.split("[")[0] for t in tests]


# A worker process that imports the heavy dependencies once, then forks one child per run:
# each child imports the project afresh from the copy (the server never imports it).
_SERVER = r"""
import json, os, sys
import numpy, torch, pytest, hypothesis, sympy  # noqa: F401  (preloaded once)
try:
    import transformers, transformers.modeling_utils  # noqa: F401
except ImportError:
    pass
assert not any(m.split(".")[0] in ("torch_impl", "reference") for m in sys.modules)
workdir, log = sys.argv[1], sys.argv[2]
for line in sys.stdin:
    args = json.loads(line)
    pid = os.fork()
    if pid == 0:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.chdir(workdir)
        sys.path.insert(0, workdir)
        code = pytest.main(args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(code))
    _, status = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
"""


class Workspace:
    """One copy of the project per worker, made once, and its test server; each mutant is
    applied to the copy, run and reverted (the original text is written back), so a mutant
    never outlives its run."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="mutants-"))
        _copy_project(self.dir)
        self.log = self.dir / "pytest.log"
        env = dict(os.environ, PYTHONPATH=str(self.dir), PYTHONDONTWRITEBYTECODE="1",
                   HYPOTHESIS_PROFILE="mutants")  # no shrinking: one failing example kills
        # The copy must shadow an editable install of the project: check that it does.
        probe = subprocess.run([sys.executable, "-c", "import torch_impl, reference; "
                                "print(torch_impl.__file__); print(reference.__file__)"],
                               cwd=self.dir, env=env, capture_output=True, text=True)
        if not all(line.startswith(str(self.dir)) for line in probe.stdout.split()):
            raise RuntimeError(f"the copy is not what imports: {probe.stdout!r} {probe.stderr}")
        self.server = subprocess.Popen([sys.executable, "-c", _SERVER, str(self.dir),
                                        str(self.log)], cwd=self.dir, env=env, text=True,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def close(self):
        self.server.stdin.close()
        self.server.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _pytest(self, args):
        self.server.stdin.write(json.dumps(args) + "\n")
        self.server.stdin.flush()
        code = json.loads(self.server.stdout.readline())
        lines = self.log.read_text(errors="replace").strip().splitlines()
        return code, lines[-1:] if lines else []

    def run(self, row_id, index, mutant):
        """Apply one mutant, run its tests, revert; returns a result dict."""
        tests = mutant.tests or row_tests(row_id)
        start = time.perf_counter()
        result = dict(row=row_id, index=index, path=mutant.path, tests=list(tests),
                      files=sorted({path for path, _, _ in mutant.edits()}))
        originals = {path: (self.dir / path).read_text() for path in result["files"]}
        mutated = dict(originals)
        for path, old, new in mutant.edits():
            count = mutated[path].count(old)
            if count != 1:
                return dict(result, status="stale", seconds=0.0,
                            detail=f"{path}: the text to replace occurs {count} times")
            mutated[path] = mutated[path].replace(old, new)
        try:
            for path, text in mutated.items():
                (self.dir / path).write_text(text)
            # -n 0: in this process, no xdist workers (pyproject's addopts ask for 2); the
            # harness already runs --jobs mutants in parallel.
            code, tail = self._pytest(["-x", "-q", "-p", "no:cacheprovider", "--no-header",
                                       "-n", "0", "-m", "not cuda", *_pytest_ids(tests)])
        finally:
            for path, text in originals.items():
                (self.dir / path).write_text(text)
        if code == 1:
            status = "killed"
        elif code == 0:
            status = "equivalent" if mutant.equivalent else "survived"
        else:
            status = "error"
        return dict(result, status=status, detail=tail[0] if tail else "",
                    seconds=time.perf_counter() - start)


def clock(seconds):
    """``m:ss``."""
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def progress(done, total, elapsed):
    """``[done/total m:ss, about m:ss left]``: the time left at the mean wall time per mutant
    so far (the workers run side by side, so it is wall time, not the sum of their runs)."""
    left = elapsed / done * (total - done) if done else 0.0
    return f"[{done}/{total} {clock(elapsed)}, about {clock(left)} left]"


def main(mutants, argv=None):
    """Run ``mutants`` ({claim id: [Mutant]}, ``mutants.MUTANTS``); the command line is
    ``python -m theory_tests.mutation``."""
    parser = argparse.ArgumentParser(prog="python -m theory_tests.mutation", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", nargs="*", help="claim ids to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    todo = [(row, i, m) for row, ms in mutants.items() for i, m in enumerate(ms)
            if not args.only or row in args.only]
    if args.list:
        for row, i, m in todo:
            print(f"{row}#{i} {m.path}: {m.old.strip()!r} -> {m.new.strip()!r}"
                  + (f" (equivalent: {m.equivalent})" if m.equivalent else ""))
        return 0
    start = time.perf_counter()
    print(f"{len(todo)} mutants to run on {max(1, args.jobs)} worker(s)", flush=True)
    results, queue = [], list(todo)
    lock = threading.Lock()

    def worker():
        space = Workspace()
        try:
            while True:
                with lock:
                    if not queue:
                        return
                    row, i, m = queue.pop(0)
                r = space.run(row, i, m)
                with lock:
                    results.append(r)
                    where = progress(len(results), len(todo), time.perf_counter() - start)
                    print(f"{where} [{r['status']:>10}] {r['row']}#{r['index']} {r['path']} "
                          f"({r['seconds']:.0f} s) {r['detail']}", flush=True)
        finally:
            space.close()

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for future in [pool.submit(worker) for _ in range(max(1, args.jobs))]:
            future.result()
    by_file = {}
    for r in results:
        counts = by_file.setdefault(" + ".join(r["files"]), {})
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print("\n| file | " + " | ".join(("killed", "survived", "equivalent", "stale", "error"))
          + " |\n|---|---|---|---|---|---|")
    for path, counts in sorted(by_file.items()):
        print(f"| {path} | " + " | ".join(str(counts.get(k, 0)) for k in
                                          ("killed", "survived", "equivalent", "stale", "error"))
              + " |")
    bad = [r for r in results if r["status"] in ("survived", "stale", "error")]
    print(f"\n{len(results)} mutants in {time.perf_counter() - start:.0f} s: "
          f"{sum(r['status'] == 'killed' for r in results)} killed, "
          f"{sum(r['status'] == 'equivalent' for r in results)} equivalent, {len(bad)} not "
          "killed")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if bad else 0

