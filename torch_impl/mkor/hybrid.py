r"""MKOR-H: a one-way switch from MKOR to its first-order backbone (spec MKOR.md K18).

The paper's hybrid "falls back to a first-order optimizer if the second-order updates
no longer accelerate convergence"; no released code automates it, so this project's
rule (K18), mirrored from ``reference/mkor/hybrid.py``, is: with t = 0, 1, ... the
index of the observed losses (MKOR's step counter) and window W,

.. math::
    \bar\ell_t = \frac1W \sum_{s=t-W+1}^{t} \ell_s, \qquad
    r_t = \frac{\bar\ell_{t-W} - \bar\ell_t}{W\,|\bar\ell_{t-W}|},

checked whenever n = t + 1 >= 2W and n % check_every == 0. A check is *slow* when
r_t < threshold (a non-finite r_t, or \bar\ell_{t-W} = 0, counts as slow); the switch
fires at the check that completes ``patience`` consecutive slow checks, or at
t = ``switch_step``, whichever comes first, and never un-fires.

The second half of this module is MKOR-H's part of :class:`~.preconditioner.MKOR`, a
component it holds (:class:`HybridSwitch`): the feed that brings the rule each step's loss,
and the state of the one-way hand-over to the backbone.

The rule is plain Python on floats: reading a loss tensor into a float is the
caller's host synchronisation, never the preconditioner's.
"""
import math

import torch
import torch.distributed as dist

from ..common.validation import check_int, check_number
from ..kronecker.capture.hooks import CopyInertHook
from ..kronecker.exchange import world_size

__all__ = ["LossRateSwitch", "LossFeed", "HybridSwitch"]


class LossRateSwitch:
    """The K18 switching rule (mirrors ``reference.mkor.hybrid.LossRateSwitch``).

    Args:
        window: W >= 1, the number of losses in each mean.
        check_every: check period in steps, >= 1.
        threshold: tau; None disables the rate rule (then only ``switch_step`` acts).
        patience: consecutive slow checks needed, >= 1.
        switch_step: optional k >= 0: switch exactly at t = k.

    No defaults: ``MKOR``'s ``switch_window``, ``switch_check_every``, ``switch_threshold``
    and ``switch_patience`` are where they are written.

    :meth:`observe` returns whether the switch has happened (True from the firing
    step on); ``switched_at`` is the t at which it fired.
    """

    def __init__(self, window, check_every, threshold, patience, switch_step=None):
        check_int("window", window, low=1)
        check_int("check_every", check_every, low=1)
        check_int("patience", patience, low=1)
        if threshold is not None:
            check_number("threshold", threshold, finite=True)
        if switch_step is not None:
            check_int("switch_step", switch_step, low=0)
        self.window, self.check_every, self.patience = window, check_every, patience
        self.threshold, self.switch_step = threshold, switch_step
        self.t = 0              # index of the next observed loss
        self.slow_checks = 0    # current run of consecutive slow checks
        self.switched_at = None
        self.rates = []         # (t, r_t) of every check
        self._recent = []       # the last 2W losses

    @property
    def switched(self):
        return self.switched_at is not None

    def rate(self):
        """r_t from the last 2W losses; -inf when not measurable (counts as slow)."""
        w = self.window
        older = math.fsum(self._recent[:w]) / w
        newer = math.fsum(self._recent[w:]) / w
        if older == 0 or not (math.isfinite(older) and math.isfinite(newer)):
            return -math.inf
        return (older - newer) / (w * abs(older))

    def step_due(self, t):
        """Whether the deterministic ``switch_step`` rule fires at step t."""
        return self.switch_step is not None and t >= self.switch_step

    def observe(self, loss):
        """Record step t's loss (a Python number); return True iff switched (one-way)."""
        t = self.t
        self.t += 1
        if self.switched:
            return True
        self._recent.append(float(loss))
        del self._recent[:-2 * self.window]
        if self.step_due(t):
            self.switched_at = t
            return True
        n = t + 1
        if self.threshold is not None and n >= 2 * self.window and n % self.check_every == 0:
            r_t = self.rate()
            self.rates.append((t, r_t))
            self.slow_checks = self.slow_checks + 1 if not r_t >= self.threshold else 0
            if self.slow_checks >= self.patience:
                self.switched_at = t
        return self.switched

    def force(self, t):
        """Mark the switch as fired at step t (used for ``switch_step`` without losses)."""
        if not self.switched:
            self.switched_at = t

    def state_dict(self):
        return {"t": self.t, "slow_checks": self.slow_checks, "switched_at": self.switched_at,
                "rates": list(self.rates), "recent": list(self._recent)}

    def load_state_dict(self, state):
        self.t, self.slow_checks = state["t"], state["slow_checks"]
        self.switched_at = state["switched_at"]
        self.rates = [tuple(r) for r in state["rates"]]
        self._recent = list(state["recent"])


class LossFeed:
    """How MKOR-H's rule gets its losses without a host sync on every step.

    Losses arrive as tensors or numbers: from :meth:`MKOR.step` (``loss=`` or a closure),
    from :meth:`MKOR.observe_loss`, or tapped from the model's output (a ``ModelOutput`` or
    dict with a scalar ``loss``, as every transformers model returns; the mean over the
    micro-batches of a step whose backward ran). Tensors wait in a buffer until the rule can act, i.e. until
    the next loss completes a multiple of ``check_every``; then one ``tolist()`` reads them
    all (one synchronisation per ``check_every`` steps). The rule only decides at those
    steps, so its decisions, rates and switch step are those of feeding every loss at once.

    Distributed, each loss is replaced by its mean over the ranks as it is buffered (``mean``:
    one 0-d all-reduce, no host sync), so the buffer is the same on every rank. A checkpoint
    then carries the run's losses whichever rank's copy it keeps (DCP saves one copy of an
    entry several ranks hold; ``torch.save`` of rank 0's state dict is one rank's too), and
    it resumes at any world size. (Averaging at the read instead would save one rank's own
    losses, and a resumed run would average that rank's losses with themselves.)
    """

    def __init__(self, rule, mean=None):
        self.rule = rule
        self.mean = mean    # callable(loss) -> its mean over the ranks, or None
        self.buffer = []    # losses not yet fed to the rule
        self.tapped = []    # this step's losses read from the model output

    def tap(self, output):
        """Forward hook body: a scalar ``loss`` of the model's output counts once its
        backward runs (a hook on the loss tensor), so a forward that is never
        back-propagated, or whose gradients are zeroed before the step, adds nothing."""
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad:
            value = loss.detach()
            loss.register_hook(lambda grad: self.tapped.append(value))

    def take_tapped(self):
        """The mean of this step's tapped losses (a tensor), or None; clears them."""
        tapped, self.tapped = self.tapped, []
        if not tapped:
            return None
        return tapped[0] if len(tapped) == 1 else torch.stack(
            [t.to(tapped[0].device, torch.float64) for t in tapped]).mean()

    def push(self, loss):
        """Buffer one step's loss; returns True when the rule should now be fed."""
        loss = loss.detach() if isinstance(loss, torch.Tensor) else float(loss)
        self.buffer.append(loss if self.mean is None else self.mean(loss))
        return (self.rule.t + len(self.buffer)) % self.rule.check_every == 0

    def flush(self):
        """Feed the buffered losses to the rule; returns whether it switched."""
        values, self.buffer = self.buffer, []
        if not values:
            return self.rule.switched
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        if tensors:  # one read for all of them
            read = iter(torch.stack([t.to(tensors[0].device, torch.float64)
                                     for t in tensors]).tolist())
            values = [next(read) if isinstance(v, torch.Tensor) else v for v in values]
        for value in values:
            if self.rule.observe(value):
                return True
        return False

    def drop(self):
        """Forget the tapped losses of completed backwards (zeroed or skipped gradients)."""
        self.tapped = []

    def state_dict(self):
        buffered = [float(v) for v in self.buffer]
        return {"buffer": buffered}

    def load_state_dict(self, state):
        self.buffer = list(state.get("buffer", []))
        self.tapped = []


# ---------------------------------------------------------------- MKOR-H inside MKOR
class _LossTap(CopyInertHook):
    """The model's forward hook that hands a train-mode output's loss to the feed (a copy of
    the model gets an inert hook, never a tap into this feed)."""

    def __init__(self, feed):
        self.feed = feed

    def __call__(self, module, args, output):
        if module.training and torch.is_grad_enabled():
            self.feed.tap(output)


class HybridSwitch:
    """MKOR-H inside :class:`~.preconditioner.MKOR`, a component it holds: the rule
    (``hybrid_switch="loss_rate"`` or ``switch_step``), the feed that brings the rule each
    step's loss (for the loss rule, tapped from the model output too), and whether the one-way
    hand-over has happened. MKOR does the hand-over itself (hooks removed, factors freed) when
    :meth:`observe_loss`, :meth:`observe` or :meth:`step_due` says so, then calls
    :meth:`mark_switched`.

    Args:
        options: a :class:`~.config.SwitchOptions`.
        model: the unwrapped model, whose output's loss the loss rule taps.
        process_group: the ranks whose mean loss the rule sees (None: the world).
        device: ``callable() -> device`` where a loss is averaged over the ranks.
    """

    def __init__(self, options, model, process_group=None, device=None):
        self.options = o = options
        self.process_group = process_group
        self._device = device
        self.switched = False
        self.rule = None
        if o.hybrid_switch == "loss_rate" or o.switch_step is not None:
            self.rule = LossRateSwitch(
                window=o.switch_window, check_every=o.switch_check_every,
                threshold=o.switch_threshold if o.hybrid_switch == "loss_rate" else None,
                patience=o.switch_patience, switch_step=o.switch_step)
        self.feed = None if self.rule is None else LossFeed(self.rule, self._mean_over_ranks)
        self._fed_by_hand = False  # observe_loss() was called since the last step
        self._tap_handle = None
        if o.hybrid_switch == "loss_rate":
            self._tap_handle = model.register_forward_hook(_LossTap(self.feed))

    def step_due(self, steps):
        """Whether the deterministic ``switch_step`` rule fires at MKOR's step ``steps``."""
        return self.rule is not None and self.rule.step_due(steps)

    def mark_switched(self, steps):
        """The hand-over happened at step ``steps``: the tap goes, the rule records it."""
        self.remove()
        self.switched = True
        if self.rule is not None:
            self.rule.force(steps)

    def remove(self):
        """Detach the tap on the model's output."""
        if self._tap_handle is not None:
            self._tap_handle.remove()

    def _mean_over_ranks(self, loss):
        """A loss (0-d tensor or float) as its mean over the ranks, a 0-d float64 tensor
        (one all-reduce, no host sync); unchanged on one rank."""
        world = world_size(self.process_group)
        if world == 1:
            return loss
        total = torch.as_tensor(loss, dtype=torch.float64,
                                device=self._device()).reshape(()).clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.process_group)
        return total / world

    def observe_loss(self, loss):
        """Feed a loss given by hand (:meth:`MKOR.observe_loss`); returns whether the rule
        switches now."""
        if self.feed is not None and not self.switched:
            self._fed_by_hand = True
            return self.feed.push(loss) and self.feed.flush()
        return False

    def observe(self, loss, steps, warn):
        """Step ``steps``'s loss, before preconditioning: ``loss`` (argument or closure), else
        one given to :meth:`observe_loss` since the last step, else the model output's;
        ``warn`` is called with a message if the loss rule got none. Returns whether the rule
        switches now."""
        fed_by_hand, self._fed_by_hand = self._fed_by_hand, False
        if self.feed is None or self.switched or self.options.hybrid_switch != "loss_rate":
            return False
        tapped = self.feed.take_tapped()
        if loss is None and fed_by_hand:
            return False
        loss = tapped if loss is None else loss
        if loss is None:
            warn(f"MKOR: hybrid_switch='loss_rate' got no loss at step {steps}: call "
                 "observe_loss(loss) or pass a closure, or return a model output with a .loss; "
                 "the switch cannot fire without losses")
            return False
        return self.feed.push(loss) and self.feed.flush()

    def drop(self):
        """Forget the losses tapped from completed backwards (their gradients are zeroed)."""
        if self.feed is not None:
            self.feed.drop()

    def state_dict(self):
        return {"switched": self.switched,
                "rule": None if self.rule is None else self.rule.state_dict(),
                "losses": None if self.feed is None else self.feed.state_dict()}

    def load_state_dict(self, state):
        """The rule's and the feed's state (the switch itself is MKOR's to replay)."""
        if self.rule is not None and state.get("rule") is not None:
            self.rule.load_state_dict(state["rule"])
        if self.feed is not None and state.get("losses") is not None:
            self.feed.load_state_dict(state["losses"])
