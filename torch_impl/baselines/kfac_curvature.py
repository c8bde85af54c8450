r"""The extra backward of K-FAC's "mc" and "type-2" flavours (:mod:`.kfac_flavours`, KC2/KC3) in
a training loop: :meth:`~.kfac.KFAC.curvature_backward`.

On a factor-update step the loop calls ``kfac.curvature_backward(output, targets, loss_func)``
after the forward and before ``loss.backward()``. It back-propagates each column of the
flavour (C for type-2, M for mc) from ``output`` with ``torch.autograd.grad`` to the
preconditioned weights (``retain_graph``: the training backward follows; nothing is written to
``.grad``). The capture's hooks on the layers' outputs fire for every column as they do for the
training backward, and while the columns run they route the output-gradient statistic here
(:class:`ColumnSums`) instead of into the layer's pair; the input statistic A still comes from
the forward, paired by the training backward, whose own output-gradient rows are then not used
for G. On other steps, and with ``fisher_type="empirical"``, the call does nothing, so one loop
serves every flavour.

The **self-check** runs on the columns too: each column's rows are committed to it and the
weight's gradient of that column's ``autograd.grad`` (its hook fires for ``autograd.grad``
as for a backward) is compared with Σ g aᵀ over them, exactly as for the training backward
(which is checked as well: it still verifies the rows a).

**Scaling.** Per layer, G = (Σ over columns and rows of g gᵀ) / D, the sums and D added over
the calls (micro-batches, ranks) whose columns reached the layer: D = the counted positions
of the loss for reduction "mean" (the union of the micro-batches and ranks taken as one
batch, as the empirical G's row counts do), and 1 per call for "sum" (k micro-batches of a
loss divided by k, the empirical G's convention; DDP averages the ranks' gradients). The
columns are of the unscaled ``output``: no ``GradScaler`` division.

"mc" draws from ``KFAC(generator=)`` (a ``torch.Generator`` on the output's device), or
torch's global generator.

Not supported (refused by name): ``grad_hook="module"`` (the columns ride the output-gradient
tensor hooks) and FSDP2 (``fully_shard``: its gradient hooks would run around every column).
"""
import torch

from .kfac_flavours import check_flavour, kfac_columns, reduction_factor

__all__ = ["ColumnSums", "check_flavour_options", "column_sums", "curvature_backward"]


class ColumnSums:
    """Per layer, the output-gradient statistics of the curvature columns: ``pending`` ones
    (their forward's training backward has not run yet) and ``done`` ones (it has: they pair
    with a committed input statistic), each with its denominator D (module docstring)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.pending, self.done = {}, {}
        self.reduction = None  # "mean" / "sum" of the step's losses (one per step)
        self._reached = set()

    def add(self, layer, g_stat):
        """A column's statistic of one call (the capture's commit, during the columns)."""
        s = g_stat[0]
        sums, den = self.pending.get(layer.name, (None, 0))
        self.pending[layer.name] = (s if sums is None else sums + s, den)
        self._reached.add(layer.name)

    def close(self, den):
        """One curvature_backward is over: its D joins the layers its columns reached."""
        for name in self._reached:
            sums, d = self.pending[name]
            self.pending[name] = (sums, d + den)
        self._reached = set()

    def paired(self, layer, stale=False):
        """The training backward committed ``layer``'s pair: its pending columns are done
        (``stale``: the earlier pairs' gradient was cleared, so their columns go)."""
        if stale:
            self.done.pop(layer.name, None)
        if layer.name not in self.pending:
            return
        sums, den = self.pending.pop(layer.name)
        old, d = self.done.get(layer.name, (None, 0))
        self.done[layer.name] = (sums if old is None else old + sums, d + den)

    def drop_completed(self):
        """``zero_grad``: the columns of completed pairs go with their gradients."""
        self.done = {}

    def get(self, name):
        """(Σ g gᵀ, D) of the layer's completed columns, or None."""
        return self.done.get(name)


def curvature_backward(kfac, output, targets, loss_func):
    """The columns of ``kfac.fisher_type`` back-propagated from ``output`` (module docstring).
    Returns the number of columns run (0 when there is nothing to do)."""
    # capturing: the hooks' gate, open exactly on the steps that update the factors
    if kfac.fisher_type == "empirical" or kfac._detached or not kfac._capture.capturing:
        return 0
    if not isinstance(output, torch.Tensor) or not output.requires_grad:
        raise ValueError("curvature_backward: output must be the tensor loss_func takes, "
                         "computed with grad by the forward of this step")
    sums = kfac._columns
    R = reduction_factor(loss_func, output, targets)
    if sums.reduction not in (None, loss_func.reduction):
        raise ValueError(f"curvature_backward: loss_func.reduction {loss_func.reduction!r} "
                         f"differs from {sums.reduction!r} earlier in this step")
    sums.reduction = loss_func.reduction
    # D of this call: the counted positions (1/R) for a mean, 1 for a sum
    den = (1.0 / R if loss_func.reduction == "mean" else 1.0)
    columns = kfac_columns(loss_func, output, targets, kfac.fisher_type, kfac.mc_samples,
                           kfac.generator)
    weights = list({id(l.module.weight): l.module.weight for l in kfac._layers
                    if l.module.weight.requires_grad}.values())
    sharded = _fsdp2_modules(kfac._capture.model)
    if sharded:  # FSDP2's hooks would run around every column's backward
        raise RuntimeError(f"curvature_backward: the FSDP2 (fully_shard) modules {sharded} "
                           "are not supported (the columns' backward passes would run FSDP2's "
                           "gradient hooks): use fisher_type='empirical' under FSDP2")
    capture = kfac._capture
    capture.in_columns = True
    try:
        for col in columns:
            torch.autograd.grad(output, weights, grad_outputs=col, retain_graph=True,
                                allow_unused=True)
    finally:
        capture.in_columns = False
    sums.close(den)
    return len(columns)


def _fsdp2_modules(model):
    """Names of the ``fully_shard`` modules of ``model`` (its weights are unsharded, plain
    tensors, between the forward and the backward: the module class tells)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2 has none
        return []
    return [name or "<model>" for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def check_flavour_options(model, layers, fisher_type, kfac_approx, mc_samples, generator,
                          grad_hook):
    """Named ValueErrors for KFAC's flavour options, and for what a flavour cannot derive."""
    check_flavour(fisher_type, kfac_approx, mc_samples, generator)
    if fisher_type != "mc" and (mc_samples != 1 or generator is not None):
        raise ValueError(f"mc_samples / generator: only apply to fisher_type='mc', got "
                         f"mc_samples={mc_samples!r}, generator={generator!r} with "
                         f"fisher_type={fisher_type!r}")
    if fisher_type != "empirical" and grad_hook != "tensor":
        raise ValueError(f"grad_hook: fisher_type={fisher_type!r} routes the columns through "
                         "the output-gradient hooks of grad_hook='tensor', got "
                         f"{grad_hook!r}")
    if kfac_approx != "reduce":
        return
    for layer in layers:
        if layer.experts is not None or layer.kind == "mha_out":
            what = ("a stack of experts, whose routed rows" if layer.experts is not None else
                    "an nn.MultiheadAttention out-projection, whose rows")
            raise ValueError(f"kfac_approx='reduce': {layer.name} is {what} have no "
                             "batch-first per-sample structure")
    for name, module in model.named_modules():
        if getattr(module, "batch_first", True) is False:
            raise ValueError(f"kfac_approx='reduce': {name or '<model>'} has batch_first=False "
                             "(its rows are sequence-first, so the first leading dimension "
                             "does not index the samples)")


def column_sums(kfac, layer):
    """(Σ g gᵀ, D) of ``layer``'s curvature columns; a layer with statistics but no columns
    means curvature_backward was not called (or its output did not reach the layer): an
    error, never a silent fall back to the training rows. (A call with 0 rows has columns
    too: the hook of its empty output fires, with zeros.)"""
    found = kfac._columns.get(layer.name)
    if found is None:
        raise RuntimeError(
            f"KFAC(fisher_type={kfac.fisher_type!r}): {layer.name} has statistics for this "
            "factor update but no curvature columns: call kfac.curvature_backward(output, "
            "targets, loss_func) after the forward and before loss.backward() on every "
            "factor-update step (with the output that reaches every preconditioned layer)")
    return found
