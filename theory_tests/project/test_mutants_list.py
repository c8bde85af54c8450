"""The curated mutant list (``theory_tests/mutation/mutants/``) follows the code and the claim index:
every key is a row of ``paper_notes/claims.md``, every mutant's text occurs exactly once in
its file (so it still applies), changes it, and every equivalent mutant says why. Running the
mutants is ``python -m theory_tests.mutation`` (minutes, not part of ``pytest``)."""
from pathlib import Path

import pytest

from theory_tests.mutation.harness import COPIED
from theory_tests.mutation.mutants import MUTANTS
from theory_tests.support.claims_table import claim_rows

ROOT = Path(__file__).resolve().parents[2]
ALL = [(row, i, m) for row, ms in MUTANTS.items() for i, m in enumerate(ms)]


def test_every_key_is_a_claim_row():
    ids = {row["id"] for row in claim_rows()}
    assert set(MUTANTS) <= ids, sorted(set(MUTANTS) - ids)


@pytest.mark.parametrize("row, index, mutant", ALL, ids=[f"{r}#{i}" for r, i, _ in ALL])
def test_each_mutant_still_applies(row, index, mutant):
    for path, old, new in mutant.edits():
        text = (ROOT / path).read_text()
        assert path.split("/")[0] in COPIED, f"{path}: the harness does not copy it"
        assert text.count(old) == 1, f"{row}#{index} {path}: the text occurs {text.count(old)} times"
        assert new != old
    assert mutant.equivalent is None or len(mutant.equivalent) > 10


def test_each_mutants_own_tests_exist():
    """A mutant that names its own tests (``tests=``) names test functions that are there: a
    moved or renamed test would make the harness report an error instead of a kill (with a
    parametrised test's id, its base name)."""
    from theory_tests.project.test_claims_index import check_test_target
    problems = [f"{row}#{index}: {error}" for row, index, mutant in ALL for target in mutant.tests
                if (error := check_test_target(target.split("[")[0]))]
    assert sum(len(m.tests) for _, _, m in ALL) > 20  # the check has targets to check
    assert not problems, problems
    assert check_test_target("theory_tests/mkor/test_torch_capture.py::test_x") is not None
