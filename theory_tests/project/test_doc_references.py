"""Every dotted name of the library that the docs write down resolves as written (issue 30,
item 4: ``torch_impl/mars/__init__.py`` documented ``torch_impl.functional``, which does not
import).

A reference ``torch_impl.a.b.C`` in a page (README, paper_notes, figures, the library's and the
tests' own README pages) or in a docstring or comment of ``torch_impl/`` / ``figures/`` resolves when its
modules import by the dotted path written and the rest are attributes; a module reached as an
attribute only (``torch_impl.functional``, an attribute of ``torch_impl`` but not an importable
``torch_impl.functional``) does not count, since ``import torch_impl.functional`` fails.
File paths (``....py``, ``....md``) and the claim index's ``module::Name`` targets (checked by
``test_claims_index``) are left out.
"""
import importlib
import pathlib
import re
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = ["README.md", "paper_notes/*.md", "figures/**/*.md", "torch_impl/**/*.md",
         "theory_tests/**/*.md", "torch_impl/**/*.py", "figures/**/*.py"]
REFERENCE_RE = re.compile(r"(?<![\w/.:])((?:torch_impl|reference)(?:\.\w+)+)")


def references():
    found = {}
    for pattern in PAGES:
        for path in sorted(ROOT.glob(pattern)):
            for match in REFERENCE_RE.finditer(path.read_text()):
                name = match.group(1)
                if name.rsplit(".", 1)[-1] not in ("py", "md"):
                    found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def unresolved_part(name):
    """``None`` if ``name`` resolves as written, else the prefix where it stops."""
    parts = name.split(".")
    obj, path = importlib.import_module(parts[0]), parts[0]
    for attr in parts[1:]:
        path = f"{path}.{attr}"
        if isinstance(obj, types.ModuleType):  # a submodule, or else an attribute
            try:
                obj = importlib.import_module(path)
                continue
            except ModuleNotFoundError as error:
                if error.name != path:  # it exists and fails to import: not ours to hide
                    raise
        if not hasattr(obj, attr) or isinstance(getattr(obj, attr), types.ModuleType):
            return path
        obj = getattr(obj, attr)
    return None


REFERENCES = references()


def test_the_pages_name_library_objects():
    assert len(REFERENCES) > 30 and "torch_impl.mars.functional" in " ".join(REFERENCES)


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_a_documented_name_resolves_as_written(name):
    stop = unresolved_part(name)
    assert stop is None, (f"{REFERENCES[name]} writes `{name}`, but `{stop}` is not an "
                          f"importable module or an attribute")


def test_a_module_reached_only_as_an_attribute_does_not_resolve():
    """The case of the issue: ``torch_impl.functional`` is ``torch_impl``'s attribute (a
    module object) but no module of that dotted name exists."""
    assert unresolved_part("torch_impl.functional.mars") == "torch_impl.functional"
    assert unresolved_part("torch_impl.mars.functional.mars") is None
    assert unresolved_part("torch_impl.MARS.step") is None
    assert unresolved_part("torch_impl.mkor.from_kfac_pytorch") == "torch_impl.mkor.from_kfac_pytorch"
