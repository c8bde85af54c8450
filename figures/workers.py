"""The worker processes of ``python -m figures --jobs N`` (a module of its own: spawned workers
find a function by its module, and ``figures/__main__.py`` run by ``python -m`` is ``__main__``,
which they do not re-import)."""
import concurrent.futures
import contextlib
import io
import multiprocessing


def pool(jobs):
    """``jobs`` spawned worker processes (each imports torch once, ~5 s of a core)."""
    return concurrent.futures.ProcessPoolExecutor(
        jobs, mp_context=multiprocessing.get_context("spawn"))


def build(name, argv):
    """One ``python -m figures ARGV`` inside a worker; returns its lines about ``name``."""
    from .__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(argv)
        except SystemExit as exit:  # BLOCKED: main says so in its lines, then exits non-zero
            if "BLOCKED" not in out.getvalue():
                raise RuntimeError(f"python -m figures {' '.join(argv)} exited ({exit.code}):\n"
                                   f"{out.getvalue()[-3000:]}") from None
    return [line for line in out.getvalue().splitlines() if line.startswith(f"[{name}]")]
