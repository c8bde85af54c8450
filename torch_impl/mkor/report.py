"""What the hook-based preconditioners (``MKOR``, ``KFAC``) tell about their layers: which are
preconditioned and why the others are not, which rows each read, and the self-check's
verdicts (:meth:`HookedLayers.capture_report`)."""

import torch

__all__ = ["CaptureReport", "HookedLayers"]


class HookedLayers:
    """Introspection shared by the hook-based preconditioners (``MKOR``, ``KFAC``), which keep
    ``_layers``, ``_skipped`` ({name: reason}) and a ``_steps`` counter."""

    @property
    def preconditioned_modules(self):
        """Names of the preconditioned modules (in ``named_modules`` order)."""
        return [layer.name for layer in self._layers]

    @property
    def skipped_modules(self):
        """Names of modules with parameters that go to the backbone unpreconditioned."""
        return list(self._skipped)

    @property
    def skip_reasons(self):
        """{module name: why it is not preconditioned}."""
        return dict(self._skipped)

    @property
    def unmasked_reasons(self):
        """{module name: why its rows were not selected by a token mask}: layers that ran in
        a call with token masks but whose rows could not be matched to their mask (e.g. a
        pooler's (B, d) rows, an MoE expert's routed rows); they use all their rows."""
        return dict(self._capture.unmasked)

    @property
    def steps(self):
        return self._steps

    def capture_report(self):
        """What was captured, in one call: a :class:`CaptureReport` ({module name: row}).

        Each row: ``preconditioned`` (bool) and ``reason`` (why not, or why it stopped);
        ``mask``: where its rows' mask came from at its last capture ("tokens": a token
        mask in the rows' own layout; "per sample": one row per sample, all real; "none":
        its rows come from no masked input, or the call had no mask; "untied": a mask
        exists but the rows could not be tied to it; "all rows (self-check)"), with
        ``unmasked`` the reason when the rows use no mask although masks were there;
        ``rows``: rows counted at its last capture (reading a masked count is a host
        synchronisation, made here and not in the step); ``self_check``: the verdicts of
        its last checked capture ({"padding": "pass" | "fail", "weight": "pass" | "fail",
        "ratio": discrepancy / rounding bound, ...}, empty until checked)."""
        capture = self._capture
        released = capture.check.released
        rows = {}
        for layer in self._layers:
            name = layer.name
            count = capture.last_rows.get(name)
            rows[name] = {
                "preconditioned": name not in released,
                "reason": released.get(name),
                "mask": capture.mask_source.get(name, "not captured yet"),
                "unmasked": capture.unmasked.get(name),
                "rows": None if count is None else _rows(count),
                "eval_mode_seen": name in capture.eval_seen,
                "self_check": dict(capture.check.verdicts.get(name, {})),
            }
        for name, reason in self._skipped.items():
            if name not in rows:
                rows[name] = {"preconditioned": False, "reason": reason, "mask": None,
                              "unmasked": None, "rows": None, "eval_mode_seen": False,
                              "self_check": {}}
        return CaptureReport(rows, sorted(capture.mask_notes))


def _rows(count):
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
