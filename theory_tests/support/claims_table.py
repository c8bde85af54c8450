"""The claim index's table, parsed: ``paper_notes/claims.md`` as a list of rows (dicts keyed by
the header), read by its checks (``project/test_claims_index.py``) and by the mutation harness (which
runs each row's tests)."""
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLAIMS = ROOT / "paper_notes" / "claims.md"
HEADER = ["id", "claim", "source", "reference", "torch", "test"]
NONE = "—"
TARGET_RE = re.compile(r"`([^`]*)`")


def split_row(line):
    """Cells of a Markdown table line; ``\\|`` is a literal bar inside a cell."""
    cells = re.split(r"(?<!\\)\|", line.strip())
    assert cells[0] == "" and cells[-1] == "", f"a table line must start and end with |: {line!r}"
    return [c.strip().replace("\\|", "|") for c in cells[1:-1]]


@functools.lru_cache(maxsize=None)
def claim_rows():
    lines = CLAIMS.read_text(encoding="utf-8").splitlines()
    numbered = [(i, l) for i, l in enumerate(lines) if l.startswith("|")]
    assert numbered, "claims.md has no table"
    first = numbered[0][0]
    assert [i for i, _ in numbered] == list(range(first, first + len(numbered))), \
        "claims.md must hold exactly one table (contiguous | lines)"
    assert split_row(numbered[0][1]) == HEADER
    assert all(re.fullmatch(r":?-+:?", c) for c in split_row(numbered[1][1]))
    rows = []
    for i, line in numbered[2:]:
        cells = split_row(line)
        assert len(cells) == len(HEADER), f"claims.md line {i + 1}: {len(cells)} cells"
        rows.append(dict(zip(HEADER, cells), line=i + 1))
    return rows
