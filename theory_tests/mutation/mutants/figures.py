"""Mutants of the figures' reproduction checks (``figures/``), keyed by the
``paper_notes/claims.md`` row whose tests must kill them (``theory_tests/mutation/mutant.py``
says what a mutant is)."""
from ..mutant import Mutant

__all__ = ["MUTANTS"]

F_CLI = "figures/cli.py"
F_COMMON = "figures/common.py"
F_REPRO = "figures/repro.py"


MUTANTS = {
    "FIG-REPRO": [
        # a tolerance comparison that always passes
        Mutant(F_REPRO, "        return abs(fresh - committed) <= self.bound(committed)",
               "        return abs(fresh - committed) <= self.bound(committed) + math.inf"),
        # bit for bit never expected: the committed environment falls back to the tolerance
        Mutant(F_REPRO, "    return None not in a.values() and a == b",
               "    return False and a == b"),
        # the curve's own spread ignored: a sensitive curve gets the figure's median only
        Mutant(F_REPRO, "        sd = max(curves.get((row[\"optimizer\"], metric), 0.0), "
                  "pooled.get(quantity(metric), 0.0))",
               "        sd = pooled.get(quantity(metric), 0.0)"),
        # the key columns (optimizer, lr, seed, step, ...) no longer compared
        Mutant(F_REPRO, "        moved = [k for k in keys if new.get(k) != old[k]]",
               "        moved = []"),
        # the wall-clock column compared: every regeneration drifts
        Mutant(F_REPRO, "        keys = [k for k in old if k not in (VALUE, TIMING)]",
               "        keys = [k for k in old if k not in (VALUE,)]"),
        # the default output folder is the committed one again
        Mutant(F_COMMON, "    return committed_dir(mode) if update else FRESH / mode",
               "    return committed_dir(mode)"),
        # a drift no longer fails the command
        Mutant(F_CLI, "    if drifted and not args.update:", "    if drifted and args.update:"),
        # --help cut at the description's first line again
        Mutant(F_CLI, "description=DESCRIPTION,", "description=DESCRIPTION.splitlines()[0],"),
    ],
}
