"""One mutant: an exact text replacement in one file (``old`` occurs there exactly once), or
several applied together (``also``: a bug shared by the oracle and the port, which a
differential test cannot see). Lists of them: ``mutants/``, one module per code area (``mars``,
``mkor``, ``kronecker``, ``kronecker_capture``, ``kronecker_experts``, ``baselines``, ``common``,
...), keyed by claims row; the runner: ``harness.py``."""
from dataclasses import dataclass

__all__ = ["Mutant"]


@dataclass(frozen=True)
class Mutant:
    path: str
    old: str
    new: str
    tests: tuple = ()
    equivalent: str = None
    also: tuple = ()  # further (path, old, new) edits applied together (a bug shared by
    #                   the oracle and the port, which differential tests cannot see)

    def edits(self):
        """Every (path, old, new) this mutant applies."""
        return ((self.path, self.old, self.new),) + tuple(self.also)
