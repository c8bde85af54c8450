"""``python -m theory_tests.mutation`` says how far it is (issue 45 item 7): the total first,
then each mutant's line prefixed by its count, the time since the start and the time left,
and the counts last (``harness.main``)."""
from theory_tests.mutation import harness


def test_each_line_counts_and_estimates_what_is_left():
    assert harness.progress(1, 4, 30.0) == "[1/4 0:30, about 1:30 left]"
    assert harness.progress(2, 4, 60.0) == "[2/4 1:00, about 1:00 left]"  # 30 s a mutant
    assert harness.progress(4, 4, 125.0) == "[4/4 2:05, about 0:00 left]"
    assert harness.progress(0, 4, 0.0) == "[0/4 0:00, about 0:00 left]"


def test_the_total_comes_first_and_each_result_is_counted(monkeypatch, capsys):
    """Two mutants on a stand-in workspace (no copy of the project, no pytest): the total
    line, one counted line per mutant, the counts last."""
    from theory_tests.mutation.mutant import Mutant

    class Space:
        def run(self, row, index, mutant):
            return dict(row=row, index=index, path=mutant.path, files=[mutant.path],
                        status="killed", detail="1 failed", seconds=0.0)

        def close(self):
            pass

    monkeypatch.setattr(harness, "Workspace", Space)
    mutants = {"ROW": [Mutant("a.py", "x", "y"), Mutant("a.py", "y", "z")]}
    assert harness.main(mutants, ["--jobs", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "2 mutants to run on 1 worker(s)"
    assert lines[1].startswith("[1/2 ") and "killed" in lines[1]
    assert lines[2].startswith("[2/2 ") and "about 0:00 left" in lines[2]
    assert lines[-1].startswith("2 mutants in ") and lines[-1].endswith(
        "2 killed, 0 equivalent, 0 not killed")
