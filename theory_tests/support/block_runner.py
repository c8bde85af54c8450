"""Runs documentation blocks one by one, each as if pasted into a fresh ``python``.

A runner process is started like a newcomer's interpreter (from a folder outside the checkout,
with only what the install puts on the path); it imports torch, torch_impl, numpy and, when
present, transformers once -- the seconds a fresh interpreter spends per block -- and
``torch._dynamo``, which torch's optimizers import at their first step (~1.5 s of CPU that
every block stepping one paid), and runs nothing.  For each block it forks a child, which changes to the block's folder and executes the
block in a new ``__main__`` namespace: names come only from the block's own imports (a module
already loaded is found in ``sys.modules``, as a second ``import`` of it would be, but nothing
is bound in the namespace), and what the install does not bring (``reference``, ``figures``,
``theory_tests``) is importable only from the clone's root.  The runner never runs an
operator, so no thread pool exists when it forks.

Protocol: one JSON line per block on stdin, ``{"code", "cwd"}``; one JSON line back,
``{"rc", "stderr"}`` (the block's stdout and stderr together)."""
import json
import os
import subprocess
import sys
import tempfile

SERVER = r'''
import json, os, sys, tempfile, traceback
import numpy, torch, torch_impl  # noqa: F401  (a fresh interpreter's import time, paid once)
import torch._dynamo  # noqa: F401  (imported by an optimizer's first step: once, not per block)
try:
    import transformers  # noqa: F401
except ImportError:
    pass
reply = os.fdopen(os.dup(1), "w")  # kept apart from fd 1, which a child redirects
for line in sys.stdin:
    job = json.loads(line)
    with tempfile.TemporaryFile(mode="w+") as err:
        pid = os.fork()
        if pid == 0:
            os.dup2(err.fileno(), 1)  # the block's prints: not on the reply channel
            os.dup2(err.fileno(), 2)
            sys.stdout = os.fdopen(1, "w", closefd=False)
            code = 0
            try:
                os.chdir(job["cwd"])
                exec(compile(job["code"], "<block>", "exec"), {"__name__": "__main__"})
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else 1
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        err.seek(0)
        reply.write(json.dumps({"rc": os.waitstatus_to_exitcode(status), "stderr": err.read()})
                    + "\n")
        reply.flush()
'''


class BlockRunner:
    """``run(code, cwd)`` -> (exit code, stderr) of ``code`` run alone (module docstring)."""

    def __init__(self, env, start_in):
        self._proc = subprocess.Popen([sys.executable, "-c", SERVER], cwd=start_in, env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)

    def run(self, code, cwd):
        self._proc.stdin.write(json.dumps({"code": code, "cwd": str(cwd)}) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the block runner died: {self._proc.stderr.read()[-3000:]}")
        reply = json.loads(line)
        return reply["rc"], reply["stderr"]

    def close(self):
        self._proc.stdin.close()
        self._proc.wait(timeout=60)
