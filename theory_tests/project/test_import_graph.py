"""No import circles anywhere in the project (issue 22, item 2b): the static import graph of
``torch_impl``, ``reference``, ``figures`` and ``theory_tests`` (every ``import`` statement,
function-level ones included, read with ``ast``) has no cycle, except a package's
``__init__`` re-exporting its own submodules."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("torch_impl", "reference", "figures", "theory_tests")


def _modules():
    """{dotted name: file} of every module of the four packages."""
    mods = {}
    for package in PACKAGES:
        for f in (ROOT / package).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _imports(name, f, mods):
    package = name if f.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                target = f"{module}.{alias.name}"
                found.add(target if target in mods else module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in mods and m != name}


def _cycles(graph):
    cycles, done = [], set()

    def visit(node, path):
        for nxt in sorted(graph[node]):
            if nxt in path:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, path + [nxt])
        done.add(node)

    for node in sorted(graph):
        if node not in done:
            visit(node, [node])
    return cycles


def _through_own_init(cycle, mods):
    """A package's __init__ importing its submodule (a re-export) closes no real circle."""
    return any(b.startswith(a + ".") and mods[a].name == "__init__.py"
               for a, b in zip(cycle, cycle[1:]))


def test_the_project_has_no_import_circle():
    mods = _modules()
    graph = {name: _imports(name, f, mods) for name, f in mods.items()}
    # the graph sees imports at all, absolute and relative
    assert graph["figures.cli"] and graph["theory_tests.mutation.mutants"]
    circles = [c for c in _cycles(graph) if not _through_own_init(c, mods)]
    assert not circles, [" -> ".join(c) for c in circles]


def test_the_check_finds_a_circle():
    """The detector itself: a two-module circle is reported, a package re-export is not."""
    graph = {"a": {"b"}, "b": {"a"}, "p": {"p.x"}, "p.x": {"p"}}
    mods = {"a": Path("a.py"), "b": Path("b.py"), "p": Path("p/__init__.py"),
            "p.x": Path("p/x.py")}
    circles = [c for c in _cycles(graph) if not _through_own_init(c, mods)]
    assert [set(c) for c in circles] == [{"a", "b"}]
