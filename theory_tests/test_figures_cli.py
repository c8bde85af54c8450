"""The figures command's exit status: a figure that cannot be built fails the command."""
import sys

import pytest

from figures import __main__ as cli


def test_a_figure_that_cannot_be_built_exits_non_zero(tmp_path, monkeypatch):
    """A missing data package used to print BLOCKED and exit 0; now the line is printed and
    the command fails, naming the figure."""
    module = type(sys)("figures.broken_for_test")

    def run(ctx):
        raise ModuleNotFoundError("No module named 'a_data_package'")

    module.run = run
    monkeypatch.setitem(sys.modules, "figures.broken_for_test", module)
    monkeypatch.setattr(cli, "FIGURES", cli.FIGURES + ("broken_for_test",))
    with pytest.raises(SystemExit, match="could not build broken_for_test"):
        cli.main(["--tiny", "--only", "broken_for_test", "--out", str(tmp_path),
                  "--no-progress"])
