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

**When.** On the first capture step and every ``self_check``-th capture step after it
(None: never), every captured layer is checked: a layer first used later is checked at
the next such step. A checked step reads all verdicts in one host synchronisation (and one
all-reduce of two numbers per layer across ranks, so every rank falls back alike).

**Fallback.** A padding violation refuses that step's statistics of the layer (its factors
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


class _Run:
    """What one layer accumulated on a checked step."""

    __slots__ = ("e", "s", "n", "pad", "masked", "ratio", "fired", "committed", "low")

    def __init__(self):
        self.e = self.s = None
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

    def __init__(self, layers, every):
        if every is not None and (isinstance(every, bool) or not isinstance(every, int)
                                  or every < 1):
            raise ValueError(f"self_check must be None or an int >= 1, got {every!r}")
        self.layers = list(layers)
        self.every = every
        self._by_name = {l.name: l for l in self.layers}
        self.checking = False
        self.captures = 0
        self.checks_run = 0
        self.all_rows, self.released, self.verdicts = {}, {}, {}
        self._probes = {}
        self._runs = {}
        self.no_layout = set()  # layers whose LayerType has no as_matrix

    # -- schedule ----------------------------------------------------------------------
    def refresh(self, capturing):
        self.checking = bool(capturing and self.every and self.captures % self.every == 0)

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
        """(a_i^T v, |a_i|^T |v|, rows' dtype) of one call's input rows; rows of a stack of
        experts (``experts``: each row's expert) are weighted by their expert's c_e."""
        dtype = self._dtype(layer)
        _, v, c = self._probe(layer, rows.device, dtype)
        r = rows.detach().to(dtype)
        pa, sa = r @ v, r.abs() @ v.abs()
        if experts is not None:
            pa, sa = pa * c[experts], sa * c.abs()[experts]
        return pa, sa, rows.dtype

    def _run(self, name):
        run = self._runs.get(name)
        if run is None:
            run = self._runs[name] = _Run()
        return run

    def commit(self, layer, sketch, mask, g):
        """One call's gradient rows: the padding check and the projected sum."""
        pa, sa, rows_dtype = sketch
        dtype = self._dtype(layer)
        u = self._probe(layer, g.device, dtype)[0]
        gg = g.to(dtype)
        product = (gg @ u) * pa
        run = self._run(layer.name)
        kept = product if mask is None else torch.where(mask, product, 0)
        run.e = kept.sum() if run.e is None else run.e + kept.sum()
        s = ((gg.abs() @ u.abs()) * sa).sum()
        run.s = s if run.s is None else run.s + s
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
        (layers refused for padding, layers released)."""
        if not self.checking:
            self.captures += 1
            return [], []
        self.captures += 1
        self.checks_run += 1
        device = self.layers[0].module.weight.device if self.layers else torch.device("cpu")
        values = []
        for layer in self.layers:
            run = self._runs.get(layer.name)
            pad = run.pad if run is not None and run.masked else None
            ratio = run.ratio if run is not None and run.fired else None
            values.append(torch.as_tensor(-1.0 if pad is None else pad, dtype=torch.float64,
                                          device=device).reshape(()).to(torch.float64))
            values.append(torch.as_tensor(-1.0 if ratio is None else ratio,
                                          dtype=torch.float64,
                                          device=device).reshape(()).to(torch.float64))
        if not values:
            return [], []
        packed = torch.stack(values)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(
                process_group) > 1:
            dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=process_group)
        flat = packed.tolist()  # the check step's one host synchronisation
        self._runs = {}
        flagged, released = [], []
        for i, layer in enumerate(self.layers):
            pad, ratio = flat[2 * i], flat[2 * i + 1]
            name = layer.name
            if pad < 0 and ratio < 0:
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
            if name in self.no_layout:
                verdict["weight"] = "not run: its LayerType has no as_matrix"
            if verdict.get("padding") == "fail" and ratio > 1:
                # the mask explains the mismatch: all rows from now on, not a release
                verdict["weight"] = "not judged: the padding check failed"
            elif ratio >= 0 and not math.isnan(ratio):
                verdict["weight"] = "pass" if ratio <= 1 else "fail"
                verdict["ratio"] = ratio
                if ratio > 1 and name not in self.released:
                    why = ("a backward reached the weight through a use no hook captured"
                           if math.isinf(ratio) else
                           f"its gradient differs from the sum of g a^T over its captured "
                           f"rows by {ratio:.3g} times the rounding bound")
                    self.released[name] = (
                        f"self-check: {why} (a tied or functional second use of the weight, "
                        "a call the hooks missed, or a wrong row set): not preconditioned "
                        "from this step on; its gradient goes to the backbone unchanged")
                    released.append(name)
        return flagged, released
