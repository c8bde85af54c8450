r"""K-FAC baseline (KAISA form; spec MKOR.md K19) with MKOR's interface.

Per layer, with rows a_i (inputs, [a_i | 1] with a bias) and per-sample output
gradients N g_i of a mean-reduced loss:

.. math::
    A \leftarrow \beta A + (1-\beta) \tfrac1N \textstyle\sum_i a_i a_i^T, \qquad
    G \leftarrow \beta G + (1-\beta) \tfrac1N \textstyle\sum_i (N g_i)(N g_i)^T

every ``factor_freq`` steps (the first update takes the batch factor as is), then every
``inv_freq`` steps an O(d^3) decomposition, and every step

.. math::
    V = Q_G\big[(Q_G^T \hat G Q_A) \oslash (\lambda_G \lambda_A^T + \delta)\big] Q_A^T
      = (G \otimes A + \delta I)^{-1} \hat G \quad (\text{"eigen"}), \qquad
    V = (G + \delta I)^{-1} \hat G (A + \delta I)^{-1} \quad (\text{"inverse"}),

scaled by the KL-clip \nu = \min(1, \sqrt{\kappa / |\sum_m \eta^2 \langle V_m, \hat G_m\rangle|}).
Conv2d rows are the unfolded patches (B L rows) with N = B samples, so
G = (1/B) \sum_{b,l} (B g_{b,l})(B g_{b,l})^T (the KFC approximation).
This is the method MKOR replaces: it *does* call ``eigh`` / ``inv``.

With gradient accumulation the rows of every micro-batch add up: A is the mean of
a_i a_i^T over all rows and G = N \sum_i g_i g_i^T with N the samples of *all*
micro-batches, so k micro-batches of a loss divided by k give the full batch's factors.
A token mask keeps padded rows out of both (N counts real tokens). Under a loss scale s
(``GradScaler``), G is divided by s^2.

Robustness: a factor update with a non-finite statistic is refused and counted
(``skipped_updates``), so one overflowing batch never poisons the factors; a failed
decomposition is retried in float64, then with 10x, 100x, 1000x the damping added to the
factor, and if all fail the previous decomposition is kept (``decomposition_failures``);
statistics are float32 under autocast.

Distributed (the baseline MKOR's O(d) claim is measured against): on a factor-update step
every rank all-reduces the *sums* behind the batch factors of every layer, sum_i a_i a_i^T
and sum_i g_i g_i^T, with its row count (and, for a Conv2d, its sample count) in one flat
buffer (:class:`~torch_impl.kronecker.exchange.Packet`), and every rank then forms one process's factors
on the union of the batches, A = sum_r sum_i a a^T / sum_r n_r and
G = (sum_r N_r) sum_r sum_i g g^T / P^2 (each rank's g_i is the gradient of its own mean
loss, and DDP averages over the P ranks), before the same EMA and decomposition. A layer
with no rows on some rank (an MoE expert routed no tokens there) adds zeros, never 0/0.
:attr:`KFAC.payload_bytes` = (sum_m (d_in'^2 + d_out^2) + #bias-free layers + #Conv2d
layers) x itemsize: O(d^2) per layer. (KAISA can also send inverses or shard the work;
by default this baseline replicates everything, like MKOR.)

Under FSDP2 (:mod:`~torch_impl.kronecker.placement`) the sharded gradient is gathered whole and
preconditioned, as for MKOR. ``factor_placement="replicated"``: every rank holds every
layer's A, G and their decompositions (the all-reduce above). ``"owner"``: each sharded
layer's factors live on one rank (:func:`~torch_impl.kronecker.placement.assign_owners`, balanced on
d_out^2 + d_in'^2); its sums are *reduced* to that rank alone (one ``reduce`` per owning
rank, of the packet of the layers it owns: the same bytes leave every rank, but only the
owner receives the O(d^2) result, where an all-reduce also sends it back to everyone),
the owner alone forms the EMAs and decomposes them (factor memory and the O(d^3) work
divided among the ranks), gathers the gradient, computes V, and scatters every rank its
rows. The KL-clip sum over layers becomes one scalar all-reduce of the owners' partial
sums, so nu is the same on every rank.

Fused mixture-of-experts projections (transformers 5's 3-D ``gate_up_proj`` / ``down_proj``,
``layer.experts = E``) are E layers each: expert e has its own A_e, G_e from the rows of the
pairs routed to it (N_e = its rows: G_e = N_e sum g g^T, exactly an ``nn.Linear`` expert fed
them), its own EMA and counters ((E,) tensors: an expert routed no rows sits the update out
with ``no_rows`` and keeps its factors), its own eigendecomposition (one batched ``eigh`` of
the (E, d, d) stack; a failing matrix retries alone) and V_e, and its term in the KL clip's
sum. The statistics are one batched product per shape (:mod:`.kfac_equations`), the sums
travel with an (E,) tensor of per-expert counts, and under FSDP2 a stack goes whole to one
owner.

Flavours (issue 46, :mod:`.kfac_flavours`, KC2-KC5): ``fisher_type`` picks G's columns,
"empirical" (default: the training backward's rows, all of the above), "mc" or "type-2"
(:meth:`KFAC.curvature_backward` after the forward, before ``loss.backward()``;
:mod:`.kfac_curvature`); ``kfac_approx="reduce"``: both factors from per-sample means of a
and sums of g (a layer input's first leading dimension indexes the samples; a Conv2d's L
patches are one sample's), not every row ("expand"). The defaults run the code above.
"""
import warnings

import torch
import torch.distributed as dist

from ..common.validation import check_choice, check_int, check_number
from ..kronecker.capture import Capture, weak_schedule
from ..kronecker.discovery import (discover, unwrap_model, warn_identity_sides,
                                   warn_nothing_preconditioned)
from ..kronecker.exchange import LOCAL, Packet, world_size
from ..kronecker.optimizer import PreconditionedOptimizer
from ..kronecker.placement import (gradients_of, check_supported_sharding,
                                   owner_map, owns)
from .kfac_curvature import (ColumnSums, check_flavour_options, column_sums,
                             curvature_backward)
from .kfac_equations import (decompose, decompose_stack, grad_stat, input_stat, per_sample,
                             preconditioned_gradient)
from .kfac_flavours import reduce_grad_stat, reduce_input_stat
from .kfac_state import factor_storage_dtype, load_layer_states, preconditioner_state

__all__ = ["KFAC"]


def _stack(layer):
    """() for one layer, (E,) for a stack of E experts (``layer.experts``)."""
    E = getattr(layer, "experts", None)
    return () if E is None else (E,)


def _kept(layer):
    """() for one layer, (E,) for the experts of a stack whose factors this rank keeps (under
    expert parallelism its held ones, ``layer.kept``)."""
    return () if getattr(layer, "experts", None) is None else (layer.kept,)


def _per_matrix(x):
    """A per-expert number ((E,)) against the stack's (E, d, d) factors; 0-d as it is."""
    return x[..., None, None] if isinstance(x, torch.Tensor) and x.dim() else x


def _all_finite(F, layer):
    """Whether F is finite: one flag, or one per expert of a stack."""
    if getattr(layer, "experts", None) is None or F.dim() < 3:
        return torch.isfinite(F).all()
    return torch.isfinite(F).flatten(-2).all(dim=-1)


class KFAC(PreconditionedOptimizer):
    """K-FAC as a ``torch.optim.Optimizer`` preconditioning a backbone (same API as MKOR).

    Args:
        model, optimizer: as :class:`~torch_impl.mkor.MKOR`.
        inv_freq: decomposition period (KAISA's inv_update_steps).
        factor_freq: factor EMA period (factor_update_steps).
        damping: delta (> 0). factor_decay: beta in [0, 1) (the weight of the old factor;
            1 is allowed with ``factor_init="identity"``: the factors then stay at the start).
        kl_clip: kappa > 0, or None to disable; the clip uses the learning rate of the
            optimizer's first param group, read at every step.
        method: "eigen" (default) or "inverse".
        skip_modules: glob patterns of module names to leave to the backbone.
        grad_hook: "module" | "tensor", as for MKOR.
        max_factor_dim, token_mask, grad_scaler, grad_scale: as for MKOR (a factor side
            at the identity is the factor I: eigenvalues 1, or inverse I / (1 + delta)).
        process_group: process group for averaging the factors (default: the world).
        factor_init: where the factor EMAs start. "batch" (default): the first accepted
            update takes the batch factor as is. "identity": A starts at s_A I and G at
            s_G I and every update blends, the first included (kfac-pytorch's convention;
            :func:`~.kfac_conventions.from_kfac_pytorch` sets this and the scales).
        factor_init_scale: (s_A, s_G), each > 0, for ``factor_init="identity"`` (default
            (1.0, 1.0); must stay so with "batch").
        factor_placement: under FSDP2, where a sharded layer's factors live: "replicated"
            (default; on every rank) or "owner" (on one rank per layer: module docstring).
        self_check: as for MKOR (default True: every capture; None or False: never). As
            there, a layer whose factors have taken no statistic yet is not preconditioned
            (its gradient goes to the backbone unchanged, and it takes no part in the KL
            clip).
        fisher_type: "empirical" (default; G from the training backward's rows), "mc" or
            "type-2" (from the columns :meth:`curvature_backward` back-propagates, called on
            every factor-update step). kfac_approx: "expand" (default) or "reduce" (not for
            expert stacks, MHA out-projections, or a model with a batch_first=False module).
        mc_samples: M for "mc" (default 1). generator: a ``torch.Generator`` for "mc"'s
            draws (default: torch's global one; its state is the caller's to save).
        factor_dtype: the dtype A and G are kept in between steps (default None: the compute
            dtype, the weights' promoted with float32); ``torch.bfloat16`` halves their
            memory, each EMA write rounded to nearest, the decompositions still computed in
            the compute dtype (:mod:`.kfac_state`; LP5).
    """

    _state_key = "kfac"

    def __init__(self, model, optimizer, *, inv_freq=10, factor_freq=1, damping=1e-3,
                 factor_decay=0.95, kl_clip=1e-3, method="eigen", skip_modules=(),
                 grad_hook="tensor", max_factor_dim=8192, token_mask="attention_mask",
                 grad_scaler=None, grad_scale=1.0, process_group=None, factor_init="batch",
                 factor_init_scale=(1.0, 1.0), factor_placement="replicated", self_check=True,
                 fisher_type="empirical", kfac_approx="expand", mc_samples=1, generator=None,
                 factor_dtype=None):
        self._bind(model, optimizer, grad_scaler)
        check_int("inv_freq", inv_freq, low=1)
        check_int("factor_freq", factor_freq, low=1)
        check_number("damping", damping, 0.0, low_open=True, finite=True)
        check_choice("factor_init", factor_init, ("batch", "identity"))
        scales = tuple(factor_init_scale) if isinstance(factor_init_scale, (tuple, list)) else ()
        if len(scales) != 2:
            raise ValueError("factor_init_scale: expected a pair (s_A, s_G) of finite numbers "
                             f"> 0, got {factor_init_scale!r}")
        for i, s in enumerate(scales):
            check_number(f"factor_init_scale[{i}]", s, 0.0, low_open=True, finite=True)
        if factor_init == "batch" and scales != (1.0, 1.0):
            raise ValueError("factor_init_scale: only applies to factor_init='identity', got "
                             f"{factor_init_scale!r} with factor_init='batch'")
        # 1 (no new statistics at all) only makes sense from a factor that is not a batch's
        check_number("factor_decay", factor_decay, 0.0, 1.0,
                     high_open=factor_init != "identity")
        if kl_clip is not None:
            check_number("kl_clip", kl_clip, 0.0, low_open=True)
        check_choice("method", method, ("eigen", "inverse"))
        check_choice("factor_placement", factor_placement, ("replicated", "owner"))
        if max_factor_dim is not None:
            check_int("max_factor_dim", max_factor_dim, low=1)
        if not isinstance(grad_scale, torch.Tensor):
            check_number("grad_scale", grad_scale, 0.0, low_open=True, finite=True)
        self.process_group = process_group
        self.inv_freq, self.factor_freq = inv_freq, factor_freq
        self.damping, self.factor_decay, self.kl_clip, self.method = (
            damping, factor_decay, kl_clip, method)
        self._grad_scale = grad_scale
        self.factor_init, self.factor_init_scale = factor_init, tuple(float(v) for v in scales)
        found = discover(unwrap_model(model), skip_modules, optimizer, max_factor_dim)
        self._layers, self._skipped, self._frozen = found.layers, found.skipped, found.frozen
        check_supported_sharding(unwrap_model(model), self._layers, "KFAC")
        self.factor_placement = factor_placement
        self._owners = owner_map(self._layers, factor_placement, "KFAC")
        # Factors are kept in the statistics' dtype: the weights' promoted with float32.
        self._dtype = (torch.promote_types(self._layers[0].module.weight.dtype, torch.float32)
                       if self._layers else torch.float32)
        self._factor_dtype = factor_storage_dtype(factor_dtype, self._dtype)
        warn_identity_sides("KFAC", self._layers, 2 * self._dtype.itemsize)
        if not self._layers:
            warn_nothing_preconditioned("KFAC", self._skipped)
        self._steps = 0
        self._state = {layer.name: self._initial_state(layer) for layer in self._layers}
        self.decomposition_failures = 0  # decompositions that kept the previous result
        self.decomposition_retries = 0   # failed attempts (float64 retries, extra damping)
        check_flavour_options(unwrap_model(model), self._layers, fisher_type, kfac_approx,
                              mc_samples, generator, grad_hook)
        self.fisher_type, self.kfac_approx = fisher_type, kfac_approx
        self.mc_samples, self.generator = mc_samples, generator
        reduce = kfac_approx == "reduce"
        self._capture = Capture(self._layers, weak_schedule(self.factor_update_due),
                                reduce_input_stat if reduce else input_stat,
                                reduce_grad_stat if reduce else grad_stat, grad_hook=grad_hook,
                                model=unwrap_model(model), mask_kwarg=token_mask,
                                self_check=self_check)
        self._columns = None if fisher_type == "empirical" else ColumnSums()
        self._capture.columns = self._columns
        self._capture.register()
        self._routes = self._plan_routes()
        self.communicated_bytes = 0  # running total all-reduced by this rank (an int)
        self._attach([unwrap_model(model)] + [l.module for l in self._layers])

    def _plan_routes(self):
        """[(destination, layers, packet)]: the replicated layers' sums all-reduced
        (destination None), then each owning rank's layers' sums reduced to it (its global
        rank). Sums travel: A's [-1, -1] entry (the bias column's 1 * 1 summed) is the row
        count; a layer with several rows per sample (Conv2d) also sends its samples."""
        ep = [l for l in self._layers if l.expert_shard is not None]
        groups = {None: [l for l in self._layers if l.name not in self._owners
                         and l.expert_shard is None]}
        for layer in self._layers:
            if layer.name in self._owners:
                rank, group = self._owners[layer.name]
                groups.setdefault(dist.get_global_rank(group, rank), []).append(layer)
        routes = []
        # expert parallelism: a stack's sums travel over its row group alone (no collective
        # where that is this rank), each rank then keeping its held experts' (experts/parallel.py)
        by_rows = {}
        for layer in ep:
            by_rows.setdefault(id(layer.expert_shard.row_group), []).append(layer)
        plan = [(dst, groups[dst], self.process_group) for dst in
                [None] + sorted(d for d in groups if d is not None)]
        plan += [(None, layers, layers[0].expert_shard.row_group) for layers in by_rows.values()]
        for dst, layers, group in plan:
            if not layers:
                continue
            # a stack of experts sends its (E,) row counts as one more tensor
            packet = Packet(
                [[self._a_shape(l), self._g_shape(l)] + ([(1,)] if per_sample(l) else []) +
                 ([(1,)] if self._columns is not None else []) +  # the columns' D
                 ([(l.experts,)] if l.experts is not None else []) for l in layers],
                [l.has_bias and not l.identity_R and l.experts is None for l in layers],
                self._dtype, sums=True)
            routes.append((dst, layers, packet, group))
        return routes

    @staticmethod
    def _a_shape(layer):
        return (0,) if layer.identity_R else (*_stack(layer), layer.d_in, layer.d_in)

    @staticmethod
    def _g_shape(layer):
        return (0,) if layer.identity_L else (*_stack(layer), layer.d_out, layer.d_out)

    def _initial_state(self, layer):
        if not owns(self._owners, layer.name):  # another rank keeps it (DCP: one copy)
            return {}
        dev = layer.module.weight.device
        stack = _kept(layer)  # a stack of experts: one counter and factor per (held) expert
        state = {k: torch.zeros(stack, dtype=torch.int64, device=dev)
                 for k in ("updates", "non_finite", "overflow", "no_rows")}
        s_A, s_G = self.factor_init_scale
        for key, side, d, scale in (("A", layer.identity_R, layer.d_in, s_A),
                                    ("G", layer.identity_L, layer.d_out, s_G)):
            if not side:  # "batch": I until the first accepted update replaces it
                eye = (scale * torch.eye(d, dtype=self._dtype, device=dev)).to(self._factor_dtype)
                state[key] = eye if not stack else eye.expand(*stack, d, d).clone()
        return state

    @property
    def payload_bytes(self):
        """Bytes each rank sends per factor update (all-reduced, or reduced to the owners):
        (sum_m (d_in'^2 + d_out^2) + #bias-free layers + #Conv2d layers) x itemsize, a stack
        of E experts counting as E layers whose E row counts travel (E (d_in'^2 + d_out^2 + 1)
        + 1 entries: its unused per-layer count slot included)."""
        return sum(packet.nbytes for _, _, packet, group in self._routes
                   if group is not LOCAL)

    @property
    def skipped_updates(self):
        """Factor updates refused for non-finite statistics or an overflowing EMA (a
        tensor); layers without rows are counted apart, in ``counters()``."""
        counts = [(s["non_finite"] + s["overflow"]).sum() for s in self._state.values() if s]
        return (torch.stack(counts).sum() if counts else torch.zeros((), dtype=torch.int64))

    def counters(self):
        """{name: {...}} of 0-d tensors ((E,) for a stack of E experts: each expert's own):
        accepted ``updates``, updates refused for ``non_finite`` statistics or an
        ``overflow`` of the EMA, and updates sat out with ``no_rows`` (no rows reached the
        layer -- the expert --, on any rank); for the layers whose state this rank keeps
        (all but those another rank owns)."""
        keys = ("updates", "non_finite", "overflow", "no_rows")
        return {name: {k: s[k] for k in keys} for name, s in self._state.items() if s}

    def factor_update_due(self):
        return not self._detached and self._steps % self.factor_freq == 0

    def _layers_with_statistics(self):
        return [name for name, s in self._state.items()
                if not s or bool((s["updates"] > 0).any())]

    def factors(self):
        """{name: (A, G)} of the current factor EMAs (None for an identity side), for the
        layers that have had an update and whose factors this rank keeps."""
        return {n: (s.get("A"), s.get("G")) for n, s in self._state.items()
                if s and ("decomposed" in s or bool((s["updates"] > 0).any()))}

    def _drop_statistics(self, completed_only=False):
        if completed_only:
            self._capture.drop_committed()
        else:
            self._capture.reset()

    def _preconditioner_state(self, clone):
        """K-FAC's own state (:func:`~.kfac_state.preconditioner_state`)."""
        return preconditioner_state(self._steps, self._state, clone)

    def load_preconditioner_state_dict(self, state):
        self._state = load_layer_states(state["layers"], self._state, self._dtype,
                                        self._factor_dtype)
        self._steps = state["steps"]

    # -- the step -----------------------------------------------------------------------
    def _batch_factors(self):
        """[(layer, A_new, G_new, present)] of this step for the layers whose factors this
        rank keeps: one process's factors on the union of the ranks' rows (module
        docstring). ``present``: None (the layer has rows), False (it has none, on one
        process), or a 0-d bool tensor (no host sync)."""
        scale = self._step_scale if self._step_scale is not None else self._configured_scale()
        scale = scale if self._columns is None else 1.0  # the columns: the unscaled output's
        mine = {l.name: self._capture.stats(l.name) for l in self._layers}
        mine = {name: stats for name, stats in mine.items() if stats is not None}
        self._check_captured(self._layers, bool(mine))
        world = world_size(self.process_group)
        if world == 1 or not self._layers:
            out = []
            for layer in self._layers:
                if layer.name not in mine:  # not called since the last factor update
                    out.append((layer, None, None, False))
                    continue
                a_sum, rows, s_sum, samples = mine[layer.name]
                if not isinstance(rows, torch.Tensor) and rows == 0:
                    out.append((layer, None, None, False))  # only calls with 0 rows
                    continue
                columns = self._column_sums(layer)  # (sum, D): mc / type-2's G
                present = rows > 0 if isinstance(rows, torch.Tensor) else None
                rows = rows.clamp(min=1) if isinstance(rows, torch.Tensor) else rows
                if layer.experts is not None:  # per expert: (E,) counts against (E, d, d)
                    rows, samples = _per_matrix(rows), _per_matrix(samples)
                # s_sum first: GradScaler's scale is a float32 0-d tensor, and a Python
                # number divided by it would round the factor N / s^2 to float32
                if columns is not None:  # mc / type-2: G = the columns' sum / D
                    s_sum, samples = columns[0], 1.0 / columns[1]
                out.append((layer, a_sum / rows, s_sum * samples / scale / scale, present))
            return out
        out = []
        for dst, layers, packet, group in self._routes:
            items, counts = [], []
            for layer in layers:
                if layer.name not in mine:
                    items.append(None)
                    counts.append(0)
                    continue
                a_sum, rows, s_sum, samples = mine[layer.name]
                extra = [torch.as_tensor(samples, dtype=self._dtype).reshape(1)] if per_sample(
                    layer) else []
                if self._columns is not None:  # G's sums are the columns', with their D
                    s_sum, den = self._column_sums(layer)
                    extra.append(torch.as_tensor(den, dtype=self._dtype).reshape(1))
                if layer.experts is not None:
                    extra.append(rows)  # the (E,) counts: each expert's own
                    rows = 0
                items.append([a_sum, s_sum] + extra)
                counts.append(rows)
            device = self._layers[0].module.weight.device
            reduction = (packet.all_reduce(items, device, group, counts=counts)
                         if dst is None else
                         packet.reduce(items, device, dst, group, counts=counts))
            if world_size(group) > 1:
                self.communicated_bytes += packet.nbytes
            if dst is not None and dist.get_rank() != dst:
                continue  # the owner alone holds these sums, and these factors
            for layer, (sums, rows) in zip(layers, reduction.wait(packet.dtype)):
                A_sum, S_sum = sums[0], sums[1]
                if layer.experts is not None:
                    rows = sums[-1]
                samples = sums[2][0] if per_sample(layer) else rows
                dev = layer.module.weight.device
                A = A_sum / _per_matrix(rows.clamp(min=1))
                # the union's G: N_union * sum over the union's rows of (g_i / P)(g_i / P)^T,
                # each rank's g_i being its mean loss's gradient and DDP averaging over P ranks
                G = S_sum * _per_matrix(samples) / world / world / scale / scale
                if self._columns is not None:  # the columns: sum over the union / its D
                    G = S_sum / sums[2 + per_sample(layer)][0]
                present = rows > 0
                if layer.expert_shard is not None:  # the held experts' factors stay here
                    A, G, present = (layer.expert_shard.kept(x) for x in (A, G, present))
                out.append((layer, A.to(dev), G.to(dev), present.to(dev)))
        return out

    def _column_sums(self, layer):
        """(Σ g gᵀ, D) of ``layer``'s curvature columns; None for "empirical"."""
        return None if self._columns is None else column_sums(self, layer)

    def curvature_backward(self, output, targets, loss_func):
        """Back-propagate the "mc" / "type-2" columns of ``loss_func(output, targets)``
        (:mod:`.kfac_curvature`): after the forward, before ``loss.backward()``; does nothing
        with "empirical" or on a step without a factor update. Returns the columns run."""
        return curvature_backward(self, output, targets, loss_func)

    def _update_factors(self):
        beta = self.factor_decay
        for layer, A_new, G_new, present in self._batch_factors():
            s = self._state[layer.name]
            if present is False:
                s["no_rows"] = s["no_rows"] + 1
                continue
            finite = _all_finite(A_new, layer) & _all_finite(G_new, layer)
            ok = finite
            first = s["updates"] == 0
            blends = {}
            for key, new in (("A", A_new), ("G", G_new)):
                if key in s:  # "batch": the first accepted update takes the batch factor
                    blends[key] = torch.where(_per_matrix(first & (self.factor_init == "batch")),
                                              new, beta * s[key].to(new.dtype) + (1 - beta) * new
                                              ).to(s[key].dtype)  # kept in factor_dtype
                    ok = ok & _all_finite(blends[key], layer)
            overflow = finite & ~ok  # finite statistics, non-finite EMA
            if present is not None:  # a 0-d bool: whether any rank had rows
                s["no_rows"] = s["no_rows"] + (~present).long()
                finite, overflow, ok = finite | ~present, overflow & present, ok & present
            for key, blended in blends.items():
                s[key] = torch.where(_per_matrix(ok), blended, s[key])
            s["updates"] = s["updates"] + ok.long()
            s["non_finite"] = s["non_finite"] + (~finite).long()
            s["overflow"] = s["overflow"] + overflow.long()

    def init_state(self):
        """The backbone's state as its first step would create it (the base class's), and
        each kept layer's decomposition of its current factors: those keys otherwise appear at
        the first step, and a checkpoint template (DCP's, torchtitan's flat layout) made
        before it would not ask for them. Step 0 decomposes again before it preconditions,
        so the run is unchanged; layers already decomposed are left as they are."""
        super().init_state()
        self._decompose_all(missing_only=True)

    def _decompose_all(self, missing_only=False):
        for name, s in self._state.items():
            if not s or (missing_only and "decomposed" in s):  # another rank owns the layer
                continue
            for key in ("A", "G"):
                if key not in s:
                    continue
                if s[key].dim() == 3:  # a stack of experts: every matrix its own
                    self._decompose_stack(name, s, key)
                    continue
                result, attempts = decompose(s[key], self.damping, self.method)
                self.decomposition_retries += attempts
                if result is None:
                    self.decomposition_failures += 1
                    warnings.warn(f"KFAC: decomposing {name}.{key} failed in float32, float64 "
                                  "and with extra damping; keeping its previous "
                                  "decomposition", RuntimeWarning)
                    continue
                s[("eig_" if self.method == "eigen" else "inv_") + key] = result
            s["decomposed"] = True

    def _decompose_stack(self, name, s, key):
        """A stack's factors (E, d, d) decomposed batched; an expert whose every attempt
        fails keeps its previous decomposition (the identity's if none), as a layer of its
        own would (:func:`~.kfac_equations.decompose_stack`): failures and retries count
        per expert."""
        entry = ("eig_" if self.method == "eigen" else "inv_") + key
        result, attempts, failed = decompose_stack(s[key], self.damping, self.method,
                                                   s.get(entry))
        self.decomposition_retries += attempts
        if failed:
            self.decomposition_failures += len(failed)
            warnings.warn(f"KFAC: decomposing {name}.{key} of the experts {failed} failed in "
                          "float32, float64 and with extra damping; keeping their previous "
                          "decomposition", RuntimeWarning)
        s[entry] = result

    def _gradient_matrix(self, layer, grads):
        """G_hat = [grad W | grad b] in the factor dtype (a bias without a gradient: 0)."""
        G_hat = grads.matrix(layer).to(self._dtype)
        if layer.has_bias:
            gb = (grads.bias if grads.bias is not None
                  else G_hat.new_zeros(*_kept(layer), layer.d_out))
            G_hat = torch.cat([G_hat, gb.unsqueeze(-1).to(self._dtype)], dim=-1)
        return G_hat

    def _kl_clip_factor(self, work):
        """nu = min(1, sqrt(kappa / |lr^2 sum_m <V_m, G_m>|)) as a 0-d tensor (no host
        sync); owner-placed layers' terms are summed on their owners, and the terms of a
        stack whose experts are spread over the ranks (expert parallelism, per-expert owners:
        each expert held by one rank) on the ranks holding them, then all-reduced."""
        dev = self._layers[0].module.weight.device
        vg = torch.zeros((), dtype=self._dtype, device=dev)
        owned = torch.zeros((), dtype=self._dtype, device=dev)
        spread = any(layer.expert_shard is not None for layer in self._layers)
        for layer, _, G_hat, V, owner_placed, seen in work:
            if V is None:
                continue
            term = torch.where(seen, V * G_hat, 0).sum().to(dev)  # the preconditioned only
            if owner_placed or getattr(layer, "expert_shard", None) is not None:
                owned = owned + term
            else:
                vg = vg + term
        if spread or any(owner_placed for *_, owner_placed, _ in work):
            group = (next(iter(self._owners.values()))[1] if self._owners
                     else self.process_group)
            dist.all_reduce(owned, group=group)
            vg = vg + owned
        lr = self.optimizer.param_groups[0]["lr"]
        vg = (vg * lr ** 2).abs()
        # nu = 1 when the sum is 0 (nothing to clip); torch.where keeps it sync-free.
        nu = torch.where(vg > 0, (self.kl_clip / torch.where(vg > 0, vg, 1.0)).sqrt(), 1.0)
        return nu.clamp(max=1.0)

    @staticmethod
    def _write(layer, grads, V):
        """The layer's gradients <- V (weight columns, then the bias column)."""
        d = layer.d_in - layer.has_bias
        matrix = grads.matrix(layer)
        if grads.sharded:
            matrix.copy_(V[..., :d])
        else:
            layer.type.set_grad_matrix(layer.module, V[..., :d].to(matrix.dtype))
        if layer.has_bias and grads.bias is not None:
            grads.bias.copy_(V[..., -1])

    @torch.no_grad()
    def precondition(self):
        """Factor / decomposition updates when due, then ``.grad`` <- nu * V."""
        if self._detached:
            return
        if self._binding.moved():  # parameters replaced since construction (placement)
            self._owners = self._binding.follow(self, self.factor_placement, "KFAC")
            self._routes = self._plan_routes()
        if self.factor_update_due():
            self._finish_capture()
            self._update_factors()
        if self._steps % self.inv_freq == 0:
            self._decompose_all()
        self._capture.reset()
        work = []  # (layer, gradients, G_hat, V: None where not computed here, owner-placed)
        for layer in self._layers:
            s, w = self._state[layer.name], layer.module.weight
            owner = self._owners.get(layer.name)
            if w.grad is None or (owner is None and "decomposed" not in s) or \
                    layer.name in self._capture.check.released:
                continue
            # FSDP2: the whole gradients, on every rank or on the owner (kronecker.placement)
            grads = gradients_of(layer, owner)
            G_hat = V = seen = None
            if grads.weight is not None and "decomposed" in s:
                G_hat = self._gradient_matrix(layer, grads)
                # factors that never took a statistic transform nothing (no sync: a where)
                seen = _per_matrix(s["updates"] > 0)
                V = torch.where(seen, preconditioned_gradient(s, G_hat, self.damping,
                                                              self.method), G_hat)
            work.append((layer, grads, G_hat, V, owner is not None, seen))
        nu = self._kl_clip_factor(work) if self.kl_clip is not None and work else None
        for layer, grads, _, V, _, seen in work:
            if V is not None:
                scale = None if nu is None else torch.where(seen, nu.to(V.device), 1.0)
                self._write(layer, grads, V if scale is None else V * scale)
            grads.write_back()
        self._steps += 1
        self._step_scale = None
        self._capture.refresh()  # the hooks' gate for the next step
