"""The README is executable: its Python examples run, and CI runs its two commands."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_python_examples_run():
    blocks = _blocks("python")
    assert blocks, "the README has no Python example"
    namespace = {}  # one session, in reading order, as a user would paste them
    for code in blocks:
        exec(compile(code, "README.md", "exec"), namespace)


def test_ci_runs_the_readme_commands():
    install, test = (b.strip() for b in _blocks("bash")[:2])
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install in ci, "CI must run the README's install command verbatim"
    assert test in ci, "CI must run the README's test command verbatim"
    assert "python -m pip install -q torch==2.13.0" in ci, "CI installs the local CPU torch first"
