"""MKOR-H: MKOR that falls back to its first-order backbone for good (K18, MKOR.md 2.6).

The paper describes MKOR-H only in words ("falls back to a first-order optimizer if
the second-order updates no longer accelerate convergence"); no released code has an
automatic switch (the BERT runs hand an MKOR checkpoint to LAMB by hand). The rule
below is this project's documented design.
"""
import math

from reference.mkor.preconditioner import MKORReference


class LossRateSwitch:
    r"""One-way switch on the loss-reduction rate (K18). Pure Python, deterministic.

    ``observe(loss)`` is called once per training step with that step's loss. Let
    t = 0, 1, 2, ... index the calls (t is MKOR's ``steps`` counter) and n = t + 1 be
    the number of losses seen so far. With window W:

        lbar_t = (1/W) sum_{s=t-W+1}^{t} loss_s                      (defined for t >= W-1)
        r_t    = (lbar_{t-W} - lbar_t) / (W |lbar_{t-W}|)            (defined for t >= 2W-1)

    r_t is the mean relative loss decrease per step between two adjacent windows.
    A check happens at every t with n % check_every == 0 and n >= 2W. A check is
    "slow" when r_t < threshold; non-finite r_t (a NaN/inf loss, or lbar_{t-W} = 0)
    counts as slow. The switch fires at the check where ``patience`` consecutive checks
    have been slow (a check with r_t >= threshold resets the count), or at t =
    ``switch_step`` (the first ``switch_step`` calls return False), whichever is first.
    Once fired it stays fired; ``switched_at`` records the t at which it fired.

    Args (defaults: the project's, shared with torch_impl.mkor):
        window: W >= 1.
        check_every: check period in steps, >= 1.
        threshold: tau; None disables the rate rule (then only switch_step acts).
        patience: consecutive slow checks needed, >= 1.
        switch_step: optional k >= 0: switch exactly at t = k (to reproduce paper runs).
    """

    def __init__(self, window=50, check_every=10, threshold=1e-3, patience=3,
                 switch_step=None):
        if window < 1 or check_every < 1 or patience < 1:
            raise ValueError("window, check_every and patience must be >= 1")
        if switch_step is not None and switch_step < 0:
            raise ValueError("switch_step must be >= 0")
        self.window, self.check_every = int(window), int(check_every)
        self.threshold, self.patience = threshold, int(patience)
        self.switch_step = switch_step
        self.t = 0                  # index of the next observed loss
        self.slow_checks = 0        # current run of consecutive slow checks
        self.switched_at = None
        self.rates = []             # (t, r_t) of every check, for inspection
        self._recent = []           # the last 2W losses

    @property
    def switched(self):
        return self.switched_at is not None

    def rate(self):
        """r_t from the last 2W losses (the formula in the class docstring)."""
        w = self.window
        older = math.fsum(self._recent[:w]) / w
        newer = math.fsum(self._recent[w:]) / w
        if older == 0 or not (math.isfinite(older) and math.isfinite(newer)):
            return -math.inf  # no measurable progress: counts as slow
        return (older - newer) / (w * abs(older))

    def observe(self, loss):
        """Record step t's loss; return True iff the switch has happened (one-way)."""
        t = self.t
        self.t += 1
        if self.switched:
            return True
        self._recent.append(float(loss))
        del self._recent[:-2 * self.window]
        if self.switch_step is not None and t >= self.switch_step:
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


class MKORHybridReference:
    """MKOR until the switch, then the raw gradients for the backbone (K18).

    ``step(layers, loss)`` asks the switch first: before it fires it returns
    ``MKORReference.step(layers)``; from the step at which it fires on, it returns each
    layer's (grad_W, grad_b) unchanged (the same arrays), and the factors are freed
    (``self.mkor`` becomes None). The backbone's state belongs to the caller and is
    untouched by the switch, so later steps equal the backbone alone with that state.
    """

    def __init__(self, config, switch):
        self.mkor = MKORReference(config)
        self.switch = switch

    def step(self, layers, loss):
        if self.switch.observe(loss):
            self.mkor = None
            return [(layer["grad_W"], layer.get("grad_b")) for layer in layers]
        return self.mkor.step(layers)

