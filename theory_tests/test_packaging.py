"""What an install puts on a user's path: the wheel holds one top-level package,
``torch_impl`` (issue 22, item 5). ``reference`` and ``figures`` are names a user's own
project may already have; they are used from the checkout, never installed."""
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_installs_torch_impl_and_nothing_else(tmp_path):
    """Build the wheel as pip would (offline: no build isolation, setuptools from the test
    extra) and list its top-level names."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(tmp_path)],
                   check=True, capture_output=True, text=True)
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"torch_impl"}
    assert "torch_impl/__init__.py" in names and "torch_impl/mkor/__init__.py" in names
    # every subpackage of the source tree is in the wheel
    source = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "torch_impl").rglob("__init__.py")}
    packaged = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    assert source == packaged
