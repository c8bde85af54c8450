"""The README is executable and a front door: its Python examples run, CI runs its install and
test commands, a machine without a GPU is told the command for torch's CPU build first, it stays
short, and every relative link of it and of the pages it sends readers to resolves.

Every Python block of the README and of its pages runs alone, as a newcomer pastes one: in a
fresh interpreter, from a folder outside the checkout, with only what ``pip install -e .`` puts
on the path (``torch_impl``; test_packaging.py checks the wheel holds nothing else). A block
that needs the checkout itself (the oracle, ``reference/``, is not installed) says so with
``FROM_ROOT`` and runs from the clone's root (issue 30, item 6)."""
import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

from theory_tests.support.block_runner import BlockRunner

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the parser setuptools brings
    from setuptools.compat.py310 import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
# The pages the README hands its measurements and longer how-tos to (issue 22, item 3).
PAGES = ("figures/README.md", "figures/bench/README.md", "torch_impl/kronecker/README.md",
         "paper_notes/results.md", "torch_impl/integrations/README.md")
MAX_README_LINES = 250
# The comment a block that runs from the clone's root carries (on any of its lines), and the
# packages it may then import that an install does not bring.
FROM_ROOT = "# from the clone's root"
CHECKOUT_ONLY = {"reference", "figures", "theory_tests"}
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

FENCE_RE = re.compile(r"^```.*?^```[^\n]*$", flags=re.S | re.M)
LINK_RE = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _blocks(lang, text=README):
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _page(name):
    return (ROOT / name).read_text()


EXAMPLES = [(page, i, code) for page in ("README.md",) + PAGES
            for i, code in enumerate(_blocks("python", _page(page)))]


@pytest.fixture(scope="session")
def installed(tmp_path_factory):
    """The environment a block runs in: no PYTHONPATH when the installed ``torch_impl`` is this
    tree's (the README's ``pip install -e .``); otherwise (this tree is a copy, as the mutation
    harness makes, or is not installed) a folder holding only a link to this tree's
    ``torch_impl``, which is what the wheel installs."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    here = tmp_path_factory.mktemp("outside")
    probe = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u; s = u.find_spec('torch_impl'); "
         "print(s.origin if s else '')"], cwd=here, env=env, capture_output=True, text=True)
    if pathlib.Path(probe.stdout.strip() or here).resolve() != ROOT / "torch_impl" / "__init__.py":
        site = tmp_path_factory.mktemp("site")
        (site / "torch_impl").symlink_to(ROOT / "torch_impl", target_is_directory=True)
        env["PYTHONPATH"] = str(site)
    return env


@pytest.fixture(scope="session")
def runner(installed, tmp_path_factory):
    blocks = BlockRunner(installed, tmp_path_factory.mktemp("runner"))
    yield blocks
    blocks.close()


def test_the_readme_and_a_page_have_examples():
    assert any(page == "README.md" for page, _, _ in EXAMPLES), "the README has no Python example"
    assert {page for page, _, _ in EXAMPLES} > {"README.md"}


@pytest.mark.parametrize("page, index, code", EXAMPLES,
                         ids=[f"{page}#{i + 1}" for page, i, _ in EXAMPLES])
def test_python_examples_run(page, index, code, runner, tmp_path):
    """One block, pasted into a fresh ``python`` started in an empty folder (or the clone's
    root, when the block says so): its own imports, nothing from the blocks before it
    (``block_runner``: a child forked from an interpreter started so, which had only imported
    torch and torch_impl)."""
    at_root = FROM_ROOT in code
    rc, stderr = runner.run(code, ROOT if at_root else tmp_path)
    where = "the clone's root" if at_root else "a folder outside the checkout"
    assert rc == 0, (
        f"{page}, Python block {index + 1}, run alone from {where}, fails:\n{stderr[-3000:]}")


def test_a_block_run_alone_sees_nothing_of_the_runner_or_the_blocks_before(runner, tmp_path):
    """The runner's own imports bind no name in a block, a block's names do not reach the next
    one, and the oracle is not importable from outside the checkout."""
    assert runner.run("x = 1\nimport torch", tmp_path)[0] == 0
    rc, stderr = runner.run("print(x)", tmp_path)
    assert rc == 1 and "NameError: name 'x'" in stderr
    rc, stderr = runner.run("torch.zeros(1)", tmp_path)
    assert rc == 1 and "NameError: name 'torch'" in stderr
    rc, stderr = runner.run("import reference", tmp_path)
    assert rc == 1 and "ModuleNotFoundError" in stderr
    assert runner.run("import reference", ROOT)[0] == 0


@pytest.mark.parametrize("page, index, code", EXAMPLES,
                         ids=[f"{page}#{i + 1}" for page, i, _ in EXAMPLES])
def test_a_block_that_needs_the_checkout_says_so(page, index, code):
    """What an install does not bring (the oracle, the figures, the tests) is imported only by a
    block marked ``FROM_ROOT``, so the reader knows where to paste it."""
    imported = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            imported.add(node.module.split(".")[0])
    needs = imported & CHECKOUT_ONLY
    assert not needs or FROM_ROOT in code, (
        f"{page}, Python block {index + 1} imports {sorted(needs)}, which `pip install -e .` "
        f"does not install: say {FROM_ROOT!r} in it (and in the text around it)")


def _shell_commands():
    """The README's shell commands by role, not position: ``cpu`` (torch's CPU build, for a
    machine without a GPU), ``install`` (the project; CI runs it verbatim) and ``test``."""
    roles = {}
    for block in _blocks("bash"):
        lines = [l for l in block.strip().splitlines() if not l.startswith("#")]
        command = "\n".join(lines)
        role = ("cpu" if CPU_INDEX in command else "install" if "pip install -e" in command
                else "test" if command.startswith("pytest") else None)
        if role:
            assert role not in roles, f"two README blocks run the {role} step"
            roles[role] = (block.strip(), command)
    assert set(roles) == {"cpu", "install", "test"}, f"README shell steps found: {sorted(roles)}"
    return roles


def test_the_cpu_build_of_torch_is_a_command_before_the_install():
    """A newcomer without a GPU copies a command, not prose: torch's CPU build, alone in its
    block, said to be for a machine without a GPU, shown before the install command, at a
    version the project accepts; the install command itself needs nothing but PyPI (CI, which
    has no other index, runs it verbatim)."""
    roles = _shell_commands()
    block, cpu = roles["cpu"]
    install = roles["install"][1]
    assert "GPU" in block, "the CPU step must say it is for a machine without a GPU"
    match = re.fullmatch(rf"pip install torch==(\S+) --index-url {re.escape(CPU_INDEX)}", cpu)
    assert match, f"the CPU step is one command installing a pinned torch: {cpu!r}"
    assert README.index(roles["cpu"][0]) < README.index(install), "the CPU step comes first"
    torch_req = next(Requirement(r) for r in tomllib.loads(
        (ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        if Requirement(r).name == "torch")
    assert match.group(1) in torch_req.specifier, (
        f"torch=={match.group(1)} is outside the project's {torch_req}: the install would "
        "replace it with the CUDA build")
    assert "download.pytorch.org" not in install and "--index-url" not in install


def test_ci_runs_the_readme_commands():
    """CI runs the README's three commands as written, torch's CPU build first (issue 45 item
    7: it ran a bare `pip install torch` instead); its machine reaches the package registries
    only, and the README says how the CPU line works there."""
    roles = _shell_commands()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert roles["cpu"][1] in ci, "CI must run the README's CPU torch command verbatim"
    assert roles["install"][1] in ci, "CI must run the README's install command verbatim"
    assert roles["test"][1] in ci, "CI must run the README's test command verbatim"
    assert ci.index(roles["cpu"][1]) < ci.index(roles["install"][1])
    flat = " ".join(README.split())
    assert "`.ci/run`" in flat and "download.pytorch.org" in flat and "find-links" in flat


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
