"""``MARS``: variance-reduced preconditioned optimizer (arXiv 2411.10438) as a torch.optim.Optimizer."""
from typing import NamedTuple

import torch
from torch.optim import Optimizer

from . import exact_mode
from . import functional
from . import mars_equations
from ..common.sharding import ORTHOGONALIZE_ON
from ..common import state_storage
from ..common.validation import check_betas as _check_betas, check_choice as _check_choice, \
    check_matrix_batch_dims, check_ns_coefficients, check_number as _check_number, \
    check_shared, check_torch_flags as _check_torch_flags, tensor_scalar

MARS_TYPES = ("mars-adamw", "mars-lion", "mars-shampoo")
CLIP_SCOPES = ("tensor", "global", "none")
ORTHOGONALIZERS = ("newton_schulz", "svd", "gram_newton_schulz")
WEIGHT_DECAY_1D_SOURCES = ("constructor", "group")
SHAPE_LAYOUTS = ("out_in", "in_out")
NS_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_ONE_MODE = "exact mode re-evaluates the whole model at x_{t-1}"


class MARS(Optimizer):
    r"""MARS: scaled stochastic recursive momentum, then a preconditioner.

    .. math::
        \begin{aligned}
        &\textbf{for } t = 1, 2, \dots: \\
        &\quad g_t = \nabla f(x_t, \xi_t), \qquad
              a = \gamma \beta_1 / (1 - \beta_1) \\
        &\quad c_t = g_t + a\,(g_t - g_{\text{prev}})
              && \text{(M1 exact: } g_{\text{prev}} = \nabla f(x_{t-1}, \xi_t);
                 \text{ M2 approx: } g_{\text{prev}} = g_{t-1};\ g_{\text{prev}} = 0 \text{ at } t = 1) \\
        &\quad && \text{(a tensor outside a loss has gradient 0 there: } g_{\text{prev}} = 0
                 \text{ after a step it had no gradient in (M2), or at } x_{t-1} \text{ (M1))} \\
        &\quad \tilde c_t = c_t / \max(1, \|c_t\|)
              && \text{(M3; norm per tensor, or global, or no clip)} \\
        &\quad m_t = \beta_1 m_{t-1} + (1 - \beta_1)\,\tilde c_t && \text{(M4)} \\
        &\quad \text{mars-adamw: } v_t = \beta_2 v_{t-1} + (1 - \beta_2)\,\tilde c_t^2,\
              u_t = \frac{m_t / (1 - \beta_1^t)}{\sqrt{v_t / (1 - \beta_2^t)} + \epsilon}
              && \text{(M6, M7; } v \to \max(\bar v, v) \text{ with amsgrad, M9)} \\
        &\quad \text{mars-lion: } u_t = \operatorname{sign}(m_t) && \text{(M10)} \\
        &\quad \text{mars-shampoo (2-D): } u_t = \sqrt{\max(1, A/B)}\;
              \mathrm{NS}_5\big(m_t / (1 - \beta_1)\big) && \text{(M12, M13; or } UV^\top \text{, M11)} \\
        &\quad x_{t+1} = x_t - \eta\,(u_t + \lambda x_t) && \text{(M8)} \\
        &\textbf{a stack } X \in \mathbb{R}^{E \times A \times B}
              \textbf{ (matrix\_batch\_dims} = 1\textbf{)}: \
              \tilde c_{t,e} = c_{t,e} / \max(1, \|c_{t,e}\|_F),\
              u_{t,e} = \sqrt{\max(1, A/B)}\, \mathrm{NS}_5\big(m_{t,e} / (1 - \beta_1)\big)
              && \text{(M3, M12 for each matrix } e \text{)}
        \end{aligned}

    Tensors that are not 2-D (biases, norms, 4-D convolution kernels) take plain AdamW on the
    raw gradient unless ``optimize_1d=True`` (M14): betas ``betas_1d``, learning rate
    ``lr * lr_1d / lr0`` (``lr0`` the constructor's ``lr``, so the ratio follows any schedule on
    ``group["lr"]``) and weight decay ``weight_decay_1d``.

    Args (names and defaults of the official class):
        params: iterable of parameters or parameter-group dicts.
        lr (float or Tensor): :math:`\eta` (a one-element CPU tensor, as torch.optim.AdamW
            takes). Default ``3e-3``.
        betas (tuple): :math:`(\beta_1, \beta_2)`, numbers or one-element CPU tensors (as
            AdamW's; so are ``lr`` and ``betas_1d``: read on the host in an eager step, traced
            as data by ``torch.compile(opt.step)``, so a schedule written into them with
            ``fill_`` never recompiles). Default ``(0.95, 0.99)``.
        eps (float): :math:`\epsilon`; also Newton-Schulz's eps. Default ``1e-8``.
        weight_decay (float): :math:`\lambda`, decoupled. Default ``0``.
        amsgrad (bool): use :math:`\bar v_t` (M9) in the AdamW rule; a ValueError with
            mars-lion, or mars-shampoo without ``optimize_1d``, where it could act on nothing.
            Default ``False``.
        gamma (float): :math:`\gamma \in [0, 1]` (0: plain EMA, i.e. AdamW/Lion; 1: STORM).
            Default ``0.025``.
        is_approx (bool): ``True`` for (M2); ``False`` for the exact correction (M1), which needs
            ``step(closure)`` and costs a second forward+backward per step plus one
            parameter-sized buffer (x_{t-1}); the authors' loop (``update_previous_grad()``
            on the next batch, ``step()``, ``update_last_grad()``) also works. Default ``True``.
        mars_type (str): ``"mars-adamw"``, ``"mars-lion"`` or ``"mars-shampoo"``.
        optimize_1d (bool): send non-2-D tensors through MARS too. Default ``False``.
        lr_1d (float), betas_1d (tuple), weight_decay_1d (float): the fallback's
            hyperparameters. Defaults ``3e-3``, ``(0.9, 0.95)``, ``0.1``.  Each may be set
            per parameter group; a group's ``lr_1d`` is stored as ``lr_1d_factor`` =
            ``lr_1d / lr`` of that group.

    Keyword-only (the documented deviations; ``paper_notes/mars.md``):
        clip_scope: ``"tensor"`` (official), ``"global"`` (paper: one norm over every MARS tensor
            of every group with this scope) or ``"none"``.
        orthogonalizer: ``"newton_schulz"`` (official), ``"svd"`` (paper's UV^T) or
            ``"gram_newton_schulz"`` (M13b: the same iteration on the n x n Gram matrix of a
            rectangular matrix; nearly square ones, aspect <= 1.5, keep the standard one; not
            with ``ns_dtype=torch.float16``).  The matrices of one shape are orthogonalised
            in one batched call (``paper_notes/orthogonalisation.md``).
        ns_steps (int): Newton-Schulz steps. Default 5.
        ns_dtype: dtype of the Newton-Schulz iteration. Default ``torch.bfloat16`` (official).
        ns_coefficients: each Newton-Schulz step's (a, b, c) (M13a): ``"authors"`` (default),
            ``"polar_express"``, one triple (as ``torch.optim.Muon`` takes it) or a sequence of
            triples, one per step (the last repeats).
        weight_decay_1d_source: ``"constructor"`` (official: ``weight_decay_1d``) or
            ``"group"`` (the group's ``weight_decay``).
        state_dtype: the dtype the state (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``,
            ``last_grad``) is *stored* in.  A step computes in the wider of the parameter's
            dtype and ``state_dtype`` (``torch.promote_types``: float32 for bf16 with fp16):
            float32 parameters with bf16 state compute in float32 and store the new state
            rounded to bf16; bf16 parameters with float32 state compute in a float32 working
            copy of the parameter, written back once per step.  The parameter keeps its dtype
            and is only ever rounded to that dtype (float32 parameters with ``lr=0`` do not
            change at all), so a bf16 parameter still loses a step below half its ulp (keep
            float32 master weights, or ``kahan_sum``, when that matters).  Exact mode's
            ``prev_param`` and ``previous_grad`` keep the parameter's and the gradient's dtype.
            ``load_state_dict`` keeps the state in ``state_dtype`` (torch would cast it to the
            parameter's dtype).  Default ``None``: the parameter's own dtype.
        state_rounding: how a working copy w is written back into a narrower stored tensor:
            ``"nearest"`` (default; RN(w), the behaviour before the option) or
            ``"stochastic"`` (LP1): the step computes in float32 at least and every narrower
            write -- each state buffer, a 16-bit parameter (unless ``kahan_sum``), exact
            mode's g_prev in ``last_grad`` -- stores
            :math:`\mathrm{SR}(w) = hi` if :math:`u < (w - lo)/(hi - lo)` else :math:`lo`
            (lo <= w <= hi adjacent stored values; :math:`\mathbb{E}\,\mathrm{SR}(w) = w`),
            u from the stream (LP2) ``stream_seed(rounding_seed, group index, position in the
            group, name_word(key), t)``, key the state key (``"param"``: the parameter;
            ``"g_prev"``: exact mode's refill), t the tensor's step count after the step.
            Needs bf16 / fp16 state in every tensor of the group (``state_dtype``, or the
            parameters' own dtype), else a ValueError (``paper_notes/low_precision.md``).
        rounding_seed (int or None): the streams' seed, kept in the group (and so in
            ``state_dict``: a resumed run is the uninterrupted one, bit for bit).  ``None``:
            one draw of torch's default generator when the optimizer first rounds
            stochastically (an optimizer that never does draws nothing).
        kahan_sum (bool): bf16 / fp16 parameters keep a compensation c (``kahan_comp``, LP3):
            a step starts from x = p + c in float32 and writes p = RN(x), c = RN(x - p), so p
            follows the float32 trajectory to within an ulp.  float32 / float64 parameters
            lose nothing and keep no buffer.  Default ``False``.
        state_quantization (None or ``"blockwise8"``), block_size (int): LP4, ``exp_avg``
            (signed map), ``exp_avg_sq`` and ``max_exp_avg_sq`` (unsigned) held as
            ``<name>_codes`` (uint8) and ``<name>_absmax`` (float32 per block of
            ``block_size`` values, default 256): a step computes on
            :math:`\hat x = s\,\mathrm{code}[q]` in float32 at least and writes
            :math:`q = \arg\min_k |x/s - \mathrm{code}[k]|`, s = max |x| per block.
            ``last_grad`` keeps ``state_dtype``.  Every tensor of the group must fill a
            block; complex and DTensor parameters are refused (``paper_notes/quantized_state.md``).
        maximize (bool): ascend instead. foreach (bool or None): multi-tensor kernels; ``None``
            picks them when every parameter is on CUDA.
        compiled (bool or str): ``True`` / ``"tensor"``: run each tensor's elementwise step as
            one ``torch.compile``d kernel (``mars_compiled.py``; one reduction pass for the clip
            norm, one fused pass for the rest), built from the same equation functions as the
            eager paths.  ``"group"``: the same kernels, one compiled call per group and route,
            which removes the per-tensor call overhead at the price of a longer first
            compilation and a recompilation whenever the set of parameters with gradients
            changes.  Schedules and step counts enter as tensors and lengths are dynamic, so
            later steps do not recompile.  MARS-Shampoo matrices keep the eager path.
            Measured costs: README, "Performance".
        shape_layout: ``"out_in"`` (default) or ``"in_out"``: how a 2-D parameter (or each
            matrix of a stack) stores its matrix.  MARS-Shampoo's s = sqrt(max(1, A/B)) is
            taken from the true (out, in) shape, so give a group of transformers ``Conv1D``
            weights (stored in x out) ``shape_layout="in_out"``.
        matrix_batch_dims (int): how many leading dims of a tensor index independent matrices,
            per group (fused MoE experts, e.g. transformers' ``MixtralExperts.gate_up_proj``
            (E, 2I, H): ``matrix_batch_dims=1``). Default ``0``: every tensor is what its shape
            says (a 3-D tensor is never taken for a stack: a Conv1d kernel is not one). With
            k >= 1, a tensor of ndim k + 2 is a stack whose A x B matrices each take the
            group's rule exactly as separate 2-D parameters would: the per-tensor clip (M3)
            divides each matrix by its own norm (``clip_scope="global"`` keeps one norm over
            everything), and MARS-Shampoo scales each by its s = sqrt(max(1, A/B)) and
            orthogonalises each on its own (M12, M13).  mars-adamw and mars-lion are
            elementwise, so for them only the clip is per matrix (and stacks take the MARS
            path instead of the non-2-D fallback).  Tensors of ndim < 2 in such a group route
            as without the option (the fallback, M14, or ``optimize_1d``); any other shape is
            refused (ValueError naming ``matrix_batch_dims``).  Under FSDP2 a stack sharded on
            its leading dims (``Shard(0)``) is clipped and orthogonalised on each rank's own
            matrices, with no communication.
        orthogonalize_on: where a sharded (FSDP2 / DTensor) MARS-Shampoo matrix is
            orthogonalised: ``"owner"`` (default: each matrix once, on one owner rank chosen
            by greedy longest-first on its Newton-Schulz flops; two ``all_to_all`` per step
            and group) or ``"every_rank"`` (all-gather each matrix; every rank runs every
            orthogonalisation). Same result; plain tensors are unaffected
            (``torch_impl/common/sharding.py``).
        fused (None or False), capturable (False), differentiable (False): accepted, as other
            ``torch.optim`` optimizers take them (torchtitan passes ``fused`` and ``foreach``),
            and stored in every group; ``True`` raises a ValueError naming the keyword, in the
            constructor and in any group dict (there is no fused kernel, the step reads CPU
            step counters on the host, and it runs under ``torch.no_grad``).

    ``torch.compile(opt.step)`` traces the whole step (``_init_group`` follows torch's
    protocol: it fills the lists it is given), for every ``mars_type``, with or without
    ``foreach`` and with ``compiled=``; exact mode's closure re-evaluation is eager Python.

    A step checks every group's hyperparameters (as the constructor does: a scheduler or a
    user may have written any of them since) and gradients (sparse, complex) before it
    changes anything, so a step that raises leaves every group as it was.  A traced step
    checks tensor hyperparameters' dtype and device only: their values are the graph's data.

    State per tensor: ``step`` (CPU float tensor), ``exp_avg``; ``exp_avg_sq`` for the AdamW
    rules (not allocated for Lion or Shampoo matrices, spec B6); ``max_exp_avg_sq`` with
    amsgrad; ``last_grad`` for tensors on the MARS path (a copy of the raw g, never an alias
    of ``p.grad``, spec B1); ``prev_param`` (x_{t-1}) in exact mode; ``kahan_comp`` with
    ``kahan_sum`` (16-bit parameters); ``<name>_codes`` and ``<name>_absmax`` for a moment
    held in 8 bits.  ``init_state()`` creates
    the first step's state up front (counters at 0), so that torchtitan's and DCP's
    zero-gradient init step, which would advance the counters, does nothing.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = MARS(model.parameters(), lr=1e-3)
        >>> model(torch.ones(3, 4)).square().mean().backward()
        >>> opt.step()
    """

    def __init__(self, params, lr=3e-3, betas=(0.95, 0.99), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, gamma=0.025, is_approx=True, mars_type="mars-adamw",
                 optimize_1d=False, lr_1d=3e-3, betas_1d=(0.9, 0.95), weight_decay_1d=0.1, *,
                 clip_scope="tensor", orthogonalizer="newton_schulz", ns_steps=5,
                 ns_dtype=torch.bfloat16, ns_coefficients="authors",
                 weight_decay_1d_source="constructor",
                 state_dtype=None, state_rounding="nearest", rounding_seed=None,
                 kahan_sum=False, state_quantization=None, block_size=256,
                 maximize=False, foreach=None, compiled=False,
                 shape_layout="out_in", orthogonalize_on="owner", matrix_batch_dims=0,
                 fused=None, capturable=False, differentiable=False):
        lr_value = _lr_value(lr)
        _check_number("lr_1d", lr_1d, low=0.0)
        if lr_value == 0.0 and lr_1d != 0.0:
            raise ValueError("lr_1d: the 1-D learning rate is kept as the ratio lr_1d / lr, "
                             "which is undefined for lr = 0; pass the peak lr and let a "
                             "scheduler scale it")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        gamma=gamma, is_approx=is_approx, mars_type=mars_type,
                        optimize_1d=optimize_1d,
                        lr_1d_factor=lr_1d / lr_value if lr_value > 0 else 0.0,
                        betas_1d=betas_1d, weight_decay_1d=weight_decay_1d,
                        clip_scope=clip_scope, orthogonalizer=orthogonalizer, ns_steps=ns_steps,
                        ns_dtype=ns_dtype, ns_coefficients=ns_coefficients,
                        weight_decay_1d_source=weight_decay_1d_source,
                        state_dtype=state_dtype, state_rounding=state_rounding,
                        rounding_seed=rounding_seed, kahan_sum=kahan_sum,
                        state_quantization=state_quantization, block_size=block_size,
                        maximize=maximize, foreach=foreach,
                        compiled=compiled, shape_layout=shape_layout,
                        orthogonalize_on=orthogonalize_on, matrix_batch_dims=matrix_batch_dims,
                        fused=fused,
                        capturable=capturable, differentiable=differentiable)
        _check_torch_flags("MARS", defaults)  # every group is checked again (add_param_group)
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        if "lr_1d" in param_group:  # a group's own 1-D lr, kept as a ratio to the group's lr
            param_group = dict(param_group)
            lr_1d = param_group.pop("lr_1d")
            lr = _lr_value(param_group.get("lr", self.defaults["lr"]))
            _check_number("lr_1d", lr_1d, low=0.0)
            if lr == 0.0 and lr_1d != 0.0:
                raise ValueError("lr_1d: a group with lr = 0 cannot define lr_1d / lr")
            param_group["lr_1d_factor"] = lr_1d / lr if lr > 0 else 0.0
        super().add_param_group(param_group)
        try:
            _validate_group(self.param_groups[-1])
            check_shared("is_approx", self.param_groups, _ONE_MODE)
        except ValueError:
            self.param_groups.pop()
            raise
        state_storage.resolve_rounding_seed(self, self.param_groups[-1])

    def _check_groups(self):
        """Every group's hyperparameters, as ``add_param_group`` checks them: they are read
        from the groups at each step (a scheduler, or a user, may have written any of them
        since), and a refusal must come before the first group changes -- so that a step
        that raises leaves every parameter, state entry and step counter as it was."""
        for group in self.param_groups:
            _validate_group(group)
        check_shared("is_approx", self.param_groups, _ONE_MODE)
        for group in self.param_groups:  # a group turned stochastic since: the seed it uses
            state_storage.resolve_rounding_seed(self, group)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:  # back-fill options added after a checkpoint was made
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        for st in self.state.values():  # a numeric step (older torch, other MARS ports)
            if "step" in st and not torch.is_tensor(st["step"]):
                st["step"] = torch.tensor(float(st["step"]))

    def load_state_dict(self, state_dict):
        """``Optimizer.load_state_dict``, keeping a ``state_dtype`` that differs from the
        parameter's dtype (torch casts every floating state tensor to the parameter's dtype,
        which would round float32 state of a bf16 parameter), the caller's load hooks
        honoured (``state_storage.load_state_dict_keeping_storage``)."""
        state_storage.load_state_dict_keeping_storage(self, super().load_state_dict,
                                                      state_dict)

    @torch.no_grad()
    def step(self, closure=None):
        """Performs one step and returns the closure's loss (``None`` without a closure).

        Approx mode: ``closure`` is optional.  Exact mode (``is_approx=False``): ``closure`` is
        required; it must compute the loss on the current batch and call ``backward()``.  The
        optimizer calls it at x_{t-1} (to get grad f(x_{t-1}, xi_t)) and then at x_t, restoring
        the random-number state in between so that dropout-like randomness is the same sample.
        """
        self._check_groups()  # every group's, before exact mode moves to x_{t-1}
        exact = not self.param_groups[0]["is_approx"]
        if exact and closure is None and exact_mode.uses_authors_api(self):
            loss = None  # last_grad comes from update_last_grad() (the authors' loop)
            exact_mode.warn_if_scaled_previous_grad(self)
        elif exact:
            if closure is None:
                raise RuntimeError(
                    "MARS exact mode (is_approx=False) needs the gradient at the previous "
                    "iterate on the current batch: call opt.step(closure) with a closure that "
                    "computes the loss on the current batch, calls loss.backward() and returns "
                    "the loss (or use the authors' update_previous_grad()/update_last_grad() "
                    "loop); or construct MARS(..., is_approx=True)")
            loss = self._evaluate_at_previous_iterate_then_current(closure)
        else:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
        self._check_gradients()
        exact_mode.forget_missing_gradients(self)  # (M2): no gradient at t-1 is g_{t-1} = 0
        work = []
        for index, group in enumerate(self.param_groups):
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs = [], [], [], [], []
            last_grads, steps, kinds, scales = [], [], [], []
            self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                             last_grads, steps, kinds, scales)
            work.append(_group_work(group, index, [self.state[p] for p in params], params,
                                    grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, last_grads,
                                    steps, kinds, scales))
        total = mars_equations.global_norm([
            n for group, w in zip(self.param_groups, work) if group["clip_scope"] == "global"
            for n in functional.corrected_norms(w.grads, w.last_grads, w.kinds, group["gamma"],
                                                group["betas"][0], maximize=group["maximize"])])
        for group, w in zip(self.param_groups, work):
            functional.mars(
                w.params, w.grads, w.exp_avgs, w.exp_avg_sqs, w.max_exp_avg_sqs, w.last_grads,
                w.steps, w.kinds, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                weight_decay=group["weight_decay"], amsgrad=group["amsgrad"],
                gamma=group["gamma"], lr_1d_factor=group["lr_1d_factor"],
                betas_1d=group["betas_1d"], weight_decay_1d=group["weight_decay_1d"],
                weight_decay_1d_source=group["weight_decay_1d_source"],
                clip_scope=group["clip_scope"], orthogonalizer=group["orthogonalizer"],
                ns_steps=group["ns_steps"], ns_dtype=group["ns_dtype"],
                ns_coefficients=group["ns_coefficients"], maximize=group["maximize"], foreach=group["foreach"],
                compiled=group["compiled"], write_last_grad=not exact, global_clip_norm=total,
                shampoo_scales=w.scales, orthogonalize_on=group["orthogonalize_on"],
                matrix_batch_dims=group["matrix_batch_dims"])
            w.write_back.finish()  # computed in a wider dtype than stored: round back
        return loss

    def _check_gradients(self):
        """Reject unsupported gradients before any state changes, so a bad step loses nothing
        (the hyperparameters, ``matrix_batch_dims`` against the shapes included, are
        ``_check_groups``'s, before)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError("MARS does not support sparse gradients")
                if p.grad is not None and torch.is_complex(p):
                    raise RuntimeError("MARS does not support complex parameters; optimize "
                                       "torch.view_as_real(p) as a real parameter instead")

    def _init_group(self, group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                    last_grads, steps, kinds, scales):
        """Append the group's live tensors (grad not None) to the given lists, creating state
        lazily (torch.optim's protocol, which ``torch.compile`` runs eagerly at trace time).

        The tensors are the stored ones, in their own dtypes; ``_group_work`` makes the working
        copies that a ``state_dtype`` different from a parameter's dtype needs.
        """
        live = [p for p in group["params"] if p.grad is not None]
        for p, kind, st, buffers in self._create_state(group, live):
            params.append(p)
            grads.append(p.grad)
            for name, column in (("exp_avg", exp_avgs), ("exp_avg_sq", exp_avg_sqs),
                                 ("max_exp_avg_sq", max_exp_avg_sqs),
                                 ("last_grad", last_grads)):
                column.append(state_storage.buffer(st, name) if name in buffers else None)
            steps.append(st["step"])
            kinds.append(kind)
            scales.append(_true_shape_scale(p, group))

    def _create_state(self, group, params):
        """For each tensor of ``params`` (in ``group``), create the state its step needs where
        it is missing -- zeros in the group's ``state_dtype`` (else the tensor's dtype), the
        counter ``step`` a CPU ``torch.tensor(0.0)`` -- and yield (p, route, state, buffer
        names).  Shared by ``_init_group`` (a step) and ``init_state``, so both create the
        same state."""
        for p in params:
            kind = _route(p, group)
            st = self.state[p]
            buffers = ["exp_avg"]
            buffers += ["exp_avg_sq"] if kind in (mars_equations.ADAMW, mars_equations.FALLBACK) else []
            buffers += ["max_exp_avg_sq"] if kind == mars_equations.ADAMW and group["amsgrad"] else []
            buffers += ["last_grad"] if kind != mars_equations.FALLBACK else []
            state_storage.ensure_state(st, p, group, buffers)  # and kahan_comp
            if "step" not in st:
                st["step"] = torch.tensor(0.0)
            yield p, kind, st, buffers

    @torch.no_grad()
    def init_state(self):
        """Create now the state the first ``step()`` would create, before its update: for
        every parameter of every group that requires a gradient and has no state yet, the
        buffers its route keeps (``exp_avg``; ``exp_avg_sq`` on the AdamW rules;
        ``max_exp_avg_sq`` with amsgrad; ``last_grad`` on the MARS path), zeros in the
        group's ``state_dtype`` (else the parameter's dtype; ``zeros_like`` of the parameter,
        so a DTensor parameter gets DTensor state), and ``step`` = 0 (a CPU tensor).

        Why: torchtitan (``init_optim_state``) and DCP (``get_state_dict`` /
        ``set_state_dict`` through ``_init_optim_state``) materialise an empty optimizer
        state by running one ``step()`` with zero gradients and ``lr = 0``.  Here that step
        counts: ``step`` becomes 1, so the first real step takes t = 2 in its bias
        corrections (and in exact mode, without a closure, it raises).  After
        ``init_state()`` the state is not empty, so their init step returns at once, and the
        run is the one without it, bit for bit.

        Parameters, gradients and hyperparameters are not touched; nothing is read on the
        host.  A parameter that already has state keeps it as it is, so a second call
        changes nothing.  A parameter with ``requires_grad=False`` gets no state (nor does
        the init step give it a gradient).  One that requires a gradient but never gets one
        keeps its zero state: a step without its gradient skips it, as always (its
        ``last_grad`` is zeroed, M2, which it already is).  In exact mode ``prev_param``
        (x_{t-1}) is created too, as zeros: a checkpoint template (DCP's ``dcp.load``,
        torchtitan's flat layout) loads only the names the live state has, so without it
        a resumed closure loop would lose x_{t-1} and silently skip its re-evaluation (a
        different run, 5e-3 after 3 steps).  It counts as x_{t-1} once the tensor has taken
        a step (``exact_mode.holds_previous_iterate``); the authors' loop never reads it.
        ``previous_grad`` (the authors' loop) is not created: its presence selects that
        loop, and it is rewritten before every step, so a checkpoint needs none.
        """
        for group in self.param_groups:
            fresh = [p for p in group["params"] if p.requires_grad and not self.state.get(p)]
            for _ in self._create_state(group, fresh):
                pass
            exact_mode.init_previous_iterates(self, fresh)

    def _evaluate_at_previous_iterate_then_current(self, closure):
        """Exact mode (M1): fill ``last_grad`` with grad f(x_{t-1}, xi_t), then evaluate at x_t
        (``exact_mode.evaluate_at_previous_then_current``)."""
        return exact_mode.evaluate_at_previous_then_current(self, closure)

    @property
    def gamma(self):
        """The first group's gamma (``train_mars.py`` reads ``optimizer.gamma``)."""
        return self.param_groups[0]["gamma"]

    def update_previous_grad(self, *, grad_scaler=None):
        """The authors' exact-mode API, step 1 of their loop: keep the gradient now in ``.grad``
        (the *next* batch at the current point) as ``previous_grad``.  No-op in approx mode.
        The closure form of ``step`` is the recommended one (README, "Exact mode"), but torch
        refuses closures under a ``GradScaler``; there, pass the scaler::

            scaler.scale(loss_fn(model, next_batch)).backward()
            opt.update_previous_grad(grad_scaler=scaler)   # stores grad / scale
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss_fn(model, batch)).backward()
            scaler.step(opt)                                # unscales .grad, may skip
            scaler.update()
            opt.zero_grad(set_to_none=True)
            opt.update_last_grad()

        ``grad_scaler``: the ``torch.amp.GradScaler`` that scaled this backward; the stored
        gradient is divided by its current scale (read as a tensor: no host sync).  If any
        stored gradient is not finite (the scale overflowed, the case where the scaler would
        skip a step), every tensor's ``previous_grad`` of this call is set to 0: the next step
        takes g_prev = 0, the start of the recursion (step 1's c = (1 + a) g), rather than a
        correction from a gradient that was never finite.  Without ``grad_scaler`` the scaled
        gradient would be stored and the correction would be off by the loss scale; ``step``
        warns once when it sees a GradScaler drive it after such a call."""
        keeps_last_grad = (lambda p, group: _route(p, group) != mars_equations.FALLBACK)
        exact_mode.update_previous_grad(self, keeps_last_grad, grad_scaler=grad_scaler)

    def update_last_grad(self):
        """The authors' exact-mode API, after ``step``: ``last_grad`` <- ``previous_grad``."""
        exact_mode.update_last_grad(self)

    @property
    def _step_supports_amp_scaling(self):
        """Read by ``GradScaler.step`` just before it calls ``step()``: notes that a scaler
        drives this step (for the authors' loop warning); False, as for any optimizer that
        leaves unscaling and inf-skipping to the scaler."""
        exact_mode.note_grad_scaler(self)
        return False


class _GroupWork(NamedTuple):
    """One group's columns for ``functional.mars``, in the step's compute dtype, and the
    ``WriteBack`` that puts them back after the update."""
    params: list
    grads: list
    exp_avgs: list
    exp_avg_sqs: list
    max_exp_avg_sqs: list
    last_grads: list
    steps: list
    kinds: list
    scales: list
    write_back: list


def _group_work(group, index, states, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                last_grads, steps, kinds, scales):
    """The columns in each tensor's compute dtype (``state_storage.compute_dtype``): working
    copies where a stored tensor is narrower, written back after the update
    (``state_storage.WriteBack``); gradients are only read."""
    back = state_storage.WriteBack(group, index)
    columns = [back.column(name, c, params, states) for name, c in (
        ("exp_avg", exp_avgs), ("exp_avg_sq", exp_avg_sqs),
        ("max_exp_avg_sq", max_exp_avg_sqs), ("last_grad", last_grads))]
    return _GroupWork(back.params(params, states), back.read(grads, params), *columns, steps,
                      kinds, scales, back)


def _route(p, group):
    """The route of tensor ``p`` in ``group`` (``mars_equations.route``)."""
    return mars_equations.route(p.shape, group["mars_type"], group["optimize_1d"],
                                group["matrix_batch_dims"])


def _true_shape_scale(p, group):
    """s for a Shampoo matrix stored transposed (``shape_layout="in_out"``: transformers'
    Conv1D keeps W as in x out), from its true (out, in) -- for a stack, its matrices';
    ``None``: from p's own shape (a stack's: its matrices', ``shampoo_step_``)."""
    if (group.get("shape_layout", "out_in") == "in_out"
            and p.ndim == group["matrix_batch_dims"] + 2):
        return mars_equations.shape_scale((p.shape[-1], p.shape[-2]))
    return None


def _lr_value(lr):
    """The lr as a number: a float, or a one-element CPU tensor as torch.optim.AdamW takes
    (``validation.tensor_scalar``: it is read on the host, so a CUDA tensor is refused)."""
    lr = tensor_scalar("lr", lr) if torch.is_tensor(lr) else lr
    _check_number("lr", lr, low=0.0)
    return lr


def _validate_group(g):
    _check_number("lr", g["lr"], low=0.0, tensor=True)  # a tensor's value: not when traced
    _check_number("eps", g["eps"], low=0.0)
    _check_number("weight_decay", g["weight_decay"], low=0.0)
    _check_number("gamma", g["gamma"], low=0.0, high=1.0)
    _check_number("lr_1d_factor", g["lr_1d_factor"], low=0.0)
    _check_number("weight_decay_1d", g["weight_decay_1d"], low=0.0)
    _check_betas("betas", g["betas"])
    _check_betas("betas_1d", g["betas_1d"])
    _check_choice("mars_type", g["mars_type"], MARS_TYPES)
    _check_choice("clip_scope", g["clip_scope"], CLIP_SCOPES)
    _check_choice("orthogonalizer", g["orthogonalizer"], ORTHOGONALIZERS)
    _check_choice("weight_decay_1d_source", g["weight_decay_1d_source"], WEIGHT_DECAY_1D_SOURCES)
    _check_choice("ns_dtype", g["ns_dtype"], NS_DTYPES)
    check_ns_coefficients(g["ns_coefficients"], g["orthogonalizer"], g["ns_dtype"])
    _check_choice("shape_layout", g["shape_layout"], SHAPE_LAYOUTS)
    _check_choice("orthogonalize_on", g["orthogonalize_on"], ORTHOGONALIZE_ON)
    check_matrix_batch_dims(g, mars_equations.matrix_batch_dims_of)
    state_storage.check_storage(g)  # state_dtype, state_rounding, rounding_seed, kahan_sum
    if g["compiled"] is True:  # the documented spelling of the per-tensor mode
        g["compiled"] = "tensor"
    if g["compiled"] not in (False, "tensor", "group"):
        raise ValueError(f"compiled: expected False, True/'tensor' or 'group', got {g['compiled']!r}")
    for flag in ("amsgrad", "is_approx", "optimize_1d", "maximize"):
        if not isinstance(g[flag], bool):
            raise ValueError(f"{flag}: expected a bool, got {g[flag]!r}")
    if g["amsgrad"] and (g["mars_type"] == "mars-lion" or
                         (g["mars_type"] == "mars-shampoo" and not g["optimize_1d"])):
        raise ValueError(f"amsgrad: {g['mars_type']} keeps no second moment on these tensors "
                         "(only the AdamW rule does: mars-adamw, or mars-shampoo's non-2-D "
                         "tensors with optimize_1d=True), so amsgrad=True would be ignored")
    _check_torch_flags("MARS", g)
    if g["foreach"] not in (None, True, False):
        raise ValueError(f"foreach: expected None, True or False, got {g['foreach']!r}")
    if isinstance(g["ns_steps"], bool) or not isinstance(g["ns_steps"], int) or g["ns_steps"] < 1:
        raise ValueError(f"ns_steps: expected an int >= 1, got {g['ns_steps']!r}")
