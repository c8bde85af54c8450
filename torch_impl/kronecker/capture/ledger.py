"""Every layer accounted for: whether its factors have taken a statistic, and if not, why.

A layer is *preconditioned* from the first capture step whose statistics of it were accepted
(complete, and passed by the self-check when it runs) and entered its factor update; until
then its gradient goes to the backbone unchanged (the optimizer gates the product on its
factors' accepted-update counters, on the device) and it is listed here with the reason:

* never captured: no forward and backward of it reached its hooks on a capture step (unused
  so far, in ``eval()``, or a forward whose output is not a tensor the hooks can follow);
* gradient zero so far: its output gradient was exactly 0, so the self-check could prove
  nothing (:mod:`.self_check`) and the statistics were refused; checked on the first
  nonzero one (LoRA's A while B is 0);
* refused: its statistics so far were refused by the padding check (it uses all its rows
  from then on).

Before the first capture step no layer has been through one, and none is listed.
Released layers (:attr:`.self_check.SelfCheck.released`) are listed by the self-check.
"""

__all__ = ["Ledger"]

NEVER_CAPTURED = (
    "not preconditioned yet: never captured (no forward and backward of it reached its hooks "
    "on a capture step: unused so far, run in eval(), or its forward returns something other "
    "than one tensor); its gradient goes to the backbone unchanged until its factors have "
    "taken a statistic")
GRADIENT_ZERO = (
    "not preconditioned yet: its output gradient has been exactly 0 on every capture step so "
    "far, so the self-check could verify nothing and its statistics were refused; it is "
    "checked on its first nonzero gradient, and its gradient goes to the backbone unchanged "
    "until then")
REFUSED = (
    "not preconditioned yet: its statistics so far were refused by the self-check's padding "
    "check (it uses all its rows from now on); its gradient goes to the backbone unchanged "
    "until its factors have taken a statistic")


class Ledger:
    """{layer: reason} for the layers whose factors have taken no statistic yet.

    Attributes:
        accepted: names of layers whose statistics entered a factor update at least once.
        waiting: {name: reason} of the others, after the first capture step.
        steps: capture steps recorded so far.
    """

    def __init__(self, layers):
        self.names = [layer.name for layer in layers]
        self.accepted = set()
        self.waiting = {}
        self.steps = 0

    def record(self, has_statistics, vacuous, refused, released):
        """One capture step: ``has_statistics(name)`` says whether the layer's statistics of
        this step enter its factor update (after the self-check's refusals); ``vacuous`` and
        ``refused`` name the layers whose statistics the check refused and why."""
        self.steps += 1
        for name in self.names:
            if name in released:
                self.waiting.pop(name, None)
            elif has_statistics(name):
                self.accepted.add(name)
                self.waiting.pop(name, None)
            elif name not in self.accepted:
                # this step's reason, else the earlier (more specific) one, else the generic
                self.waiting[name] = (GRADIENT_ZERO if name in vacuous else
                                      REFUSED if name in refused else
                                      self.waiting.get(name, NEVER_CAPTURED))

    def restore(self, accepted, optimizer_steps):
        """After a checkpoint load: ``accepted`` (the layers whose loaded factors have taken
        an update) and the optimizer's step count; the others wait with the generic reason."""
        self.accepted = set(accepted)
        self.steps = optimizer_steps
        self.waiting = ({} if optimizer_steps == 0 else
                        {n: NEVER_CAPTURED for n in self.names if n not in self.accepted})

    def reason(self, name):
        """Why ``name`` is not preconditioned yet, or None."""
        return self.waiting.get(name)
