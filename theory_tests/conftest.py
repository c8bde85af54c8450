"""Shared pytest configuration: hypothesis profiles and device parametrisation.

Hypothesis profiles (select with ``HYPOTHESIS_PROFILE=<name>``):

* ``fast`` (default): few examples, derandomised, so CI is quick and reproducible.
* ``thorough``: many examples and a fresh random seed each run, for local hunting.
* ``mutants``: ``fast`` without the shrink phase, for the mutation harness (a killed mutant
  needs one failing example, not the smallest one; shrinking cost minutes per mutant).
"""
import os
import pathlib

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

settings.register_profile(
    "fast",
    max_examples=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough",
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "mutants",
    parent=settings.get_profile("fast"),
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fast"))

# The suite's tensors are tiny: one intra-op thread beats two (OpenMP workers spin on a busy
# 2-core machine, measured ~10x slower), and results do not depend on the thread count.
torch.set_num_threads(1)


@pytest.hookimpl(trylast=True)  # after the test's fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    """Back to one thread after every test: a script a test runs may set its own count (the
    benchmark scripts ask for 2), which would otherwise hold for every later test on that
    xdist worker (two threads on the busy 2-core machine: ~3x the CPU time, measured on
    figures.bench.self_check_cost)."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def pytest_addoption(parser, pluginmanager):
    """pyproject's addopts run the suite on 2 xdist workers (``-n 2 --dist ...``). Where xdist
    is not loaded (``-p no:xdist``), accept those two options and ignore them, so the run is
    simply serial instead of an "unrecognized arguments" error. (``-n0`` also runs serially.)
    """
    if not pluginmanager.has_plugin("xdist"):
        group = parser.getgroup("xdist", "xdist absent (-p no:xdist): -n and --dist are ignored")
        # _addoption: a lower-case short option, as xdist itself registers -n
        group._addoption("-n", "--numprocesses", dest="numprocesses", default=None,
                         help="ignored: xdist is not loaded")
        group.addoption("--dist", dest="dist", default="no", help="ignored: xdist is not loaded")


# The folders whose tests run first, in this order; the rest follow in collection order. Their
# tests are the suite's longest (forked gloo ranks, torchtitan's debug model, the figures' tiny
# runs). xdist's worksteal hands each worker a contiguous half of the collection and steals
# from the tail of a worker's queue, so a long test queued last leaves the other worker idle
# at the end (simulated on measured per-test times: ~10 s of the default run's wall time).
FIRST = ("integrations", "distributed", "figures")
HERE = pathlib.Path(__file__).parent


@pytest.hookimpl(trylast=True)  # after deselection and pytest's own fixture-scope ordering
def pytest_collection_modifyitems(items):
    """The tests under ``FIRST`` first (a stable sort: a module's tests stay together and in
    their order, so a module-scoped fixture still runs once per worker)."""
    def rank(item):
        try:
            folder = item.path.relative_to(HERE).parts[0]
        except ValueError:  # not under theory_tests/
            return len(FIRST)
        return FIRST.index(folder) if folder in FIRST else len(FIRST)
    items.sort(key=rank)


CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda,
           pytest.mark.skipif(not CUDA, reason="no CUDA device present")])]


@pytest.fixture(params=DEVICES)
def device(request):
    """Every device this machine has: ``cpu`` always, ``cuda`` when present (else skipped)."""
    return torch.device(request.param)
