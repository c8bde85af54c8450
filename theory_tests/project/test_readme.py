"""The README is executable and a front door: its Python examples run, CI runs its two commands,
it stays short, and every relative link of it and of the pages it sends readers to resolves.
The pages' Python examples run too (each page in its own session)."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
# The pages the README hands its measurements and longer how-tos to (issue 22, item 3).
PAGES = ("figures/README.md", "figures/bench/README.md", "torch_impl/mkor/README.md",
         "paper_notes/results.md")
MAX_README_LINES = 250

FENCE_RE = re.compile(r"^```.*?^```[^\n]*$", flags=re.S | re.M)
LINK_RE = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _blocks(lang, text=README):
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _page(name):
    return (ROOT / name).read_text()


def test_python_examples_run():
    blocks = _blocks("python")
    assert blocks, "the README has no Python example"
    namespace = {}  # one session, in reading order, as a user would paste them
    for code in blocks:
        exec(compile(code, "README.md", "exec"), namespace)


@pytest.mark.parametrize("page", [p for p in PAGES if _blocks("python", _page(p))])
def test_page_python_examples_run(page):
    namespace = {}  # one session per page, in reading order
    for code in _blocks("python", _page(page)):
        exec(compile(code, page, "exec"), namespace)


def test_ci_runs_the_readme_commands():
    install, test = (b.strip() for b in _blocks("bash")[:2])
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install in ci, "CI must run the README's install command verbatim"
    assert test in ci, "CI must run the README's test command verbatim"
    assert "python -m pip install -q torch==2.13.0" in ci, "CI installs the local CPU torch first"


def test_readme_is_a_front_door():
    lines = README.count("\n") + (not README.endswith("\n"))
    assert lines < MAX_README_LINES, (
        f"README.md has {lines} lines; keep it under {MAX_README_LINES} and move measurements "
        f"and details to the page they describe ({', '.join(PAGES)})")


def _slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(text):
    seen, out = {}, set()
    for line in FENCE_RE.sub("", text).splitlines():
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            slug = _slug(match.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _relative_links(text):
    prose = re.sub(r"`[^`\n]*`", "", FENCE_RE.sub("", text))  # code is not a link
    return [t for t in LINK_RE.findall(prose) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("page", ("README.md",) + PAGES)
def test_relative_links_resolve(page):
    """Every relative link (and image) of the README and of its pages names an existing file or
    folder, and a ``#fragment`` into a Markdown file names one of its headings."""
    source = ROOT / page
    broken = []
    for target in _relative_links(source.read_text()):
        path, _, fragment = target.partition("#")
        resolved = (source.parent / path).resolve() if path else source
        if not resolved.exists():
            broken.append(target)
        elif fragment and resolved.suffix == ".md" and fragment not in _anchors(
                resolved.read_text()):
            broken.append(target)
    assert not broken, f"{page}: links that do not resolve: {broken}"


def test_link_checker_sees_links():
    """The checker is not vacuous: it finds the README's links and flags a missing file."""
    assert "figures/README.md" in _relative_links(README)
    assert _relative_links("[x](missing.md) `[y](in_code.md)` [z](https://example.org)") == \
        ["missing.md"]
    assert _slug("Paper-budget figures (`--full`)") == "paper-budget-figures---full"
