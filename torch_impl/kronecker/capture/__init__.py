"""How the Kronecker-factored preconditioners see a layer's rows: hooks on the model that pair
every forward call with its gradient and sum each layer's statistics (:class:`Capture`).

* :mod:`.capture` -- :class:`Capture`, the pairing and the hooks, holding its collaborators:
* :mod:`.calls` -- model calls, token masks, checkpoint regions (:class:`CallTracker`);
* :mod:`.statistics` -- the per-layer sums and their staleness;
* :mod:`.self_check` -- the check every capture can prove about itself;
* :mod:`.attention`, :mod:`.experts` -- the rows of an MHA out-projection and of fused experts;
* :mod:`.token_masks`, :mod:`.row_provenance` -- where masks enter and how they reach rows;
* :mod:`.eager` -- a compiled model's capture steps run eagerly;
* :mod:`.hooks`, :mod:`.guards` -- the copy-inert hook objects, and what every hook runs inside.
"""
from .capture import Capture, CaptureError
from .hooks import weak_schedule

__all__ = ["Capture", "CaptureError", "weak_schedule"]
