"""What an install puts on a user's path: the wheel holds one top-level package,
``torch_impl`` (issue 22, item 5). ``reference`` and ``figures`` are names a user's own
project may already have; they are used from the checkout, never installed."""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_installs_torch_impl_and_nothing_else(tmp_path):
    """Build the wheel as pip would (offline: no build isolation, setuptools from the test
    extra) from a copy of the project's sources (setuptools builds in the source tree: the
    checkout stays untouched), and list its top-level names."""
    src, out = tmp_path / "src", tmp_path / "wheel"
    python_only = shutil.ignore_patterns("*.png", "*.csv", "*.json", "*.md", "__pycache__")
    for package in ("torch_impl", "reference", "figures", "theory_tests"):
        shutil.copytree(ROOT / package, src / package, ignore=python_only)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(out)],
                   check=True, capture_output=True, text=True)
    (wheel,) = out.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"torch_impl"}
    assert "torch_impl/__init__.py" in names and "torch_impl/mkor/__init__.py" in names
    # every subpackage of the source tree is in the wheel
    source = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "torch_impl").rglob("__init__.py")}
    packaged = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    assert source == packaged
