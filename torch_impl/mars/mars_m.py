"""``MARSM``: MARS on Muon (arXiv 2510.21800) as a torch.optim.Optimizer, and ``MARS_M`` /
``MARS_M_Efficient``, the same optimizer behind the authors' constructor keywords."""
import functools

import torch
from torch.optim import Optimizer

from . import exact_mode
from . import mars_equations
from . import mars_m_equations
from .functional import mars_m
from ..common import state_storage
from ..common.sharding import ORTHOGONALIZE_ON
from ..common.validation import (check_betas, check_choice, check_int, check_matrix_batch_dims,
                                 check_ns_coefficients, check_number, check_shared,
                                 check_torch_flags, host_value)

RULES = ("auto", "mars_m", "adamw")
SHAPE_LAYOUTS = ("out_in", "in_out")
NS_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
ORTHOGONALIZERS = ("newton_schulz", "gram_newton_schulz")
_ONE_MODE = "exact mode re-evaluates the whole model at x_{t-1}"


class MARSM(Optimizer):
    r"""MARS-M: the MARS correction on Muon's matrices, AdamW on everything else.

    .. math::
        \begin{aligned}
        &\textbf{matrices (rule "mars_m"), for } t = 1, 2, \dots: \\
        &\quad C_t = g_t + \tfrac{\gamma\beta}{1-\beta}\,(g_t - g_{\text{prev}})
            && \text{(M2; exact: } g_{\text{prev}} = \nabla f(x_{t-1}, \xi_t);\ 0 \text{ at } t=1
               \text{ and where the tensor had no gradient, as in MARS)} \\
        &\quad \tilde C_t = C_t / \max(1, \|C_t\|_F) && \text{(M3; } \texttt{clip\_c=False}: \tilde C_t = C_t) \\
        &\quad M_t = \beta M_{t-1} + (1-\beta)\,\tilde C_t && \text{(M15)} \\
        &\quad O_t = \mathrm{NS}_5(M_t) && \text{(M16; eps } 10^{-7}\text{, in ns\_dtype)} \\
        &\quad x_{t+1} = x_t (1 - \eta\lambda) - \eta\cdot 0.2\sqrt{\max(A,B)}\; O_t && \text{(M17)} \\
        &\textbf{efficient=True (M18, no clip, no } g_{t-1}\textbf{)}: \
            b_t = \beta b_{t-1} + \tfrac{(1-\gamma)(1-\beta)}{\beta} g_t,\ M_t = \gamma g_t + \beta b_t \\
        &\textbf{rule "adamw"}: m, v \text{ EMAs of } g, g^2 \text{ (adamw\_betas)},\
            x \leftarrow x(1-\eta\lambda) - \eta\tfrac{\sqrt{1-\beta_2^t}}{1-\beta_1^t}\,
            \frac{m}{\epsilon + \sqrt v} \\
        &\textbf{a stack } X \in \mathbb{R}^{E \times A \times B}
            \textbf{ (matrix\_batch\_dims} = 1\textbf{)}, \textbf{ each matrix } e: \
            \tilde C_{t,e} = C_{t,e} / \max(1, \|C_{t,e}\|_F),\
            x_{t+1,e} = x_{t,e}(1 - \eta\lambda) - \eta\cdot 0.2\sqrt{\max(A,B)}\,
            \mathrm{NS}_5(M_{t,e})
        \end{aligned}

    Args (the authors' names where torch has none: ``wd`` is ``weight_decay`` here):
        params: parameters or group dicts.  A group's ``rule`` picks its update: ``"mars_m"``
            (2-D matrices only; stacks of ndim k + 2 with ``matrix_batch_dims`` = k), ``"adamw"``,
            or ``"auto"`` (default: ``"mars_m"`` for 2-D tensors -- for stacks with k >= 1 --
            and ``"adamw"`` otherwise).  Put embeddings and the output head in an ``"adamw"``
            group, as the authors do.
        lr (float or tensor): :math:`\eta`, both rules. Default ``1e-3``.
        weight_decay (float): :math:`\lambda`, decoupled, both rules. Default ``0.1``.
        momentum (float or tensor): :math:`\beta`. Default ``0.95``.  ``lr``, ``momentum``
            and ``adamw_betas`` may be one-element CPU tensors, as AdamW's lr and betas:
            read on the host in an eager step, traced as data by ``torch.compile(opt.step)``
            (a schedule written into them with ``fill_`` never recompiles).
        ns_steps (int): Newton-Schulz steps. Default ``5``.
        gamma (float): :math:`\gamma`. Default ``0.025``.
        clip_c (bool): clip :math:`C_t` to norm 1.  Default ``True``: the authors' behaviour
            (their ``MARS_M`` clips whatever its ``clip_c`` says, spec B10).
        is_approx (bool): ``False``: exact correction, via ``step(closure)`` or the authors'
            ``update_previous_grad()`` / ``update_last_grad()`` loop. Default ``True``.
        adamw_betas (tuple), adamw_eps (float): the backup's. Defaults ``(0.9, 0.95)``, ``1e-8``.

    Keyword-only:
        efficient (bool): the ``MARS_M_Efficient`` recursion (M18): no ``last_grad`` buffer,
            no clip, approx mode only. Default ``False``.
        ns_dtype: Newton-Schulz dtype. Default ``torch.bfloat16`` (the authors').
        ns_coefficients: the (a_k, b_k, c_k) of each Newton-Schulz step (M13a): ``"authors"``
            (default: 3.4445, -4.7750, 2.0315 at every step), ``"polar_express"`` (Amsel et
            al.'s per-step minimax quintics), one triple (every step, as
            ``torch.optim.Muon``'s ``ns_coefficients``) or a sequence of triples (step k takes
            the k-th, the last repeats).
        orthogonalizer: ``"newton_schulz"`` (default) or ``"gram_newton_schulz"`` (M13b): the
            same iteration on the n x n Gram matrix of a rectangular matrix, two rectangular
            products per restart block instead of two per step; nearly square matrices
            (aspect <= 1.5) keep the standard one.  Not with ``ns_dtype=torch.float16``.
            In bf16 its n x n products round too, so it lands farther from U V^T than the
            standard form and trains worse with the authors' coefficients: pair it with
            ``ns_coefficients="polar_express"`` (figure 10; ``paper_notes/orthogonalisation.md``).
        shape_layout: ``"out_in"`` or ``"in_out"`` (transformers' ``Conv1D``): the scale
            0.2 sqrt(max(A, B)) is symmetric, so this only documents the layout; kept for
            symmetry with ``MARS``.
        matrix_batch_dims (int): how many leading dims of a tensor index independent matrices,
            per group (fused MoE experts: transformers' ``MixtralExperts.gate_up_proj`` (E, 2I,
            H) and ``down_proj`` (E, H, I) take ``matrix_batch_dims=1``). Default ``0``: a
            3-D tensor is never taken for a stack (a Conv1d kernel is not one): ``"auto"``
            gives it the AdamW rule and ``"mars_m"`` refuses it. With k >= 1 every matrix of a
            stack (ndim k + 2) is updated exactly as a separate 2-D parameter would be: C_t
            clipped to its own norm (M15), NS5 normalised by its own norm (M16), the step
            scaled by 0.2 sqrt(max(A, B)) of its own (A, B) (M17). Under ``"auto"`` tensors of
            ndim < 2 take the AdamW rule and any other shape is refused; under ``"mars_m"``
            every tensor must be a stack (ValueErrors name ``matrix_batch_dims``); ``"adamw"``
            is elementwise and ignores it. Under FSDP2 a stack sharded on its leading dims
            (``Shard(0)``) is clipped and orthogonalised on each rank's own matrices, with no
            communication, whatever ``orthogonalize_on`` says.
        orthogonalize_on: where a sharded (FSDP2 / DTensor) matrix is orthogonalised:
            ``"owner"`` (default: each matrix once, on one owner rank chosen by greedy
            longest-first on its Newton-Schulz flops; two ``all_to_all`` per step and group)
            or ``"every_rank"`` (all-gather each matrix; every rank runs every one). Same
            result; plain tensors are unaffected; ``compiled=True`` keeps ``"every_rank"``.
        state_dtype, state_rounding, rounding_seed, kahan_sum: the state's storage, as
            ``MARS``'s (``common/state_storage.py``): ``momentum_buffer``, ``last_grad``,
            ``moment1``, ``moment2`` stored in ``state_dtype`` (default ``None``: the
            parameter's dtype), a step computing in the wider dtype (float32 at least with
            ``state_rounding="stochastic"``), each narrower write :math:`\mathrm{SR}(w)`
            (LP1) from the stream ``stream_seed(rounding_seed, group index, position,
            name_word(key), t)`` (LP2) or RN(w) (``"nearest"``, default), and 16-bit
            parameters with ``kahan_sum`` stepping from x = p + c (LP3: p = RN(x),
            c = RN(x - p), c in ``kahan_comp``).
        state_quantization (None or ``"blockwise8"``), block_size (int, default 256): LP4 as
            ``MARS``'s: ``momentum_buffer`` and ``moment1`` (signed map), ``moment2``
            (unsigned) held as ``<name>_codes`` / ``<name>_absmax``, dequantized into the
            step's float32 working copy and quantized back; ``last_grad`` keeps
            ``state_dtype``.
        maximize (bool), foreach (bool or None): as in ``torch.optim``.
        compiled (bool): one ``torch.compile``d call per shape (``mars_m_compiled.py``; the
            same equation functions), fusing the corrections with one batched Newton-Schulz
            and the updates.  Eager steps batch the Newton-Schulz of same-shape matrices too.
        fused (None or False), capturable (False), differentiable (False): accepted and stored
            in every group, as other ``torch.optim`` optimizers take them; ``True`` raises a
            ValueError naming the keyword, in the constructor and in any group dict.

    ``torch.compile(opt.step)`` traces the step (``_init_group`` follows torch's protocol).
    A step checks every group's hyperparameters (as the constructor does: they may have been
    written since) and gradients (sparse, complex) before it changes anything.

    State: matrices ``step``, ``momentum_buffer``, ``last_grad`` (not with ``efficient``),
    ``prev_param`` (closure exact mode) or ``previous_grad`` (the authors' exact loop); the
    backup ``step``, ``moment1``, ``moment2`` -- the authors' names; ``kahan_comp`` with
    ``kahan_sum`` (16-bit parameters); ``<name>_codes`` and ``<name>_absmax`` for a buffer
    held in 8 bits.  ``init_state()`` creates
    them up front (counters at 0), so that torchtitan's and DCP's zero-gradient init step,
    which would advance the counters, does nothing.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> opt = MARSM(model.parameters(), lr=1e-3)   # 2-D weights: MARS-M; biases: AdamW
        >>> model(torch.ones(3, 4)).square().mean().backward()
        >>> opt.step()
    """

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, ns_steps=5,
                 gamma=0.025, clip_c=True, is_approx=True, adamw_betas=(0.9, 0.95),
                 adamw_eps=1e-8, *, rule="auto", efficient=False, ns_dtype=torch.bfloat16,
                 ns_coefficients="authors", orthogonalizer="newton_schulz", shape_layout="out_in",
                 state_dtype=None, state_rounding="nearest", rounding_seed=None,
                 kahan_sum=False, state_quantization=None, block_size=256,
                 maximize=False, foreach=None, compiled=False,
                 orthogonalize_on="owner", matrix_batch_dims=0, fused=None, capturable=False,
                 differentiable=False):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, ns_steps=ns_steps,
                        gamma=gamma, clip_c=clip_c, is_approx=is_approx, adamw_betas=adamw_betas,
                        adamw_eps=adamw_eps, rule=rule, efficient=efficient, ns_dtype=ns_dtype,
                        ns_coefficients=ns_coefficients, orthogonalizer=orthogonalizer,
                        shape_layout=shape_layout, state_dtype=state_dtype,
                        state_rounding=state_rounding, rounding_seed=rounding_seed,
                        kahan_sum=kahan_sum, state_quantization=state_quantization,
                        block_size=block_size, maximize=maximize, foreach=foreach,
                        compiled=compiled, orthogonalize_on=orthogonalize_on,
                        matrix_batch_dims=matrix_batch_dims, fused=fused,
                        capturable=capturable,
                        differentiable=differentiable)
        check_torch_flags("MARSM", defaults)  # every group is checked again (add_param_group)
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        try:
            _validate_group(self.param_groups[-1])
            check_shared("is_approx", self.param_groups, _ONE_MODE)
        except ValueError:
            self.param_groups.pop()
            raise
        state_storage.resolve_rounding_seed(self, self.param_groups[-1])

    def _check_groups(self):
        """Every group's hyperparameters, before the first group changes
        (``MARS._check_groups`` says why)."""
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
        _tensor_steps(self.state)

    def load_state_dict(self, state_dict):
        """``Optimizer.load_state_dict`` keeping ``state_dtype`` (as ``MARS``'s)."""
        state_storage.load_state_dict_keeping_storage(self, super().load_state_dict,
                                                      state_dict)
        _tensor_steps(self.state)  # the authors' checkpoints keep a Python int

    @property
    def gamma(self):
        """The first group's gamma (the authors' loop reads ``optimizer.gamma``)."""
        return self.param_groups[0]["gamma"]

    @torch.no_grad()
    def step(self, closure=None):
        """One step; returns the closure's loss.  Exact mode needs ``closure`` (evaluated at
        x_{t-1} and at x_t on the same batch) unless the authors' loop feeds ``last_grad``."""
        self._check_groups()  # every group's, before exact mode moves to x_{t-1}
        exact = not self.param_groups[0]["is_approx"]
        if exact and closure is None and exact_mode.uses_authors_api(self):
            loss = None
            exact_mode.warn_if_scaled_previous_grad(self)
        elif exact:
            if closure is None:
                raise RuntimeError(
                    "MARSM exact mode (is_approx=False) needs grad f(x_{t-1}, xi_t): call "
                    "opt.step(closure) with a closure that computes the loss on the current "
                    "batch and calls backward(), or use the authors' update_previous_grad() / "
                    "update_last_grad() loop; or construct MARSM(..., is_approx=True)")
            loss = exact_mode.evaluate_at_previous_then_current(self, closure)
        else:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
        self._check_gradients()  # every group's, before the first group changes
        exact_mode.forget_missing_gradients(self)  # (M2): no gradient at t-1 is g_{t-1} = 0
        for index, group in enumerate(self.param_groups):
            params, grads, bufs, lasts, m1, m2, steps, kinds = [], [], [], [], [], [], [], []
            self._init_group(group, params, grads, bufs, lasts, m1, m2, steps, kinds)
            back = state_storage.WriteBack(group, index)  # working copies: compute dtype
            states = [self.state[p] for p in params]
            bufs, lasts, m1, m2 = (back.column(name, c, params, states) for name, c in (
                ("momentum_buffer", bufs), ("last_grad", lasts), ("moment1", m1),
                ("moment2", m2)))
            params, grads = back.params(params, states), back.read(grads, params)
            mars_m(params, grads, bufs, lasts, m1, m2, steps, kinds,
                   lr=group["lr"], weight_decay=group["weight_decay"],
                   momentum=group["momentum"], gamma=group["gamma"],
                   ns_steps=group["ns_steps"], ns_dtype=group["ns_dtype"],
                   ns_coefficients=group["ns_coefficients"],
                   orthogonalizer=group["orthogonalizer"], clip_c=group["clip_c"], adamw_betas=group["adamw_betas"],
                   adamw_eps=group["adamw_eps"], maximize=group["maximize"],
                   foreach=group["foreach"], compiled=group["compiled"],
                   orthogonalize_on=group["orthogonalize_on"], write_last_grad=not exact,
                   matrix_batch_dims=group["matrix_batch_dims"])
            back.finish()  # each copy rounded back into its stored tensor
        return loss

    def _check_gradients(self):
        """Reject unsupported gradients before any state changes, so a bad step loses nothing
        (the hyperparameters, ``matrix_batch_dims`` against the shapes included, are
        ``_check_groups``'s, before)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError("MARSM does not support sparse gradients")
                if p.grad is not None and torch.is_complex(p):
                    raise RuntimeError("MARSM does not support complex parameters")

    def update_previous_grad(self, *, grad_scaler=None):
        """The authors' exact loop: ``previous_grad`` <- ``.grad`` of the matrices (MARS-M
        with ``last_grad``), computed on the *next* batch at the current point.
        ``grad_scaler``: the ``torch.amp.GradScaler`` of a mixed-precision loop, whose scale
        the stored gradient is divided by (a non-finite one is stored as 0); see
        ``MARS.update_previous_grad`` for the loop and the reasons."""
        exact_mode.update_previous_grad(
            self, lambda p, group: _kind(p, group) == mars_m_equations.MATRIX,
            grad_scaler=grad_scaler)

    def update_last_grad(self):
        """The authors' exact loop, after ``step``: ``last_grad`` <- ``previous_grad``."""
        exact_mode.update_last_grad(self)

    @property
    def _step_supports_amp_scaling(self):
        """Read by ``GradScaler.step`` before it calls ``step()`` (see ``MARS``)."""
        exact_mode.note_grad_scaler(self)
        return False

    def _init_group(self, group, params, grads, bufs, lasts, m1, m2, steps, kinds):
        """Append the group's live tensors to the given lists, creating state lazily
        (torch.optim's protocol, run eagerly at trace time under ``torch.compile``)."""
        live = [p for p in group["params"] if p.grad is not None]
        for p, kind, st in self._create_state(group, live):
            params.append(p)
            grads.append(p.grad)
            bufs.append(state_storage.buffer(st, "momentum_buffer"))
            lasts.append(st.get("last_grad"))
            m1.append(state_storage.buffer(st, "moment1"))
            m2.append(state_storage.buffer(st, "moment2"))
            steps.append(st["step"])
            kinds.append(kind)


    def _create_state(self, group, params):
        """For each tensor of ``params`` (in ``group``), create the state its rule needs where
        it is missing (zeros like the tensor; ``step`` a CPU ``torch.tensor(0.0)``) and yield
        (p, kind, state).  Shared by ``_init_group`` (a step) and ``init_state``."""
        for p in params:
            kind, st = _kind(p, group), self.state[p]
            names = {mars_m_equations.MATRIX: ("momentum_buffer", "last_grad"),
                     mars_m_equations.EFFICIENT: ("momentum_buffer",),
                     mars_m_equations.BACKUP: ("moment1", "moment2")}[kind]
            state_storage.ensure_state(st, p, group, names)  # and kahan_comp
            if "step" not in st:
                st["step"] = torch.tensor(0.0)
            yield p, kind, st

    @torch.no_grad()
    def init_state(self):
        """Create now the state the first ``step()`` would create, before its update: for
        every parameter of every group that requires a gradient and has no state yet,
        ``momentum_buffer`` and ``last_grad`` (matrices; ``momentum_buffer`` alone with
        ``efficient``) or ``moment1`` and ``moment2`` (the AdamW rule), zeros like the
        parameter (``zeros_like``: a DTensor parameter gets DTensor state), and ``step`` = 0
        (a CPU tensor).

        Why: torchtitan (``init_optim_state``) and DCP (``get_state_dict`` /
        ``set_state_dict`` through ``_init_optim_state``) materialise an empty optimizer
        state by running one ``step()`` with zero gradients and ``lr = 0``; that step
        advances ``step`` to 1, so the AdamW rule's first real step takes t = 2 in its bias
        corrections (and in exact mode, without a closure, it raises).  After
        ``init_state()`` the state is not empty and their init step returns at once: the run
        is the one without it, bit for bit.

        Parameters, gradients and hyperparameters are not touched; nothing is read on the
        host.  A parameter that already has state keeps it, so a second call changes
        nothing; one with ``requires_grad=False`` gets none; one that never gets a gradient
        keeps its zero state, and a step without its gradient skips it as always.  Exact
        mode's ``prev_param`` is created as zeros, x_{t-1} once the tensor has taken a step,
        so checkpoint templates carry it; ``previous_grad`` is left to the authors' loop
        (see ``MARS.init_state``)."""
        for group in self.param_groups:
            fresh = [p for p in group["params"] if p.requires_grad and not self.state.get(p)]
            for _ in self._create_state(group, fresh):
                pass
            exact_mode.init_previous_iterates(self, fresh)


def _kind(p, group):
    rule = group["rule"]
    if rule == "auto":  # a matrix, or a declared stack of them (never a guessed one)
        stacked = mars_equations.matrix_batch_dims_of(p.shape, group["matrix_batch_dims"])
        rule = "mars_m" if p.ndim - stacked == 2 else "adamw"
    if rule == "adamw":
        return mars_m_equations.BACKUP
    return mars_m_equations.EFFICIENT if group["efficient"] else mars_m_equations.MATRIX


def _tensor_steps(state):
    """A numeric ``step`` (older torch, the authors' backup) becomes a CPU float tensor."""
    for st in state.values():
        if "step" in st and not torch.is_tensor(st["step"]):
            st["step"] = torch.tensor(float(st["step"]))


def _validate_group(g):
    check_number("lr", g["lr"], low=0.0, tensor=True)  # tensors as AdamW takes them
    check_number("weight_decay", g["weight_decay"], low=0.0)
    check_number("momentum", g["momentum"], low=0.0, high=1.0, high_open=True, tensor=True)
    if g["efficient"] and host_value("momentum", g["momentum"]) == 0.0:  # (traced: None)
        # a = gamma beta/(1 - beta) is fine at 0; M18 divides by beta
        raise ValueError("momentum: the efficient recursion (M18) divides by momentum > 0")
    check_number("gamma", g["gamma"], low=0.0, high=1.0)
    check_number("adamw_eps", g["adamw_eps"], low=0.0)
    check_betas("adamw_betas", g["adamw_betas"])
    check_choice("rule", g["rule"], RULES)
    check_choice("ns_dtype", g["ns_dtype"], NS_DTYPES)
    check_choice("orthogonalizer", g["orthogonalizer"], ORTHOGONALIZERS)
    check_ns_coefficients(g["ns_coefficients"], g["orthogonalizer"], g["ns_dtype"])
    check_choice("shape_layout", g["shape_layout"], SHAPE_LAYOUTS)
    check_choice("orthogonalize_on", g["orthogonalize_on"], ORTHOGONALIZE_ON)
    for flag in ("clip_c", "is_approx", "efficient", "maximize"):
        if not isinstance(g[flag], bool):
            raise ValueError(f"{flag}: expected a bool, got {g[flag]!r}")
    if g["foreach"] not in (None, True, False):
        raise ValueError(f"foreach: expected None, True or False, got {g['foreach']!r}")
    if not isinstance(g["compiled"], bool):
        raise ValueError(f"compiled: expected a bool, got {g['compiled']!r}")
    check_torch_flags("MARSM", g)
    state_storage.check_storage(g)  # state_dtype, state_rounding, rounding_seed, kahan_sum
    if isinstance(g["ns_steps"], bool) or not isinstance(g["ns_steps"], int) or g["ns_steps"] < 1:
        raise ValueError(f"ns_steps: expected an int >= 1, got {g['ns_steps']!r}")
    if g["efficient"] and not g["is_approx"]:
        raise ValueError("efficient: the efficient recursion (M18) keeps no g_{t-1}, so it has "
                         "no exact mode; use is_approx=True or efficient=False")
    if g["rule"] == "auto":  # the value, then every tensor a stack or routed by its shape
        check_matrix_batch_dims(g, mars_equations.matrix_batch_dims_of)
    else:
        check_int("matrix_batch_dims", g["matrix_batch_dims"], low=0)
    matrix_batch_dims = g["matrix_batch_dims"]
    if g["rule"] == "mars_m":
        bad = [tuple(p.shape) for p in g["params"] if p.ndim != matrix_batch_dims + 2]
        if bad and matrix_batch_dims == 0:
            raise ValueError(f"rule: 'mars_m' orthogonalizes matrices; got shapes {bad} "
                             "(give them rule='adamw', or reshape them, or declare a stack of "
                             "matrices with matrix_batch_dims)")
        if bad:
            raise ValueError(f"rule: 'mars_m' with matrix_batch_dims={matrix_batch_dims} "
                             f"orthogonalizes stacks of matrices of ndim "
                             f"{matrix_batch_dims + 2}; got shapes {bad} (give them a group "
                             "of their own)")


class MARS_M(MARSM):  # noqa: N801  (the authors' class name, for a one-line import change)
    """``MARSM`` behind the authors' constructor: ``MARS_M(lr, wd, muon_params, momentum,
    ns_steps, adamw_params, adamw_betas, adamw_eps, gamma, clip_c, is_approx)``.

    ``muon_params`` form a ``rule="mars_m"`` group and ``adamw_params`` a ``rule="adamw"``
    group.  ``clip_c`` is accepted and, by default, ignored as the authors' class ignores it
    (C_t is always clipped); pass ``honor_clip_c=True`` to make ``clip_c=False`` switch the
    clip off.  Further keyword-only options are ``MARSM``'s.
    """

    def __init__(self, lr=1e-3, wd=0.1, muon_params=None, momentum=0.95, ns_steps=5,
                 adamw_params=None, adamw_betas=(0.9, 0.95), adamw_eps=1e-8, gamma=0.025,
                 clip_c=False, is_approx=True, *, honor_clip_c=False, efficient=False, **options):
        if muon_params is None:
            raise ValueError("muon_params: the authors' MARS_M needs the matrices to optimize")
        groups = [dict(params=list(muon_params), rule="mars_m")]
        adamw_params = list(adamw_params) if adamw_params is not None else []
        if adamw_params:
            groups.append(dict(params=adamw_params, rule="adamw"))
        super().__init__(groups, lr=lr, weight_decay=wd, momentum=momentum, ns_steps=ns_steps,
                         gamma=gamma, clip_c=bool(clip_c) if honor_clip_c else True,
                         is_approx=is_approx, adamw_betas=adamw_betas, adamw_eps=adamw_eps,
                         efficient=efficient, **options)


class MARS_M_Efficient(MARS_M):  # noqa: N801
    """The authors' ``MARS_M_Efficient(lr, wd, muon_params, momentum, ns_steps, adamw_params,
    adamw_betas, adamw_eps, gamma)``: ``MARS_M`` with ``efficient=True`` (M18), its defaults
    ``MARS_M``'s."""

    __init__ = functools.partialmethod(MARS_M.__init__, efficient=True)
