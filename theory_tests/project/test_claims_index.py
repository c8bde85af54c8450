"""The claim index, ``paper_notes/claims.md``, is checked against the code and the notes.

* Every reference/torch target ``package.module::Name.attr`` imports and resolves.
* Every test target ``theory_tests/<folder>/test_x.py::test_y`` names a ``def test_y`` in that file
  (found with ``ast``; nothing is run).
* Every id that ``paper_notes/mars.md`` or ``paper_notes/mkor.md`` mentions (M#, MT#, K#, KT#,
  Lemma #.#, "Algorithm 1 line(s) N") is covered by the source column of some row.
* A row without a test says why in its reference column ("—" and a reason).
* Every row that names code has a mutant of it (``theory_tests/mutation/``): a row
  naming oracle code has one editing ``reference/``, a row naming port code one editing
  ``torch_impl/`` (``python -m theory_tests.mutation`` checks that its tests kill them).
* The notes' own path-form references (``reference/x.py::name``, ``torch_impl/x.py::name``) and
  test references (``test_x.py::test_y``) resolve too, so a rename anywhere is caught.

The cell syntax is documented at the top of ``paper_notes/claims.md``. Only files inside the
project are read.
"""
import ast
import functools
import importlib
import re
from pathlib import Path

import pytest

from theory_tests.support.claims_table import NONE, ROOT, TARGET_RE, claim_rows

NOTES = ROOT / "paper_notes"
SOURCES = [NOTES / "mars.md", NOTES / "mkor.md"]
TESTS = ROOT / "theory_tests"

ID_RE = re.compile(
    r"\bMT\d+(?:\([a-f]\))?"                       # MT13, MT13(c)
    r"|\bKT\d+\b|\bM\d+\b|\bK\d+\b"                # KT11, M4, K9
    r"|\bLemma \d+\.\d+"                           # Lemma 3.1
    r"|\b(?:Algorithm|Alg\.) ?1,? lines? \d+(?:\s*[-–]\s*\d+)?")  # Algorithm 1 line 7, lines 5-6
ID_RANGE_RE = re.compile(r"\b(MT|KT|M|K)(\d+)\s*[–-]\s*\1(\d+)\b")  # K2–K14
ALG_RE = re.compile(r"lines? (\d+)(?:\s*[-–]\s*(\d+))?")
ROW_ID_RE = re.compile(r"^[A-Za-z0-9.()\-–]+$")


# ---------------------------------------------------------------------- parsing

def ids_in(text):
    """Every claim id in ``text``, normalised: 'Algorithm 1 line N' per line, ranges expanded."""
    found = set()
    for token in ID_RE.findall(text):
        if token.startswith("Alg"):
            lo, hi = ALG_RE.search(token).groups()
            found.update(f"Algorithm 1 line {n}" for n in range(int(lo), int(hi or lo) + 1))
        else:
            found.add(token)
    for prefix, lo, hi in ID_RANGE_RE.findall(text):
        found.update(f"{prefix}{n}" for n in range(int(lo), int(hi) + 1))
    return found


def covered_ids():
    ids = set()
    for row in claim_rows():
        ids |= ids_in(row["source"])
    ids |= {i.split("(")[0] for i in ids if i.startswith("MT") and "(" in i}  # MT13(c) covers MT13
    return ids


def targets(cell):
    return TARGET_RE.findall(cell)


def resolve(target):
    """Import ``package.module`` (or ``package/module.py``) and follow ``Name.attr``."""
    module, sep, attrs = target.partition("::")
    assert sep and module and attrs, f"not a target: {target!r}"
    if module.endswith(".py"):
        module = module[:-3].replace("/", ".")
    obj = importlib.import_module(module)
    for part in attrs.split("."):
        obj = getattr(obj, part)
    return obj


@functools.lru_cache(maxsize=None)
def _test_names(path):
    """Names of the test functions defined in a test file (module level and in classes)."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        bodies = node.body if isinstance(node, ast.ClassDef) else [node]
        names.update(n.name for n in bodies
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and n.name.startswith("test"))
    return frozenset(names)


def check_test_target(target, base=ROOT):
    """``theory_tests/<folder>/test_x.py::test_y`` (from the root) exists; returns an error or
    None."""
    file, sep, name = target.partition("::")
    path = (base / file).resolve()
    if not path.is_file() or TESTS not in path.parents or not path.name.startswith("test_"):
        return f"{target}: no test file {file}"
    if sep and name not in _test_names(str(path)):
        return f"{target}: {file} defines no {name}"
    if not sep and not _test_names(str(path)):
        return f"{target}: {file} defines no test"
    return None


# ---------------------------------------------------------------------- the index

def test_claims_table_is_well_formed():
    rows = claim_rows()
    ids = [r["id"] for r in rows]
    assert rows
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    bad = [r["id"] for r in rows if not ROW_ID_RE.match(r["id"]) or not r["claim"]]
    assert not bad, f"rows with a malformed id or an empty claim: {bad}"


@pytest.mark.parametrize("column", ["reference", "torch"])
def test_every_named_function_exists(column):
    problems = []
    for row in claim_rows():
        cell = row[column]
        found = targets(cell)
        if cell.startswith(NONE):
            if found:
                problems.append(f"{row['id']}: '—' cell with targets {found}")
            continue
        if not found:
            problems.append(f"{row['id']}: {column} cell is neither '—' nor targets: {cell!r}")
        for target in found:
            try:
                resolve(target)
            except Exception as error:  # ImportError, AttributeError, AssertionError
                problems.append(f"{row['id']} (line {row['line']}): {target}: "
                                f"{type(error).__name__}: {error}")
    assert not problems, "\n".join(problems)


def test_every_named_test_exists():
    problems = []
    for row in claim_rows():
        cell = row["test"]
        found = targets(cell)
        if cell.startswith(NONE):
            if found:
                problems.append(f"{row['id']}: '—' test cell with targets {found}")
            elif not (row["reference"].startswith(NONE) and len(row["reference"]) > 3):
                problems.append(f"{row['id']}: no test, and the reference column gives no reason")
            continue
        if not found:
            problems.append(f"{row['id']}: test cell is neither '—' nor targets: {cell!r}")
        for target in found:
            if not target.startswith("theory_tests/"):
                problems.append(f"{row['id']}: {target}: write theory_tests/<file>::<test>")
                continue
            error = check_test_target(target)
            if error:
                problems.append(f"{row['id']} (line {row['line']}): {error}")
    assert not problems, "\n".join(problems)


def test_every_id_in_the_notes_has_a_row():
    covered = covered_ids()
    missing = {}
    for path in SOURCES:
        for claim_id in ids_in(path.read_text(encoding="utf-8")) - covered:
            missing.setdefault(claim_id, path.name)
    assert not missing, f"ids in paper_notes without a row in claims.md: {missing}"


def test_the_notes_mention_what_the_index_assumes():
    """Guards the parser itself: the notes list M1-M20, MT1-MT20 (MT13 by its parts), K1-K21,
    KT11, Lemma 3.1 and Algorithm 1 lines 5-7, so a regex that silently found nothing fails."""
    found = set()
    for path in SOURCES:
        found |= ids_in(path.read_text(encoding="utf-8"))
    expected = ({f"M{i}" for i in range(1, 21)} | {f"MT{i}" for i in range(1, 21) if i != 13}
                | {f"MT13({p})" for p in "abcdef"} | {f"K{i}" for i in range(1, 22)}
                | {"KT11", "Lemma 3.1", "Algorithm 1 line 5", "Algorithm 1 line 6",
                   "Algorithm 1 line 7"})
    assert expected <= found, sorted(expected - found)
    assert ids_in("K2–K14 and Alg. 1 lines 5-6") == (
        {f"K{i}" for i in range(2, 15)} | {"Algorithm 1 line 5", "Algorithm 1 line 6"})


# ---------------------------------------------------------------------- the notes' own cells

NOTE_TEST_RE = re.compile(r"^(?:theory_tests/)?((?:\w+/)*test_\w+\.py)::(\w+)$")
NOTE_CODE_RE = re.compile(r"^(?:reference|torch_impl)/[\w/]+\.py::[\w.]+$")


def test_the_notes_references_resolve():
    """Backticked ``test_x.py::test_y`` and ``reference/x.py::name`` in mars.md and mkor.md."""
    problems = []
    for path in SOURCES:
        for token in TARGET_RE.findall(path.read_text(encoding="utf-8")):
            test = NOTE_TEST_RE.match(token)
            if test:
                error = check_test_target(f"theory_tests/{test.group(1)}::{test.group(2)}")
                if error:
                    problems.append(f"{path.name}: {error}")
            elif NOTE_CODE_RE.match(token):
                try:
                    resolve(token)
                except Exception as error:
                    problems.append(f"{path.name}: {token}: {type(error).__name__}: {error}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("column, package", [("reference", "reference/"), ("torch", "torch_impl/")])
def test_every_row_that_names_code_has_a_mutant_of_it(column, package):
    from theory_tests.mutation.mutants import MUTANTS

    missing = []
    for row in claim_rows():
        if row[column].startswith(NONE) or not targets(row[column]):
            continue
        edited = {path for m in MUTANTS.get(row["id"], ()) for path, _, _ in m.edits()}
        if not any(path.startswith(package) for path in edited):
            missing.append(row["id"])
    assert not missing, f"rows naming {package} code without a mutant of it: {missing}"
