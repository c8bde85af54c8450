"""What an install puts on a user's path: the wheel holds one top-level package,
``torch_impl`` (issue 22, item 5). ``reference`` and ``figures`` are names a user's own
project may already have; they are used from the checkout, never installed.

And what comes with it (issue 30, item 6): the MIT license, as a LICENSE file and pyproject's
SPDX ``license`` string (no deprecated table, no warning when setuptools reads it); every
module the wheel ships imports with the library's own dependencies (numpy, torch) alone, and
the FSDP2 example, whose model is transformers', says so at its top, in ``--help`` and in the
error a missing transformers raises, with the command that brings it."""
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the parser setuptools brings
    from setuptools.compat.py310 import tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# What the library's install does not bring (the extras' imports; not torch's own, e.g. sympy).
EXTRAS_ONLY = ("transformers", "accelerate", "pytorch_lightning", "lightning", "peft",
               "matplotlib", "sklearn", "mnist1d", "hypothesis", "pytest")


def test_the_wheel_installs_torch_impl_and_nothing_else(tmp_path):
    """Build the wheel as pip would (offline: no build isolation, setuptools from the test
    extra) from a copy of the project's sources (setuptools builds in the source tree: the
    checkout stays untouched), and list its top-level names; its METADATA says
    ``License-Expression: MIT`` and names the license file, which it holds."""
    src, out = tmp_path / "src", tmp_path / "wheel"
    python_only = shutil.ignore_patterns("*.png", "*.csv", "*.json", "*.md", "__pycache__")
    for package in ("torch_impl", "reference", "figures", "theory_tests"):
        shutil.copytree(ROOT / package, src / package, ignore=python_only)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(out)],
                   check=True, capture_output=True, text=True)
    (built,) = out.glob("*.whl")
    wheel = zipfile.ZipFile(built)
    names = wheel.namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"torch_impl"}
    assert "torch_impl/__init__.py" in names and "torch_impl/mkor/__init__.py" in names
    # every subpackage of the source tree is in the wheel
    source = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "torch_impl").rglob("__init__.py")}
    packaged = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    assert source == packaged
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    fields = wheel.read(metadata).decode().split("\n\n")[0].splitlines()
    assert "License-Expression: MIT" in fields and "License-File: LICENSE" in fields
    assert not [f for f in fields if f.startswith(("License:", "Classifier: License"))]
    (license_file,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert wheel.read(license_file).decode() == (ROOT / "LICENSE").read_text()


def test_the_license_is_mit():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License\n")
    assert re.search(r"^Copyright \(c\) 20\d\d \S.*$", text, flags=re.M)
    assert "Permission is hereby granted, free of charge, to any person obtaining a copy" in text
    assert 'THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND' in text


def test_pyproject_names_the_license_by_its_spdx_id():
    """PEP 639: ``license`` is an SPDX string (the table form is deprecated, unsupported after
    2027-02-18) and ``license-files`` lists the file; no license classifier (forbidden with an
    SPDX license); setuptools >= 77 reads them, in the build and in the test extra."""
    project = PYPROJECT["project"]
    assert project["license"] == "MIT"
    assert project["license-files"] == ["LICENSE"]
    assert not [c for c in project.get("classifiers", ()) if c.startswith("License ::")]
    assert "setuptools>=77" in PYPROJECT["build-system"]["requires"]
    assert "setuptools>=77" in project["optional-dependencies"]["test"]


def test_setuptools_reads_the_license_without_a_warning():
    """What setuptools makes of pyproject.toml in the checkout: the SPDX expression and the
    file, and not one warning (a table license, or a license file that is missing, warns)."""
    script = (
        "import json, warnings\n"
        "from setuptools.dist import Distribution\n"
        "from setuptools.config.pyprojecttoml import apply_configuration\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    dist = apply_configuration(Distribution(), 'pyproject.toml')\n"
        "print(json.dumps(dict(expression=dist.metadata.license_expression,\n"
        "                      files=dist.metadata.license_files,\n"
        "                      warnings=[str(w.message).split(chr(10))[0] for w in caught])))\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got == dict(expression="MIT", files=["LICENSE"], warnings=[]), got


_WITHOUT_EXTRAS = """
import contextlib, importlib, io, json, pkgutil, runpy, sys
for name in {hidden!r}:
    sys.modules[name] = None  # import name -> ImportError, as where it is not installed
import torch_impl
modules = [m.name for m in pkgutil.walk_packages(torch_impl.__path__, "torch_impl.")]
for name in modules:
    importlib.import_module(name)
from torch_impl.examples import fsdp2_train
help_text = io.StringIO()
sys.argv = ["fsdp2_train", "--help"]
with contextlib.redirect_stdout(help_text), contextlib.suppress(SystemExit):
    runpy.run_module("torch_impl.examples.fsdp2_train", run_name="__main__")
try:
    fsdp2_train.main(["--steps", "0"])
    error = None
except ImportError as e:
    error = str(e)
print(json.dumps(dict(modules=modules, doc=fsdp2_train.__doc__, help=help_text.getvalue(),
                      error=error)))
"""


def test_shipped_modules_need_only_the_library_and_the_fsdp2_example_says_what_it_needs():
    """In a process where the extras' packages cannot be imported, every module of
    ``torch_impl`` (the wheel's content) imports; the FSDP2 example, whose model is
    transformers', says that it needs transformers and how to install it at its top, in
    ``--help`` and in the error a run raises; and the extra it names brings transformers."""
    out = subprocess.run([sys.executable, "-c", _WITHOUT_EXTRAS.format(hidden=EXTRAS_ONLY)],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert "torch_impl.examples.fsdp2_train" in got["modules"] and len(got["modules"]) > 20
    extras = PYPROJECT["project"]["optional-dependencies"]
    for where in ("doc", "help", "error"):
        text = " ".join((got[where] or "").split())
        assert "needs transformers" in text.lower(), (where, text)
        assert 'pip install "transformers>=4.46"' in text, (where, text)
        assert '.[examples]' in text, (where, text)
    assert "transformers>=4.46" in extras["examples"]
