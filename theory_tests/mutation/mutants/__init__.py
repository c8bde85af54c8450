"""The curated mutants, one module per code area they mutate, merged by claims row:
``MUTANTS`` = {row id: [Mutant]} (``python -m theory_tests.mutation`` runs them).

A ``Mutant`` (``../mutant.py``) is an exact text replacement; ``tests`` (optional) replaces
the row's test column; ``equivalent`` (optional) says why a mutant cannot change behaviour,
and such a mutant is expected to survive. Each row that names code has at least one mutant
of it, in the oracle and in the port where each exists (``theory_tests/project/
test_claims_index.py``)."""
from ..mutant import Mutant
from . import (baselines, common, curvature, expert_parallel, figures, integrations, kronecker,
               kronecker_capture, kronecker_experts, low_precision, low_precision_factors,
               low_precision_quant, mars, mkor, peer_conventions, readme_and_packaging)

__all__ = ["Mutant", "MUTANTS"]

AREAS = (mars, mkor, kronecker, kronecker_capture, kronecker_experts, baselines, common,
         integrations, figures, peer_conventions, readme_and_packaging, curvature,
         low_precision, low_precision_quant, low_precision_factors, expert_parallel)

MUTANTS = {}
for _area in AREAS:
    for _row, _mutants in _area.MUTANTS.items():
        MUTANTS[_row] = MUTANTS.get(_row, []) + list(_mutants)
