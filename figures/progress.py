"""The progress lines of ``python -m figures``: when each figure (or part of one) starts and
finishes, with the time since the command began and an estimate of what is left, and a line
every ``HEARTBEAT`` seconds while nothing else is said. The ``--jobs`` workers build their
figures without progress bars (their output would interleave), so without these lines the
command printed nothing for most of its run.

The estimate comes from each task's recorded duration (``figures.cli.QUICK_SECONDS``, quick
mode only), scaled by how much slower or faster the finished tasks ran than recorded (and at
least as slow as every running task already is), and the tasks left placed on the free workers
in the order they were submitted, as the pool runs them.
"""
import time

HEARTBEAT = 60.0  # seconds without a line before the running tasks are listed


def duration(seconds):
    """``m:ss`` (``h:mm:ss`` from an hour on)."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """Progress of ``tasks`` (their labels, in the order they are submitted to ``jobs``
    workers). ``recorded``: {label: seconds} of an earlier run (a task missing from it leaves
    the estimate out); ``say``: where the lines go; ``clock``: seconds, monotonic."""

    def __init__(self, tasks, jobs, recorded, say=print, clock=time.monotonic):
        self.tasks, self.jobs, self.recorded = list(tasks), jobs, dict(recorded)
        self.say, self.clock = say, clock
        self.begun = self.last = clock()
        self.running = {}  # {label: start time}
        self.done = {}  # {label: seconds it took}

    def _line(self, text):
        now = self.clock()
        self.last = now
        left = self.remaining(now)
        about = "" if left is None else f", about {duration(left)} left"
        self.say(f"[progress {duration(now - self.begun)}] {text}; {len(self.done)} of "
                 f"{len(self.tasks)} done{about}", flush=True)

    def started(self, label):
        self.running[label] = self.clock()
        recorded = self.recorded.get(label)
        self._line(f"{label} started" + (f" ({duration(recorded)} recorded)"
                                         if recorded is not None else ""))

    def finished(self, label):
        start = self.running.pop(label, None)
        now = self.clock()
        self.done[label] = now - start if start is not None else None
        took = f" in {duration(now - start)}" if start is not None else ""
        self._line(f"{label} finished{took}")

    def heartbeat(self):
        """A line listing the running tasks, once ``HEARTBEAT`` seconds passed in silence."""
        now = self.clock()
        if now - self.last < HEARTBEAT:
            return
        running = ", ".join(f"{label} for {duration(now - start)}"
                            for label, start in self.running.items()) or "nothing"
        self._line(f"running {running}")

    def speed(self, now=None):
        """Seconds taken per recorded second: over the finished tasks (1 before any), and at
        least what every running task has already taken per recorded second (while nothing
        has finished on a slower machine, the running tasks show it)."""
        now = self.clock() if now is None else now
        pairs = [(took, self.recorded[label]) for label, took in self.done.items()
                 if took is not None and self.recorded.get(label)]
        recorded = sum(r for _, r in pairs)
        k = sum(t for t, _ in pairs) / recorded if recorded > 0 else 1.0
        running = [(now - start) / self.recorded[label] for label, start in self.running.items()
                   if self.recorded.get(label)]
        return max(k, min(running)) if running else k

    def remaining(self, now=None):
        """Seconds until every task is done: the running ones finish after their scaled
        recorded time (at least now), the waiting ones go in order to the first free worker.
        None when a task left has no recorded duration."""
        now = self.clock() if now is None else now
        left = [t for t in self.tasks if t not in self.done]
        if any(t not in self.recorded for t in left):
            return None
        k = self.speed(now)
        free = sorted(max(self.recorded[t] * k - (now - start), 0.0)
                      for t, start in self.running.items())
        free += [0.0] * max(self.jobs - len(free), 0)
        for t in left:
            if t in self.running:
                continue
            free.sort()
            free[0] += self.recorded[t] * k
        return max(free) if free else 0.0
