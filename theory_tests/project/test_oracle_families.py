"""The oracle keeps its families apart (issue 44, item 4): no module of ``reference/mkor``
imports from ``reference/baselines``, and none of ``reference/baselines`` from
``reference/mkor``. Every import of every file is read with ``ast``: absolute and relative,
at module level or inside a function, and ``importlib.import_module`` / ``__import__`` of a
literal name. What both families need is in ``reference/common``: the MoE problem and its
rows, the matrix functions, and the first-order rules (``first_order``: the backbone MKOR
hands its step to, K15, and the oracles of MARS's reductions M19, M20, MT1, MT10, MT11)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
APART = ("reference.mkor", "reference.baselines")


def imported(source, module, is_package):
    """Every module name an import in ``source`` (the text of ``module``) names: ``from m
    import x`` names m and m.x (x may be a submodule), relative imports resolved."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[:len(parts) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) == "import_module"
                   or getattr(node.func, "id", None) == "__import__")):
            found.add(node.args[0].value)
    return found


def _family(name):
    return next((f for f in APART if name == f or name.startswith(f + ".")), None)


def arrows(modules):
    """["a -> b"] for every import of a module of one family (``modules``: {name: (source,
    is_package)}) that names a module of the other."""
    found = []
    for name, (source, is_package) in modules.items():
        own = _family(name)
        for target in imported(source, name, is_package):
            other = _family(target)
            if own and other and other != own:
                found.append(f"{name} -> {target}")
    return sorted(found)


def _oracle_modules():
    modules = {}
    for family in APART:
        for f in (ROOT / family.replace(".", "/")).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            modules[name] = (f.read_text(encoding="utf-8"), is_package)
    return modules


def test_no_import_between_the_oracles_families():
    modules = _oracle_modules()
    # both families are read, and the reader sees their imports
    assert {"reference.mkor.experts", "reference.baselines.kfac"} <= set(modules)
    assert "reference.common.moe" in imported(modules["reference.mkor.experts"][0],
                                              "reference.mkor.experts", False)
    assert "reference.common.moe" in imported(modules["reference.baselines.kfac"][0],
                                              "reference.baselines.kfac", False)
    assert "reference.common.first_order" in imported(
        modules["reference.mkor.preconditioner"][0], "reference.mkor.preconditioner", False)
    assert not arrows(modules), arrows(modules)


def test_the_check_finds_an_arrow():
    """The check itself: an arrow each way (a relative import, a function-level one, an
    import_module of a literal) is reported; imports from ``common`` and within a family
    are not."""
    modules = {
        "reference.mkor.a": ("from ..baselines import kfac\n", False),
        "reference.baselines.b": ("def f():\n    from reference.mkor.vectors import _rows\n",
                                  False),
        "reference.baselines": ("import importlib\n"
                                "m = importlib.import_module('reference.mkor.factors')\n", True),
        "reference.mkor.c": ("import reference.common.moe\nfrom . import vectors\n"
                             "from reference.mkor.factors import rescale\n", False),
    }
    assert arrows(modules) == [
        "reference.baselines -> reference.mkor.factors",
        "reference.baselines.b -> reference.mkor.vectors",
        "reference.baselines.b -> reference.mkor.vectors._rows",
        "reference.mkor.a -> reference.baselines",
        "reference.mkor.a -> reference.baselines.kfac",
    ]
