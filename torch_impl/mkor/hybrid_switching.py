"""MKOR-H's part of :class:`~.preconditioner.MKOR` (spec MKOR.md K18): the switch rule, the
feed that brings it each step's loss, and the one-way hand-over to the backbone."""
import torch

from .hook_objects import CopyInertHook
from .distributed import mean_over_ranks, world_size
from .hybrid import LossFeed, LossRateSwitch

__all__ = ["HybridSwitching"]


class _LossTap(CopyInertHook):
    """The model's forward hook that hands a train-mode output's loss to the feed (a copy of
    the model gets an inert hook, never a tap into this feed)."""

    def __init__(self, feed):
        self.feed = feed

    def __call__(self, module, args, output):
        if module.training and torch.is_grad_enabled():
            self.feed.tap(output)


class HybridSwitching:
    """Mixin of MKOR: ``_init_hybrid`` builds the rule (``hybrid_switch="loss_rate"`` or
    ``switch_step``) and, for the loss rule, taps the model output's loss."""

    def _init_hybrid(self, o, model):
        self._switched = False
        self._rule = None
        if o.hybrid_switch == "loss_rate" or o.switch_step is not None:
            self._rule = LossRateSwitch(
                o.switch_window, o.switch_check_every,
                o.switch_threshold if o.hybrid_switch == "loss_rate" else None,
                o.switch_patience, o.switch_step)
        self._feed = None if self._rule is None else LossFeed(self._rule, self._mean_over_ranks)
        self._fed_by_hand = False  # observe_loss() was called since the last step
        self._tap_handle = None
        if o.hybrid_switch == "loss_rate":
            self._tap_handle = model.register_forward_hook(_LossTap(self._feed))

    @property
    def switched(self):
        """Whether MKOR-H has handed over to the backbone (one-way)."""
        return self._switched

    @property
    def switch_rule(self):
        return self._rule

    def _switch(self):
        """One-way hand-over: hooks removed, factors freed, backbone state kept."""
        self._exchange.drop()
        self._capture.remove()
        if self._tap_handle is not None:
            self._tap_handle.remove()
        self._state = {}
        self._switched = True
        if self._rule is not None:
            self._rule.force(self._steps)

    def _mean_over_ranks(self, values):
        if world_size(self.process_group) == 1:
            return values
        device = self._layers[0].module.weight.device if self._layers else "cpu"
        return mean_over_ranks(values, device, self.process_group)

    def observe_loss(self, loss):
        """Feed one step's loss to the MKOR-H rule now (a float, or a tensor: reading it
        is then a host sync here). ``step(loss=...)`` does the same without the sync.
        Distributed, the rule sees the mean loss over the ranks, so every rank switches at
        the same step. Returns whether MKOR has switched."""
        if self._feed is not None and not self._switched:
            self._fed_by_hand = True
            self._feed.push(loss)
            if self._feed.flush():
                self._switch()
        return self._switched

    def _observe(self, loss):
        """This step's loss: ``loss`` (argument or closure), else one given to
        :meth:`observe_loss` since the last step, else the model output's."""
        fed_by_hand, self._fed_by_hand = self._fed_by_hand, False
        if self._feed is None or self._switched or self.options.hybrid_switch != "loss_rate":
            return
        tapped = self._feed.take_tapped()
        if loss is None and fed_by_hand:
            return
        loss = tapped if loss is None else loss
        if loss is None:
            self._warn_once("no loss", "MKOR: hybrid_switch='loss_rate' got no loss at step "
                            f"{self._steps}: pass step(loss=loss) or a closure, or return a "
                            "model output with a .loss; the switch cannot fire without losses")
            return
        if self._feed.push(loss) and self._feed.flush():
            self._switch()
