"""Curated mutants of the figures' reproduction check (row FIG-REPRO of
``paper_notes/claims.md``): one-line bugs in what ``python -m figures`` writes and how it
compares a regeneration with the committed outputs (``figures/repro.py``, the default folder
of ``figures/common.py``, the exit status and help of ``figures/cli.py``). The format is
``mutant.Mutant``'s; the row's tests (``theory_tests/figures/test_repro.py``) kill each of them
without training a model.
"""
from .mutant import Mutant

R, C, CLI = "figures/repro.py", "figures/common.py", "figures/cli.py"

FIGURES_REPRO_MUTANTS = {
    "FIG-REPRO": [
        # a tolerance comparison that always passes
        Mutant(R, "        return abs(fresh - committed) <= self.bound(committed)",
               "        return abs(fresh - committed) <= self.bound(committed) + math.inf"),
        # bit for bit never expected: the committed environment falls back to the tolerance
        Mutant(R, "    return None not in a.values() and a == b",
               "    return False and a == b"),
        # the curve's own spread ignored: a sensitive curve gets the figure's median only
        Mutant(R, "        sd = max(curves.get((row[\"optimizer\"], metric), 0.0), "
                  "pooled.get(quantity(metric), 0.0))",
               "        sd = pooled.get(quantity(metric), 0.0)"),
        # the key columns (optimizer, lr, seed, step, ...) no longer compared
        Mutant(R, "        moved = [k for k in keys if new.get(k) != old[k]]",
               "        moved = []"),
        # the wall-clock column compared: every regeneration drifts
        Mutant(R, "        keys = [k for k in old if k not in (VALUE, TIMING)]",
               "        keys = [k for k in old if k not in (VALUE,)]"),
        # the default output folder is the committed one again
        Mutant(C, "    return committed_dir(mode) if update else FRESH / mode",
               "    return committed_dir(mode)"),
        # a drift no longer fails the command
        Mutant(CLI, "    if drifted and not args.update:", "    if drifted and args.update:"),
        # --help cut at the description's first line again
        Mutant(CLI, "description=DESCRIPTION,", "description=DESCRIPTION.splitlines()[0],"),
    ],
}
