"""``python -m figures --jobs 2`` says what it is doing (issue 45 item 7): a line when each
figure, or part of one, starts and finishes, with the time since the start and an estimate
of what is left, and a line while nothing else is said (``figures/progress.py``); and the
command every figure JSON records is the one typed, which reruns as written, not a worker's
(doubled ``--no-progress``, a deleted ``--parts-dir``)."""
import concurrent.futures
import json
import shlex

import pytest

from figures import cli
from figures import progress as P


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _progress(recorded, jobs=2, tasks=("a", "b", "c")):
    clock, lines = Clock(), []
    say = lambda text, flush=False: lines.append(text)  # noqa: E731
    return P.Progress(tasks, jobs, recorded, say=say, clock=clock), clock, lines


def test_lines_say_what_started_finished_and_what_is_left():
    """Three tasks of 100, 60 and 30 recorded seconds on two workers: at the start a and b
    run, c waits for b, so 1:40 is left; b finishing at 60 s as recorded leaves a's 40 s."""
    p, clock, lines = _progress(dict(a=100, b=60, c=30))
    p.started("a")
    p.started("b")
    assert lines[-1] == "[progress 0:00] b started (1:00 recorded); 0 of 3 done, about 1:40 left"
    clock.now += 60
    p.finished("b")
    assert lines[-1] == "[progress 1:00] b finished in 1:00; 1 of 3 done, about 0:40 left"
    p.started("c")
    clock.now += 40
    p.finished("a")
    p.finished("c")
    assert lines[-1] == "[progress 1:40] c finished in 0:40; 3 of 3 done, about 0:00 left"


def test_the_estimate_follows_the_speed_of_this_run():
    """Tasks that take twice their recorded time double the estimate of the rest."""
    p, clock, lines = _progress(dict(a=100, b=60, c=30))
    p.started("a")
    p.started("b")
    clock.now += 120  # b took 2:00, recorded 1:00
    p.finished("b")
    assert p.speed() == 2.0
    assert p.remaining() == pytest.approx(200 - 120)  # a: 2 x 100 s less the 120 s run
    assert lines[-1].endswith("about 1:20 left")


def test_running_tasks_past_their_record_slow_the_estimate_before_any_finishes():
    """Nothing finished yet, both running tasks at twice their recorded time: the estimate
    assumes at least that slowdown (not the recorded speed, which would say 0:00 left)."""
    p, clock, lines = _progress(dict(a=100, b=60, c=30))
    p.started("a")
    p.started("b")
    clock.now += 240  # a at 2.4x its record, b at 4x: the run is at least 2.4x slower
    assert p.speed() == pytest.approx(2.4)
    assert p.remaining() == pytest.approx(2.4 * 30)  # a and b due now, then c


def test_a_heartbeat_after_a_minute_of_silence_and_no_estimate_without_a_record():
    p, clock, lines = _progress(dict(a=100, b=60))  # c has no recorded duration
    p.started("a")
    assert "left" not in lines[-1]
    clock.now += P.HEARTBEAT - 1
    p.heartbeat()
    assert len(lines) == 1  # not yet: something was said under a minute ago
    clock.now += 5
    p.heartbeat()
    assert lines[-1] == "[progress 1:04] running a for 1:04; 0 of 3 done"
    assert P.duration(3725) == "1:02:05"


def test_parallel_figures_report_each_task_start_and_end(monkeypatch, capsys):
    """The pool's tasks (here threads, and a build that only says it started) each get a
    start and an end line, in the order the worker says them, the split figure's parts and
    its drawing included; each build is told the parent's command to record."""
    calls = []

    def build(name, argv, command=None, label=None):
        cli._STARTS.put(label)
        calls.append((name, argv, command))
        return [f"[{name}] built"]

    def pool(jobs, starts=None):
        return concurrent.futures.ThreadPoolExecutor(jobs, initializer=cli._remember,
                                                     initargs=(starts,))

    monkeypatch.setattr(cli, "build", build)
    monkeypatch.setattr(cli, "worker_pool", pool)
    argv = ["--jobs", "2", "--no-progress"]
    names = ["noisy_quadratic", "shakespeare_gpt"]
    try:
        assert cli.parallel_figures(cli.parse(argv), argv, names) == []
    finally:
        cli._STARTS = None
    said = capsys.readouterr().out.splitlines()
    progress = [line for line in said if line.startswith("[progress")]
    labels, _ = cli._planned(names, 2)
    assert labels == ["shakespeare_gpt part 1 of 2", "shakespeare_gpt part 2 of 2",
                      "noisy_quadratic", "shakespeare_gpt (drawn from its parts)"]
    for label in labels:
        started = [i for i, line in enumerate(progress) if f"] {label} started" in line]
        finished = [i for i, line in enumerate(progress) if f"] {label} finished" in line]
        assert len(started) == len(finished) == 1 and started[0] < finished[0], (label, said)
    assert "4 of 4 done" in progress[-1] and "[shakespeare_gpt] built" in said
    assert {command for _, _, command in calls} == {"python -m figures --jobs 2 --no-progress"}
    for _, worker_argv, _ in calls:  # each worker flag once
        assert worker_argv.count("--no-progress") == worker_argv.count("--no-summary") == 1


def test_a_worker_records_the_command_typed_and_says_when_it_starts(tmp_path, monkeypatch):
    """``cli.build`` (one task on a --jobs worker) puts its label on the queue before it
    builds and writes the parent's command into the figure JSON, and that command parses as
    typed, with none of the workers' own options."""
    import queue

    starts = queue.Queue()
    monkeypatch.setattr(cli, "_STARTS", starts)
    typed = f"python -m figures --tiny --jobs 2 --out {tmp_path}"
    cli.build("variance_reduction", cli._worker_argv(shlex.split(typed)[3:])
              + ["--only", "variance_reduction"], typed, "variance_reduction")
    assert starts.get_nowait() == "variance_reduction"
    meta = json.loads((tmp_path / "variance_reduction.json").read_text())
    assert meta["command"] == typed
    args = cli.parse(shlex.split(meta["command"])[3:])
    assert args.jobs == 2 and not args.no_summary and args.parts_dir is None
