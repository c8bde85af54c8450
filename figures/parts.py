"""A figure's runs trained in parts by ``python -m figures --jobs N`` workers, saved, and read
back by the process that draws the figure."""
import pathlib
import pickle


class PartFinished(Exception):
    """Raised by ``common.run_curves`` under ``ctx.part`` once its share of the runs is saved:
    the figure is drawn later, by a process that reads every part back."""


class Parts:
    """How ``common.run_curves`` gets one run's (rows, switch step). Plain: it trains. Under
    ``ctx.part = (k, n)``: the runs are numbered in the order met, this process trains those
    numbered k mod n and saves them to ``ctx.parts_dir`` (:meth:`finish` raises
    :class:`PartFinished`). With only ``ctx.parts_dir``: every run is read from the saved
    parts, so the figure is drawn without training. Each run is seeded on its own, so the
    runs, and the figure, are those of one process training them all."""

    def __init__(self, ctx, figure):
        self.ctx, self.figure, self.count, self.done = ctx, figure, 0, {}
        if ctx.parts_dir is not None and ctx.part is None:
            for path in sorted(pathlib.Path(ctx.parts_dir).glob(f"{figure}.part*.pkl")):
                self.done.update(pickle.loads(path.read_bytes()))

    @staticmethod
    def key(spec, lr, seed):
        return repr((spec.base, spec.overrides, lr, seed))

    def run(self, run_fn, spec, lr, seed):
        key, i = self.key(spec, lr, seed), self.count
        self.count += 1
        if self.ctx.part is not None:
            k, n = self.ctx.part
            if i % n != k:
                return None, None  # another part's run
        elif self.ctx.parts_dir is not None:
            if key not in self.done:
                raise RuntimeError(f"{self.figure}: run {key} is in none of the saved parts "
                                   f"in {self.ctx.parts_dir}")
            return self.done[key]
        rows, opt = run_fn(spec, lr, seed)
        self.done[key] = (rows, opt.switch_step)
        return self.done[key]

    def finish(self):
        if self.ctx.part is not None:
            k, n = self.ctx.part
            path = pathlib.Path(self.ctx.parts_dir) / f"{self.figure}.part{k}of{n}.pkl"
            path.write_bytes(pickle.dumps(self.done))
            raise PartFinished(f"part {k + 1} of {n}: {len(self.done)} of {self.count} runs")
