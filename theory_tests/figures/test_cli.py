"""The figures command's exit status: a figure that cannot be built fails the command, built
in-process or on a ``--jobs`` worker."""
import sys

import pytest

from figures import cli


@pytest.fixture
def broken_figure(monkeypatch):
    """A figure whose data package is missing: its run raises ModuleNotFoundError."""
    module = type(sys)("figures.experiments.broken_for_test")

    def run(ctx):
        raise ModuleNotFoundError("No module named 'a_data_package'")

    module.run = run
    monkeypatch.setitem(sys.modules, "figures.experiments.broken_for_test", module)
    monkeypatch.setattr(cli, "FIGURES", cli.FIGURES + ("broken_for_test",))


def test_a_figure_that_cannot_be_built_exits_non_zero(tmp_path, broken_figure):
    """A missing data package used to print BLOCKED and exit 0; now the line is printed and
    the command fails, naming the figure."""
    with pytest.raises(SystemExit, match="could not build broken_for_test"):
        cli.main(["--tiny", "--only", "broken_for_test", "--out", str(tmp_path),
                  "--no-progress"])


def test_a_worker_reports_blocked_and_raises_on_any_other_exit(tmp_path, broken_figure):
    """``cli.build`` (what each --jobs worker runs) returns the figure's BLOCKED line,
    so the parent fails the command; any other exit is an error with the worker's output."""
    lines = cli.build("broken_for_test", [
        "--tiny", "--only", "broken_for_test", "--out", str(tmp_path), "--no-progress",
        "--no-summary"])
    assert len(lines) == 1 and "BLOCKED" in lines[0] and "a_data_package" in lines[0]
    with pytest.raises(RuntimeError, match="exited"):
        cli.build("noisy_quadratic", ["--tiny", "--jobs", "0"])
