r"""MKOR: a Kronecker-factored preconditioner with rank-1 inverse updates.

Mozaffari, Li, Zhang, Mehri Dehnavi, "MKOR: Momentum-Enabled Kronecker-Factor-Based
Optimizer Using Rank-1 Updates", NeurIPS 2023 (spec MKOR.md). MKOR hooks the model,
rewrites ``.grad`` in place, then steps the user's ``torch.optim`` optimizer; it is
itself a ``torch.optim.Optimizer`` over the backbone's param groups
(:mod:`torch_impl.kronecker.optimizer`), so schedulers, ``GradScaler`` and ``transformers.Trainer`` take it.

Per preconditioned layer (W in R^{d_out x d_in}, bias b) it stores J_L = L^{-1} and
J_R = R^{-1}, both starting at I. Each step t:

.. math::
    &\text{if } t \bmod f = 0 \text{ or } t < t_w:\quad
        J_R \leftarrow U(J_R, \bar a),\ \ J_L \leftarrow U(J_L, \bar g)
        \quad\text{(K2, K8/K10 with K11/K12)}\\
    &\Delta = J_L\,[\nabla W \,|\, \nabla b]\,J_R \quad\text{(K13)},\qquad
     \nabla \leftarrow s\,\Delta,\ \ s = \|\hat G\| / \|\Delta\| \quad\text{(K14)}\\
    &\text{backbone.step()} \quad\text{(K15)}

with U the variant's O(d^2) Sherman-Morrison update (:mod:`.factors`), \bar a, \bar g
the rank-1 vectors of :mod:`.vectors`, f = ``inv_freq``, t_w = ``warmup_steps``.
"""
import functools

import torch

from ..common.validation import check_bool
from ..kronecker.capture import Capture, weak_schedule
from ..kronecker.discovery import (discover, unwrap_model, warn_identity_sides,
                                   warn_nothing_preconditioned)
from ..kronecker.exchange import LOCAL, world_size
from ..kronecker.factor_storage import factor_seed, resolve_rounding_seed
from ..kronecker.optimizer import PreconditionedOptimizer
from ..kronecker.placement import check_supported_sharding, kept_here, owner_map, owns
from .config import MKOROptions
from .factors import RELEASED_THRESHOLD
from .hybrid import HybridSwitch
from .layer_state import Workspace, initial_layer_state, precondition_layer, update_layer_factors
from .rank_k import group_row_sums, group_vectors
from .vector_exchange import BackwardProgress, VectorExchange
from .vectors import grad_row_sum, input_row_sum

__all__ = ["MKOR"]


def _upgrade_counters(saved):
    """A layer state saved before the counters were split: ``skipped`` (refused
    non-finite updates) becomes ``non_finite``; ``overflow`` and ``no_rows`` start at 0."""
    if "skipped" not in saved:
        return saved
    saved = dict(saved)
    skipped = saved.pop("skipped")
    saved.setdefault("non_finite", skipped)
    saved.setdefault("overflow", torch.zeros_like(skipped))
    saved.setdefault("no_rows", torch.zeros_like(skipped))
    return saved


def _promote(rows):
    return rows.to(torch.promote_types(rows.dtype, torch.float32))


def _input_stat(layer, rows, mask, experts=None):
    return input_row_sum(_promote(rows), mask, layer.has_bias, experts, layer.experts)


def _grad_stat(layer, rows, mask, experts=None):
    return grad_row_sum(_promote(rows), mask, layer.type.rows_per_sample(rows.shape[:-1]),
                        experts, layer.experts)


def _group_input_stat(layer, rows, mask, experts=None, *, rank):
    """Rank k (KC7): each group's sum of [a_i | 1] over its real rows, with the group's row
    count as the last column whether or not the layer has a bias (with one, that column *is*
    the bias column), so the counts travel inside the statistic; the count returned is the
    rank-1 one (all real rows; per expert for a stack)."""
    sums, counts = group_row_sums(_promote(rows), rank, mask, experts, layer.experts)
    stat = torch.cat([sums, counts.unsqueeze(-1).to(sums.dtype)], dim=-1)
    if mask is None and experts is None:  # rank 1's plain count: an int, read without a sync
        return stat, rows[..., 0].numel()
    return stat, counts.sum(dim=-1)


def _group_grad_stat(layer, rows, mask, experts=None, *, rank):
    """Rank k (KC7): each group's sum of g_i over its real rows divided by the rows per sample
    (K4's units, as ``grad_row_sum``); the count is unused (the input statistic's is read)."""
    sums, counts = group_row_sums(_promote(rows), rank, mask, experts, layer.experts)
    per_sample = 1 if experts is not None else layer.type.rows_per_sample(rows.shape[:-1])
    return (sums if per_sample == 1 else sums / per_sample), counts.sum(dim=-1)


def _row_mean(a_sum, rows):
    """a_sum / rows over the rows that exist (a count of 0 gives 0, never 0/0); a stack of
    experts divides each expert's sum by its own count."""
    rows = rows.clamp(min=1)
    return a_sum / (rows.unsqueeze(-1) if rows.dim() else rows)


class MKOR(PreconditionedOptimizer):
    r"""MKOR / MKOR-H: a ``torch.optim.Optimizer`` preconditioning a backbone optimizer.

    Usage::

        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        mkor = MKOR(model, opt)
        loss_fn(model(x), y).backward(); mkor.step(); mkor.zero_grad()

    Args:
        model: any ``nn.Module`` (DDP wrappers allowed; names lose ``module.``). Every
            module of a registered layer type (``nn.Linear`` and subclasses, ``nn.Conv2d``
            with groups=1, transformers' ``Conv1D``; :func:`~.layers.register_layer_type`
            adds more) is preconditioned, except those :attr:`skip_reasons` lists; other
            parameters reach the optimizer untouched.
        optimizer: the backbone, any ``torch.optim.Optimizer`` holding the parameters.
        max_factor_dim: factor sides above this (default 8192) are preconditioned by the
            identity instead of being built (:mod:`.discovery`); None: no limit.
        token_mask: name of the forward parameter holding a (B, T) token mask (default
            ``"attention_mask"``, nonzero = real token), wherever it enters the model (any
            module whose forward takes it, bound to its signature: :mod:`.token_masks`):
            padded positions are kept out of the statistics. Which mask a layer's rows read,
            and in which layout, is followed from the model's operations
            (:mod:`.row_provenance`; for an encoder-decoder model the decoder reads
            ``decoder_attention_mask`` or ``labels != -100``), also in a checkpoint's
            recompute; a layer whose rows cannot be tied to a mask uses all of them and is
            listed in :attr:`unmasked_reasons`. None: off. :meth:`masked` sets a mask by
            hand.
        grad_scaler: the ``torch.amp.GradScaler`` of the loop, if it calls
            ``scaler.unscale_(mkor)`` before ``scaler.step(mkor)`` (its scale is then read
            from it, sync-free); ``scaler.step`` alone needs nothing (:mod:`.wrapper`).
        inv_freq: factor-update period f (K2). stat_decay: the decay of the "paper" factor
            EMA (K8; the spec's gamma).
        variant: "paper" (default) or "released"; picks the column of spec section 4
            for every option below left as None.
        zeta: weight on J in the stabiliser blend (K11). threshold: the stabiliser's
            max-entry threshold epsilon (K12; default the released code's 2).
        stabilizer_norm: only "max_entry" (O(d^2)). stabilizer_timing: "before_sm" |
            "deferred". stabilizer_reset: "blend" | "identity". stabilizer_coupling:
            "per_factor" | "coupled". first_update: "sm" | "identity". rescale: "joint" |
            "sum_of_norms".
        factor_dtype: storage dtype of the inverse factors: float32 (paper default),
            float64, or bfloat16 / float16 (released default float16). 16-bit factors
            are updated in float32 and rounded on store, so each stored entry carries
            a relative error of up to 2^-8 (bfloat16) or 2^-11 (float16) per update;
            when lambda_min(J) is below that times max|J_ij| the stored factor can lose
            definiteness. Use float32 unless memory forces otherwise.
        factor_rounding: how a 16-bit factor is written: "nearest" (default) or
            "stochastic" (LP1, unbiased, the upper triangle mirrored so the factor stays
            symmetric; needs factor_dtype bfloat16 or float16). The measured error of the
            kept inverse and its bound: ``paper_notes/low_precision_factors.md`` (LP5).
        rounding_seed: the stochastic writes' seed (LP2; an int in [0, 2**63), kept in
            ``state_dict``); None draws one from torch's default generator, rank 0's
            broadcast when distributed. Each write's stream is ``stream_seed(rounding_seed,
            layer index, name_word("L_inv" or "R_inv"), step)``
            (:mod:`torch_impl.kronecker.factor_storage`): no rank word, so replicated factors
            round identically on every rank. The seed in use: :attr:`rounding_seed` (None
            with "nearest").
        average: "once" | "double" (distributed vector averaging, spec 2.7).
        comm_dtype: dtype of the all-reduce buffer (default: the compute dtype); float16
            / bfloat16 halve the traffic at a stated error (:mod:`.distributed`).
        precondition_dtype: dtype of the two preconditioning GEMMs L^-1 G R^-1 (default: the
            compute dtype). ``torch.bfloat16`` rounds factors and gradient to 8 bits of
            mantissa (relative error ~2^-8 per entry of Delta before the norm-preserving
            rescale, which runs in the compute dtype) and makes the GEMMs several times faster
            where the hardware has bf16 matrix units (measured: ``figures/bench/README.md``).
        warmup_steps: update factors at every step while t < warmup_steps (K2).
        grad_accum_steps: None (default) sums statistics over every backward since the
            last step: a_bar is the mean over all captured rows and g_bar the sum of the
            per-backward vectors, which reproduces the full-batch vectors when each
            micro-batch loss is divided by the number of micro-batches. An int k instead
            divides g_bar by k (the released code's convention, for un-divided losses).
        grad_scale: loss scale of mixed-precision training; g_bar is divided by it
            (K5). Only for loops that scale the loss by hand: ``GradScaler.step`` hands
            its scale over itself. Update with :meth:`set_grad_scale` (a tensor avoids
            any sync).
        skip_modules: glob patterns of module names to leave to the backbone.
        grad_hook: "tensor" (default: a forward hook attaches a gradient hook to the
            output only on steps that capture statistics, so other steps run the plain
            autograd graph, and in-place successors such as ``ReLU(inplace=True)`` work)
            or "module" (``register_full_backward_hook``, the kfac-pytorch convention:
            the same vectors, but every forward goes through the hook machinery).
        hybrid_switch: None or "loss_rate" (MKOR-H, K18) with ``switch_window``,
            ``switch_check_every``, ``switch_threshold``, ``switch_patience``. The rule
            reads each step's loss from ``observe_loss(loss)``, a closure, or the model's output
            (``output.loss``, as transformers models return), and warns once if a step
            brings none; reading is batched (one sync per ``switch_check_every`` steps).
        switch_step: switch to the backbone for good at step k (MKOR-H).
        factor_placement: under FSDP2, where the factors of a sharded layer live:
            "replicated" (default: on every rank; each step gathers the layer's gradient
            whole on every rank) or "owner" (on one rank per layer, balanced by factor
            size: factor memory divided by the world size; the owner gathers the
            gradient, preconditions it and scatters the rows back). :mod:`.fsdp`.
        process_group: process group for averaging vectors (default: the world).
        self_check: True (default): check every capture whose statistics enter a factor
            (:mod:`torch_impl.kronecker.capture.self_check`): padding rows carry no
            gradient, and each weight's gradient is the sum of g a^T over its captured rows;
            a violation falls back and is reported (:meth:`capture_report`), and a zero
            gradient proves nothing (its statistics wait for a nonzero one); 1 means the
            same (the former every-capture schedule). None or False:
            never. A layer whose factors have taken no statistic yet is not preconditioned:
            its gradient goes to the backbone unchanged, and it is listed in
            :attr:`skip_reasons` with the reason.
        comm_overlap: launch the vector all-reduce asynchronously as soon as a backward
            pass has reached every captured layer, instead of in :meth:`step` (same
            result; every rank must run the same forward/backward structure, and with
            accumulation non-final micro-batches belong in DDP's ``no_sync()``).
        rank: k >= 1 group means per factor and update (KC7, KC8; :mod:`.rank_k`). 1 (default)
            is rank-1 MKOR, run by its own code. k > 1: the rows of each forward call (in
            their leading layout, row-major: sample order for batch-first rows) are cut into
            k contiguous groups; group j's sums pool the j-th pieces of every call,
            micro-batch and rank of the step (so DDP equals one process accumulating the
            ranks' batches); the factors take a Woodbury step of rank k', the groups holding
            a real row, in O(k d^2 + k^3); the all-reduce carries k vectors per factor.

    Distributed (``torch.distributed`` initialised, e.g. under ``torchrun`` with DDP): on a
    factor-update step every rank all-reduces one buffer of :attr:`payload_bytes` bytes
    (each layer's a_bar and g_bar, :mod:`.distributed`) and repeats the same updates, so
    the factors stay identical on every rank without sending a matrix.

    Every invalid hyperparameter raises ``ValueError`` naming it.
    """

    _state_key = "mkor"

    def __init__(self, model, optimizer, *, inv_freq=10, stat_decay=0.95, variant="paper",
                 zeta=0.9, threshold=RELEASED_THRESHOLD, stabilizer_norm="max_entry",
                 stabilizer_timing=None, stabilizer_reset=None, stabilizer_coupling=None,
                 first_update=None, rescale=None, factor_dtype=None, average=None,
                 comm_dtype=None, precondition_dtype=None, warmup_steps=0,
                 grad_accum_steps=None, grad_scale=1.0,
                 skip_modules=(), grad_hook="tensor", hybrid_switch=None,
                 switch_window=50, switch_check_every=10, switch_threshold=1e-3,
                 switch_patience=3, switch_step=None, max_factor_dim=8192,
                 token_mask="attention_mask", factor_placement="replicated", grad_scaler=None,
                 process_group=None, comm_overlap=False, self_check=True, rank=1,
                 factor_rounding="nearest", rounding_seed=None):
        self._bind(model, optimizer, grad_scaler)
        self.options = o = MKOROptions(
            inv_freq=inv_freq, stat_decay=stat_decay, variant=variant, zeta=zeta,
            threshold=threshold, stabilizer_norm=stabilizer_norm,
            stabilizer_timing=stabilizer_timing, stabilizer_reset=stabilizer_reset,
            stabilizer_coupling=stabilizer_coupling, first_update=first_update,
            rescale=rescale, factor_dtype=factor_dtype, average=average, comm_dtype=comm_dtype,
            precondition_dtype=precondition_dtype, warmup_steps=warmup_steps,
            grad_accum_steps=grad_accum_steps, grad_scale=grad_scale,
            skip_modules=skip_modules, grad_hook=grad_hook, hybrid_switch=hybrid_switch,
            switch_window=switch_window, switch_check_every=switch_check_every,
            switch_threshold=switch_threshold, switch_patience=switch_patience,
            switch_step=switch_step, max_factor_dim=max_factor_dim, token_mask=token_mask,
            factor_placement=factor_placement, rank=rank, factor_rounding=factor_rounding,
            rounding_seed=rounding_seed)
        check_bool("comm_overlap", comm_overlap)
        self.process_group = process_group
        found = discover(unwrap_model(model), o.skip_modules, optimizer, o.max_factor_dim)
        self._layers, self._skipped, self._frozen = found.layers, found.skipped, found.frozen
        check_supported_sharding(unwrap_model(model), self._layers, "MKOR")
        self._owners = owner_map(self._layers, o.factor_placement, "MKOR")
        warn_identity_sides("MKOR", self._layers, o.factor_dtype.itemsize)
        if not self._layers:
            warn_nothing_preconditioned("MKOR", self._skipped)
        self._steps = 0
        self._factor_rule, self._precondition_rule = o.factor_rule, o.precondition_rule
        layers = self._layers
        self._hybrid = HybridSwitch(  # MKOR-H (K18): averages losses where the layers live
            o.switch, unwrap_model(model), process_group,
            device=lambda: layers[0].module.weight.device if layers else "cpu")
        self._grad_scale = o.grad_scale
        self._state = {layer.name: self._initial_state(layer) for layer in self._layers}
        # LP5: the stochastic writes' seed (None: nearest) and each layer's word in it
        self.rounding_seed = None if o.factor_rounding == "nearest" else resolve_rounding_seed(
            o.rounding_seed, process_group, layers[0].module.weight.device if layers else "cpu")
        self._index = {layer.name: i for i, layer in enumerate(self._layers)}
        self._workspace = Workspace()  # the GEMM outputs of precondition(), reused
        # expert parallelism: a stack's sums travel over its row group alone (nothing where
        # that is this rank), the dense layers' over the process group as ever
        dense = [l for l in self._layers if l.expert_shard is None]
        self._exchange = VectorExchange(dense, model, o.exchange, process_group, o.rank)
        by_rows = {}
        for layer in self._layers:
            if layer.expert_shard is not None:
                by_rows.setdefault(id(layer.expert_shard.row_group), []).append(layer)
        if by_rows and o.rank > 1:
            raise ValueError("MKOR: rank > 1 under expert parallelism is not supported (the "
                             "stacks of experts sharded over an EP mesh); use rank=1")
        self._expert_exchanges = [
            VectorExchange(layers, model, o.exchange, layers[0].expert_shard.row_group, o.rank,
                           data_world=world_size(process_group))
            for layers in by_rows.values()]
        # comm_overlap: launch the all-reduce when a backward has reached every captured layer
        self._progress = BackwardProgress(weak_schedule(self._launch_early)) if comm_overlap \
            else None
        # rank k (KC7): group sums instead of the rank-1 sums; rank 1 runs the rank-1 code
        stats = (_input_stat, _grad_stat) if o.rank == 1 else (
            functools.partial(_group_input_stat, rank=o.rank),
            functools.partial(_group_grad_stat, rank=o.rank))
        self._capture = Capture(
            self._layers, weak_schedule(self.factor_update_due), *stats,
            grad_hook=o.grad_hook, model=unwrap_model(model), mask_kwarg=o.token_mask,
            self_check=self_check, listener=self._progress)
        self._capture.register()
        self._attach([unwrap_model(model)] + [l.module for l in self._layers])

    # -- introspection -----------------------------------------------------------------
    @property
    def payload_bytes(self):
        """Bytes each rank all-reduces per factor update (whether or not distributed):
        (sum_m (d_in'+d_out) + #bias-free layers) x itemsize(comm dtype)."""
        return self._exchange.packet.nbytes + sum(
            e.packet.nbytes for e in self._expert_exchanges if e.group is not LOCAL)

    @property
    def communicated_bytes(self):
        """Bytes this rank has all-reduced so far (a Python int, no sync; 0 on one rank)."""
        return self._exchange.communicated_bytes + sum(
            e.communicated_bytes for e in self._expert_exchanges)

    def factor_update_due(self):
        """K2 schedule for the current step: t % inv_freq == 0 or t < warmup_steps."""
        o = self.options
        return not (self._hybrid.switched or self._detached) and (
            self._steps % o.inv_freq == 0 or self._steps < o.warmup_steps)

    def captured_modules(self):
        """Names of modules whose statistics for the pending step are complete."""
        return [l.name for l in self._layers if self._capture.stats(l.name) is not None]

    def inverse_factors(self):
        """{name: (L_inv, R_inv)}: the stored inverse factors, None for a side the size
        guard leaves at the identity or whose factors another rank owns ({} after the
        switch)."""
        return {name: (s.get("L_inv"), s.get("R_inv")) for name, s in self._state.items()}

    def counters(self):
        """{name: {...}} of 0-d tensors: factor updates refused for ``non_finite``
        statistics and for an ``overflow`` of the update, updates sat out with ``no_rows``,
        stabiliser ``fired`` count, ``updates_a`` / ``updates_g`` and deferred flags; for
        the layers whose state this rank keeps (all but those another rank owns)."""
        keys = ("non_finite", "overflow", "no_rows", "fired", "updates_a", "updates_g",
                "reset_a", "reset_g")
        return {name: {k: s[k] for k in keys} for name, s in self._state.items() if s}

    @property
    def skipped_updates(self):
        """Total factor updates refused (non-finite statistics or an overflowing update; a
        tensor: reading its value is a host sync, done by the caller). Layers without rows
        are not refused updates: see ``counters()[name]["no_rows"]``."""
        counts = [s["non_finite"] + s["overflow"] for s in self._state.values() if s]
        if not counts:
            return torch.zeros((), dtype=torch.int64)
        return torch.stack([c.to(counts[0].device) for c in counts]).sum()

    def __repr__(self):
        return (f"MKOR(layers={len(self._layers)}, skipped={len(self._skipped)}, "
                f"variant={self.options.variant!r}, steps={self._steps}, "
                f"switched={self.switched}, optimizer={type(self.optimizer).__name__})")

    # -- state --------------------------------------------------------------------------
    def _initial_state(self, layer, device=None):
        """A fresh layer state (on ``device``, default the layer's); none at all on a rank
        that does not own the layer, so each entry lives on one rank and DCP (which saves
        one copy of an entry several ranks hold, from a rank of its choosing) saves the
        owner's."""
        if not self._owns(layer.name):
            return {}
        return initial_layer_state(layer, self.options.factor_dtype, device)

    def _released_state(self):
        """After the switch the factors are freed, but a checkpoint keeps the layout of a
        fresh state: DCP loads into a fresh optimizer's state dict and refuses an entry the
        checkpoint lacks. Every entry is a zero of its shape with one element of storage
        behind it (an ``expand``), so this costs no memory and saves no matrix."""
        return {l.name: {k: torch.zeros((), dtype=v.dtype, device=l.module.weight.device)
                         .expand(v.shape) for k, v in self._initial_state(l, "meta").items()}
                for l in self._layers}

    def _owns(self, name):
        return owns(self._owners, name)

    def _preconditioner_state(self, clone):
        """MKOR's own state: factors and counters (by module name), step count, switch
        state and buffered losses, loss scale (the tensors copied if ``clone``)."""
        layers = (self._released_state() if self.switched else
                  {n: {k: v.clone() if clone else v for k, v in s.items()}
                   for n, s in self._state.items()})
        hybrid = self._hybrid.state_dict()
        run = {"steps": self._steps, "switched": hybrid["switched"], "layers": layers,
               "rule": hybrid["rule"], "losses": hybrid["losses"],
               "grad_scale": self._grad_scale}
        if self.rounding_seed is not None:  # the LP2 streams resume from it (LP5)
            run["rounding_seed"] = self.rounding_seed
        return run

    def load_preconditioner_state_dict(self, state):
        """Restore :meth:`preconditioner_state_dict` output."""
        if state["switched"]:
            self._switch()
        else:
            names = set(self._state)
            if set(state["layers"]) != names:
                raise ValueError(f"state_dict layers {sorted(state['layers'])} do not match "
                                 f"the preconditioned modules {sorted(names)}")
            for name, saved in state["layers"].items():
                own = self._state[name]
                if not kept_here(name, own, saved):
                    continue
                saved = _upgrade_counters(saved)
                if set(saved) != set(own):
                    raise ValueError(f"{name}: state keys {sorted(saved)} != {sorted(own)} "
                                     "(a different max_factor_dim?)")
                for key, value in saved.items():
                    if own[key].shape != value.shape:
                        raise ValueError(f"{name}.{key}: shape {tuple(value.shape)} != "
                                         f"{tuple(own[key].shape)}")
                    own[key] = value.to(device=own[key].device, dtype=own[key].dtype).clone()
        self._steps = state["steps"]
        if self.rounding_seed is not None and "rounding_seed" in state:
            self.rounding_seed = int(state["rounding_seed"])
        self._hybrid.load_state_dict(state)
        self._grad_scale = state.get("grad_scale", self._grad_scale)

    def remove(self):
        super().remove()
        self._hybrid.remove()

    # -- MKOR-H (K18; :mod:`.hybrid`) --------------------------------------------------------
    @property
    def switched(self):
        """Whether MKOR-H has handed over to the backbone (one-way)."""
        return self._hybrid.switched

    @property
    def switch_rule(self):
        return self._hybrid.rule

    def _switch(self):
        """One-way hand-over: hooks removed, factors freed, backbone state kept."""
        self._exchange.drop()
        self._capture.remove()
        self._state = {}
        self._hybrid.mark_switched(self._steps)

    def observe_loss(self, loss):
        """Feed this step's loss to the MKOR-H rule (a float, or a tensor: buffered and read
        once per ``switch_check_every`` steps, when the rule checks, so a tensor costs no
        host sync at the other steps); call it before ``step()``. Distributed, the rule
        sees the mean loss over the ranks, so every rank switches at the same step. Returns
        whether MKOR has switched."""
        if self._hybrid.observe_loss(loss):
            self._switch()
        return self.switched

    def _observe(self, loss):
        """This step's loss: ``loss`` (argument or closure), else one given to
        :meth:`observe_loss` since the last step, else the model output's."""
        if self._hybrid.observe(loss, self._steps, lambda m: self._warn_once("no loss", m)):
            self._switch()

    # -- the step -----------------------------------------------------------------------
    def _drop_statistics(self, completed_only=False):
        self._exchange.drop()
        if completed_only:
            self._capture.drop_committed()
        else:
            self._capture.reset()
        self._hybrid.drop()

    @torch.no_grad()
    def precondition(self):
        """Update factors when due (K2) and replace every hooked layer's ``.grad`` by
        its rescaled preconditioned gradient (K13, K14); advances the step counter.
        A no-op after the MKOR-H switch. No host synchronisation."""
        if self.switched or self._detached:
            return
        if self._binding.moved():  # parameters replaced since construction (placement)
            self._owners = self._binding.follow(self, self.options.factor_placement,
                                                        "MKOR")
        if self._hybrid.step_due(self._steps):
            self._switch()
            return
        if self.factor_update_due():
            unpaired = self._capture.unpaired()
            if unpaired:
                self._capture.reset()
                raise RuntimeError(
                    f"MKOR: {', '.join(unpaired)} ran a train-mode forward under grad that "
                    "never got a backward; with grad_hook='module' gradients cannot be paired "
                    "with their forward. Run such forwards under torch.no_grad() or eval(), "
                    "or use grad_hook='tensor' (the default), which pairs them exactly.")
            refused = self._finish_capture()
            if refused:  # an early (comm_overlap) launch carried the refused statistics
                self._exchange.drop()
            self._update_factors()
        self._capture.reset()
        released = self._capture.check.released
        for layer in self._layers:
            if layer.name not in released:
                self._precondition_layer(layer)
        self._steps += 1
        self._step_scale = None
        self._capture.refresh()  # the hooks' gate for the next step

    # -- internals ----------------------------------------------------------------------
    def pending_sums(self):
        """{name: (a_sum, rows, g_sum)} captured since the last step, in the compute dtype:
        a_sum = sum_i [a_i | 1] over the rows, their number (an int, or a 0-d tensor under
        a token mask), and g_sum = sum_i g_i divided by the loss scale and
        ``grad_accum_steps``: what one rank contributes to the union's vectors."""
        o, cd = self.options, self.options.compute_dtype
        g_div = o.grad_accum_steps or 1
        scale = self._step_scale if self._step_scale is not None else self._configured_scale()
        out = {}
        for layer in self._layers:
            stats = self._capture.stats(layer.name)
            if stats is not None:
                a_sum, rows, g_sum, _ = stats
                out[layer.name] = (a_sum.to(cd), rows, g_sum.to(cd) / g_div / scale)
        return out

    def pending_vectors(self):
        """{name: (a_bar, g_bar)} from the statistics captured since the last step, in
        the compute dtype, before any cross-rank averaging (for inspection and tests); a
        layer whose forwards had no rows has no a_bar and is left out (or, when its row
        count is a tensor, gets a_bar = 0)."""
        out = {}
        by_name = {layer.name: layer for layer in self._layers}
        for name, (a_sum, rows, g) in self.pending_sums().items():
            if self.options.rank > 1:  # the group means (KC7), k x d (0 for an empty group)
                out[name] = group_vectors(a_sum, g, by_name[name].has_bias)[:2]
            elif isinstance(rows, torch.Tensor):
                out[name] = (_row_mean(a_sum, rows), g)
            elif rows > 0:
                out[name] = (a_sum / rows, g)
        return out

    def _launch_early(self):
        """comm_overlap: a backward pass has reached every captured layer."""
        if self.factor_update_due():
            self._exchange.launch_early(self.pending_sums(), self._progress.commits)

    def _vectors(self):
        """(layer, a_bar, g_bar, present) for every layer to update this step. Distributed,
        every rank sends every layer's sums (zeros where absent) so the buffer layouts
        agree; a layer with no rows on any rank comes back with present = False and is
        left untouched (counted in ``no_rows``)."""
        pending = self.pending_sums()
        if world_size(self.process_group) == 1:
            self._check_captured(self._layers, bool(pending))
            out = []
            for layer in self._layers:
                if layer.name not in pending:  # not called since the last step
                    out.append((layer, None, None, False))
                    continue
                a_sum, rows, g = pending[layer.name]
                if self.options.rank > 1:  # (A, G, present, groups): KC7
                    out.append((layer, *group_vectors(a_sum, g, layer.has_bias)))
                elif isinstance(rows, torch.Tensor):  # masked or experts: no host sync
                    out.append((layer, _row_mean(a_sum, rows), g, rows > 0))
                elif rows > 0:
                    out.append((layer, a_sum / rows, g, None))
                else:  # only calls with 0 rows (an MoE expert routed no tokens)
                    out.append((layer, None, None, False))
            return out
        out = self._exchange.exchange(
            pending, None if self._progress is None else self._progress.commits)
        for exchange in self._expert_exchanges:
            out += exchange.exchange(pending)
        return out

    def _layers_with_statistics(self):
        return [name for name, s in self._state.items()
                if not s or bool(((s["updates_a"] + s["updates_g"]) > 0).any())]

    def _update_factors(self):
        for layer, a_bar, g_bar, present, *groups in self._vectors():
            if self._owns(layer.name):  # the owner alone updates an owned layer's factors
                update_layer_factors(self._state[layer.name], a_bar, g_bar, present,
                                     self._factor_rule, self._workspace, *groups,
                                     seeds=self._write_seeds(layer.name))

    def _write_seeds(self, name):
        """The LP2 seeds of this step's writes of the layer's factors (None: nearest)."""
        if self.rounding_seed is None:
            return None
        return {key: factor_seed(self.rounding_seed, self._index[name], key, self._steps)
                for key in ("R_inv", "L_inv")}

    def _precondition_layer(self, layer):
        precondition_layer(layer, self._state[layer.name], self._precondition_rule,
                           self._workspace, self._owners.get(layer.name))
