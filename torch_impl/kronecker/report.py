"""The table a hook-based preconditioner (``MKOR``, ``KFAC``) tells about its layers: which are
preconditioned and why the others are not, which rows each read, and the self-check's
verdicts (:meth:`~.optimizer.PreconditionedOptimizer.capture_report` builds it)."""

import torch

__all__ = ["CaptureReport", "row_count"]


def row_count(count):
    """A layer's row count; a stack of experts has one per expert (a list)."""
    if isinstance(count, torch.Tensor) and count.dim() == 1:
        return [int(c) for c in count.tolist()]
    return int(count)


class CaptureReport(dict):
    """{module name: row} (see ``capture_report``); ``notes``: the token inputs a mask could
    not be tied to, and why; ``str()`` is a table."""

    def __init__(self, rows, notes=()):
        super().__init__(rows)
        self.notes = list(notes)

    def __str__(self):
        width = max([len("module"), *(len(name or "<model>") for name in self)])
        mask_width = max([len("mask"), *(len(row["mask"] or "") for row in self.values())])
        lines = [f"{'module':<{width}} {'precond.':<8} {'mask':<{mask_width}} {'rows':>6}  "
                 "self-check / reason"]
        for name, row in self.items():
            check = row["self_check"]
            verdict = ", ".join(f"{k} {check[k]}" for k in ("padding", "weight") if k in check)
            why = row["reason"] or row["unmasked"] or ""
            rows = ("" if row["rows"] is None else str(sum(row["rows"])) if
                    isinstance(row["rows"], list) else str(row["rows"]))
            lines.append(f"{name or '<model>':<{width}} "
                         f"{'yes' if row['preconditioned'] else 'no':<8} "
                         f"{row['mask'] or '':<{mask_width}} {rows:>6}  "
                         f"{'; '.join(x for x in (verdict, why) if x)}".rstrip())
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)
