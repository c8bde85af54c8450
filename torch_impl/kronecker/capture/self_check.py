r"""A capture that proves itself: two facts every right capture satisfies, checked cheaply.

For a layer y = W a (+ b) whose rows were captured right, on any model:

1. **Padding rows carry no gradient.** A row the mask calls padding takes no part in the
   loss, so its output gradient g_i is exactly 0 (measured on BERT and Llama: every layer).
   A "padding" row with g_i != 0 means the mask does not describe that layer's rows.
2. **The weight's gradient is the rows'.** The gradient of one backward pass with respect
   to W is \sum_i g_i a_i^T over every call of the layer that pass went through. If it is
   not the sum over the rows the hooks captured, the weight has another use (tied, or
   ``F.linear(h, layer.weight)``), a call was missed, or the row set is wrong; the
   layer's Kronecker factors would then precondition a gradient they do not model.

Fact 2 is checked through a random projection (Freivalds): with fixed Gaussian probes
u (d_out) and v (d_in) per layer,

.. math::
    u^T \nabla W\, v \;=\; \sum_i (u^T g_i)(a_i^T v),

which costs O(rows (d_in + d_out) + d_in d_out) instead of a GEMM: a_i^T v is formed with
the input statistic, u^T g_i with the gradient's, and u^T \nabla W v in the weight's
gradient hook (which fires once per backward, after every use of the weight in it). A
discrepancy D != 0 gives u^T D v != 0 with probability 1. Both sides are rounded sums, so
the comparison allows

.. math::
    |u^T \nabla W v - \textstyle\sum_i (u^T g_i)(a_i^T v)| \;\le\;
    \big(2\gamma_{n+d+1}(u_c) + 3 u_\ell\big)\, S, \qquad
    S = \textstyle\sum_i (|u|^T |g_i|)(|a_i|^T |v|),

with n the rows, d = d_in + d_out, u_c the unit roundoff of the comparison's dtype (the
weight's promoted to float32; GEMMs accumulate at least that precisely) and u_\ell that of
the least precise data the weight's GEMM read or wrote (bf16 under autocast, TF32 on a GPU
that allows it; 0 when none is below u_c): each entry of a computed sum of n products is
within \gamma_n of the sum of their magnitudes, and the operands' and result's roundings
add u_\ell each. The ratio of the two sides is reported (a right capture measures far
below 1).

**When.** On every capture step whose statistics enter a factor update, every captured
layer is checked (``self_check=True``, the default; ``None`` or ``False``: never): no
statistic reaches a factor unverified, so rows that drift between steps (a learned scale
beside the layer, a second use of the weight on some steps only) are caught on the first
step they are wrong. A checked step reads all verdicts in one host synchronisation (and one
all-reduce of three numbers per layer across ranks, so every rank decides alike). A second
use of the weight on steps that capture nothing is seen by no statistic and no check: the
factors model the capture steps' gradients only.

**Nothing to check is not a pass.** When every term of the projected sum vanishes (S = 0:
the layer's output gradient is exactly 0, e.g. LoRA's A while B is still 0), the comparison
holds for any row set, so it proves nothing: the layer is "not yet checked", its statistics
of that step are refused, and it is checked on its first nonzero gradient.

**Fallback.** A vacuous check refuses that step's statistics of the layer (above). A padding
violation refuses that step's statistics of the layer (its factors
sit the update out) and from then on the layer uses all its rows, listed in
``unmasked_reasons``. A weight violation *releases* the layer: from then on its gradient
goes to the backbone unchanged, listed in ``skip_reasons``. Nothing is trained wrongly
in silence; the capture report shows each verdict.

Not checked: the weight under ``grad_hook="module"`` (a module's backward hook may run after
the weight's gradient, so the two sides cannot be paired per backward), and a weight sharded by FSDP2 (its gradient never passes through autograd on the
sharded parameter): the padding check still runs; the report says so.
"""
import math

import torch
import torch.distributed as dist

__all__ = ["SelfCheck", "bound_factor"]


def _unit(dtype):
    return torch.finfo(dtype).eps / 2


def bound_factor(rows, d, compare_unit, low_unit):
    """(2 gamma_{n+d+1}(u_c) + 3 u_l): the allowed discrepancy per unit of S."""
    m = rows + d + 1
    gamma = m * compare_unit / max(1e-300, 1 - m * compare_unit)
    return 2 * gamma + 3 * low_unit



def _expert_span(layer):
    """(width, (lo, hi)): the S entries a layer sends in the verdicts' all-reduce (1, or one per
    expert of a stack: all E under expert parallelism) and where its own lie."""
    shard = getattr(layer, "expert_shard", None)
    if shard is not None:
        return shard.experts, shard.seen
    width = layer.experts or 1
    return width, (0, width)

class _Run:
    """What one layer accumulated on a checked step."""

    __slots__ = ("e", "s", "n", "pad", "masked", "ratio", "fired", "committed", "low", "total")

    def __init__(self):
        self.e = self.s = None
        self.total = None     # S summed over the step (not consumed by the firings): 0 = vacuous
        self.n = 0
        self.pad = None       # max |g| over padding rows (a 0-d tensor)
        self.masked = False
        self.ratio = None     # max over firings of |difference| / bound (a 0-d tensor)
        self.fired = False
        self.committed = False
        self.low = 0.0


class SelfCheck:
    """The self-check of a :class:`~.capture.Capture` (module docstring).

    Attributes:
        all_rows: {layer: reason}: layers using all their rows after a padding violation.
        released: {layer: reason}: layers whose gradient goes to the backbone unchanged.
        verdicts: {layer: {"padding": ..., "weight": ..., "ratio": float or None}} of the
            last checked step that reached the layer.
    """

    def __init__(self, layers, enabled):
        # 1 is the former schedule's "every capture step": the one it keeps meaning
        if enabled is not None and not isinstance(enabled, bool) and not (
                type(enabled) is int and enabled == 1):
            raise ValueError(
                f"self_check must be True (check every capture whose statistics enter a "
                f"factor; 1 means the same), False or None (never), got {enabled!r}; the "
                "former every-k-th schedule let the statistics between checks reach the "
                "factors unverified")
        self.layers = list(layers)
        self.enabled = bool(enabled)
        self._by_name = {l.name: l for l in self.layers}
        self.checking = False
        self.captures = 0
        self.checks_run = 0
        self.all_rows, self.released, self.verdicts = {}, {}, {}
        self._probes = {}
        self._runs = {}
        self.no_layout = set()  # layers whose LayerType has no as_matrix
        #: {stack: [bool per expert]} of the last checked step: experts whose check was vacuous
        self.vacuous_experts = {}

    # -- schedule ----------------------------------------------------------------------
    def refresh(self, capturing):
        self.checking = bool(capturing and self.enabled)

    def reset(self):
        self._runs = {}

    def weight_checkable(self, weight):
        """A DTensor (FSDP2) weight's gradient never passes through its own hook."""
        if type(weight).__name__ == "DTensor" or type(getattr(weight, "data", None)).__name__ \
                == "DTensor":
            return False
        return True

    # -- the two sides -----------------------------------------------------------------
    def _probe(self, layer, device, dtype):
        key = (layer.name, device, dtype)
        probe = self._probes.get(key)
        if probe is None:
            index = self.layers.index(layer)
            g = torch.Generator().manual_seed(0x5E1F + index)
            d_in = layer.d_in - int(layer.has_bias)
            u = torch.randn(layer.d_out, generator=g, dtype=torch.float64)
            v = torch.randn(d_in, generator=g, dtype=torch.float64)
            # a stack of experts: one more probe c, one weight per expert, so that the one
            # projected comparison sum_e c_e u^T grad_e v checks every expert's own gradient
            c = (None if layer.experts is None else
                 torch.randn(layer.experts, generator=g, dtype=torch.float64).to(device, dtype))
            probe = self._probes[key] = (u.to(device, dtype), v.to(device, dtype), c)
        return probe

    @staticmethod
    def _dtype(layer):
        return torch.promote_types(layer.module.weight.dtype, torch.float32)

    def sketch(self, layer, rows, experts=None):
        """(a_i^T v, |a_i|^T |v|, rows' dtype, ``experts``) of one call's input rows; rows of a
        stack of experts (``experts``: each row's expert) are weighted by their expert's c_e."""
        dtype = self._dtype(layer)
        _, v, c = self._probe(layer, rows.device, dtype)
        r = rows.detach().to(dtype)
        pa, sa = r @ v, r.abs() @ v.abs()
        if experts is not None:
            pa, sa = pa * c[experts], sa * c.abs()[experts]
        return pa, sa, rows.dtype, experts

    def _run(self, name):
        run = self._runs.get(name)
        if run is None:
            run = self._runs[name] = _Run()
        return run

    def commit(self, layer, sketch, mask, g):
        """One call's gradient rows: the padding check and the projected sum."""
        pa, sa, rows_dtype, experts = sketch
        dtype = self._dtype(layer)
        u = self._probe(layer, g.device, dtype)[0]
        gg = g.to(dtype)
        product = (gg @ u) * pa
        run = self._run(layer.name)
        kept = product if mask is None else torch.where(mask, product, 0)
        run.e = kept.sum() if run.e is None else run.e + kept.sum()
        terms = (gg.abs() @ u.abs()) * sa
        s = terms.sum()
        run.s = s if run.s is None else run.s + s
        if experts is not None:  # S per expert: an expert whose terms all vanish is vacuous
            s = terms.new_zeros(layer.experts).index_add_(0, experts.reshape(-1),
                                                          terms.reshape(-1))
        run.total = s if run.total is None else run.total + s
        run.n += product.numel()
        low = max(_unit(rows_dtype), _unit(g.dtype), _unit(layer.module.weight.dtype))
        run.low = max(run.low, low if low > _unit(dtype) else 0.0)
        run.committed = True
        if mask is not None:
            padding = torch.where(mask.unsqueeze(-1), 0, g.abs())
            pad = padding.amax() if padding.numel() else g.new_zeros(())
            run.pad = pad if run.pad is None else torch.maximum(run.pad, pad)
            run.masked = True

    def weight_fired(self, names, grad):
        """The weight's gradient of one backward (its hook, before accumulation)."""
        layers = [self._by_name[n] for n in names]
        layer = layers[0]
        runs = [self._runs.get(n) for n in names]
        committed = [r for r in runs if r is not None and r.committed]
        dtype = self._dtype(layer)
        u, v, c = self._probe(layer, grad.device, dtype)
        try:
            matrix = layer.type.as_matrix(layer.module, grad)
        except NotImplementedError:  # a registered type without the weight's layout
            self.no_layout.add(layer.name)
            return
        if c is None:
            observed = u @ matrix.to(dtype) @ v
        else:  # sum_e c_e u^T grad_e v
            observed = c @ ((u @ matrix.to(dtype)) @ v)
        if not committed:  # a backward through a use no hook captured
            run = self._run(names[0])
            run.ratio = torch.where(observed != 0, math.inf, 0.0).to(dtype)
            run.fired = True
            return
        e = sum(r.e for r in committed)
        s = sum(r.s for r in committed)
        n = sum(r.n for r in committed) + (layer.experts or 0)  # c @ (...) sums E terms more
        low = max(r.low for r in committed)
        if grad.is_cuda and dtype == torch.float32 and (
                torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32):
            low = max(low, 2.0 ** -11)
        d = layer.d_out + layer.d_in
        bound = bound_factor(n, d, _unit(dtype), low) * s
        diff = (observed - e).abs()
        ratio = torch.where(bound > 0, diff / bound.clamp(min=torch.finfo(dtype).tiny),
                            torch.where(diff > 0, math.inf, 0.0))
        for r in committed:
            r.ratio = ratio if r.ratio is None else torch.maximum(r.ratio, ratio)
            r.fired = True
            r.e = r.s = None
            r.n = 0
            r.committed = False

    # -- verdicts ----------------------------------------------------------------------
    def finish(self, process_group=None):
        """Read and apply this step's verdicts (module docstring, Fallback); returns
        (layers refused for padding, layers released, layers whose check was vacuous)."""
        self.captures += 1
        if not self.checking:
            return [], [], []
        self.checks_run += 1
        device = self.layers[0].module.weight.device if self.layers else torch.device("cpu")
        values = []
        for layer in self.layers:
            run = self._runs.get(layer.name)
            pad = run.pad if run is not None and run.masked else None
            ratio = run.ratio if run is not None and run.fired else None
            total = run.total if run is not None and run.total is not None else None
            width, (lo, hi) = _expert_span(layer)  # S per expert for a stack
            for value, n in ((pad, 1), (ratio, 1), (total, hi - lo)):
                values.append(torch.as_tensor(-1.0 if value is None else value,
                                              dtype=torch.float64, device=device)
                              .to(torch.float64).reshape(-1).expand(n))
            if hi - lo < width:  # EP: this rank's chunk at its global place, -1 elsewhere,
                # so the MAX over the ranks meets each expert's S only from ranks that see it
                values[-1] = torch.nn.functional.pad(values[-1], (lo, width - hi), value=-1.0)
        if not values:
            return [], [], []
        packed = torch.cat(values)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(
                process_group) > 1:
            # MAX: a failure on any rank fails everywhere, and S = 0 only if 0 on every rank
            dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=process_group)
        flat = packed.tolist()  # the check step's one host synchronisation
        self._runs = {}
        self.vacuous_experts = {}
        flagged, released, vacuous = [], [], []
        at = 0
        for layer in self.layers:
            width, (lo, hi) = _expert_span(layer)
            pad, ratio, totals = flat[at], flat[at + 1], flat[at + 2 + lo:at + 2 + hi]
            at += 2 + width
            total = max(totals)
            name = layer.name
            if pad < 0 and ratio < 0 and total < 0:
                continue
            verdict = self.verdicts.setdefault(name, {})
            verdict["step_check"] = self.checks_run
            if pad >= 0 and math.isfinite(pad):
                verdict["padding"] = "pass" if pad == 0 else "fail"
                verdict["padding_max_grad"] = pad
                if pad > 0 and name not in self.all_rows:
                    self.all_rows[name] = (
                        "self-check: rows its mask calls padding carried a nonzero output "
                        f"gradient (max |g| = {pad:.3g}), so the mask does not describe its "
                        "rows: all rows are used from this step on")
                    flagged.append(name)
            elif pad >= 0:
                verdict["padding"] = "not run: non-finite gradient"
            verdict.pop("ratio", None)
            if name in self.no_layout:
                verdict["weight"] = "not run: its LayerType has no as_matrix"
            if verdict.get("padding") == "fail" and ratio > 1:
                # the mask explains the mismatch: all rows from now on, not a release
                verdict["weight"] = "not judged: the padding check failed"
            elif ratio > 1 and not math.isnan(ratio):
                verdict["weight"] = "fail"
                verdict["ratio"] = ratio
                if name not in self.released:
                    why = ("a backward reached the weight through a use no hook captured"
                           if math.isinf(ratio) else
                           f"its gradient differs from the sum of g a^T over its captured "
                           f"rows by {ratio:.3g} times the rounding bound")
                    self.released[name] = (
                        f"self-check: {why} (a tied or functional second use of the weight, "
                        "a call the hooks missed, or a wrong row set): not preconditioned "
                        "from this step on; its gradient goes to the backbone unchanged")
                    released.append(name)
            elif total == 0 or (total < 0 and ratio == 0):
                # every term vanished (or no rows and a zero gradient): any row set passes
                verdict["weight"] = "not yet checked: gradient zero"
                vacuous.append(name)
            elif ratio >= 0 and not math.isnan(ratio):
                verdict["weight"] = "pass"
                verdict["ratio"] = ratio
            if layer.experts is not None and total > 0 and min(totals) == 0:
                # the experts whose own terms all vanished: their statistics wait, as a
                # one-Linear-per-expert twin's would
                self.vacuous_experts[name] = [t == 0 for t in totals]
        return flagged, released, vacuous
