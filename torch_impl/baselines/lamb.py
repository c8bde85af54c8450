r"""LAMB (You et al., ICLR 2020) as a ``torch.optim.Optimizer``: MKOR's BERT backbone.

.. math::
    \begin{aligned}
    m_k &= \beta_1 m_{k-1} + (1-\beta_1) g_k, \qquad
    v_k = \beta_2 v_{k-1} + (1-\beta_2) g_k^2 \\
    r_k &= \frac{m_k / (1-\beta_1^k)}{\sqrt{v_k / (1-\beta_2^k)} + \epsilon} + \lambda p_{k-1} \\
    \phi &= \|p_{k-1}\| / \|r_k\| \ (1 \text{ when either norm is } 0), \qquad
    p_k = p_{k-1} - \eta\, \phi\, r_k
    \end{aligned}

per parameter tensor (the identity trust function), exactly as
``reference.common.first_order.lamb``. The trust ratio uses ``torch.where``, so a step never
synchronises with the host.

torch.optim conventions (as ``torch.optim.AdamW``):

* A **complex** parameter is its real view (``torch.view_as_real`` of the parameter, its
  gradient and its state), so g^2 is |g|^2 per real component and the trust-ratio norms,
  taken over the real view, are the complex norms.
* ``maximize=True`` ascends: the step uses -g.
* ``foreach``: True runs one ``torch._foreach_*`` kernel per operation over a group's
  tensors (per device, dtype and DTensor mesh: ``tensor_ops.foreach_groups``), with the same
  operations in the same order as the per-tensor loop: bit-identical to it on the CPU in
  float64, float32, bf16 and fp16 (``theory_tests/mars/test_low_precision_paths.py``; a
  number multiplies through ``tensor_ops.scalar_operand``, since torch's CPU
  ``_foreach_mul_`` would round it to bf16 / fp16 first); False the loop; None (default)
  chooses like torch: foreach when every parameter is a CUDA tensor, the loop otherwise (the
  CPU gains nothing from foreach).
* ``state_dtype``, ``state_rounding``, ``rounding_seed``, ``kahan_sum``: the state's
  storage, as MARS's (``common/state_storage.py``): m and v stored in ``state_dtype``
  (``None``: the parameter's dtype), the step computed in the wider dtype (float32 at least
  with ``state_rounding="stochastic"``), each narrower write rounded to nearest or, with
  ``"stochastic"``, by LP1, :math:`\mathrm{SR}(w) = hi` if :math:`u < (w - lo)/(hi - lo)`
  else :math:`lo`, u from the stream ``stream_seed(rounding_seed, group index, position,
  name_word(key), k)`` (LP2; a 16-bit parameter's key is ``"param"``); with ``kahan_sum`` a
  16-bit parameter steps from x = p + c in float32, p <- RN(x), c <- RN(x - p) (LP3, c in
  ``kahan_comp``).  Complex parameters take none of them (their state is complex).
* ``fused``, ``capturable``, ``differentiable`` are accepted and stored like torch's, but
  only off (``fused=None``/``False``, ``capturable=False``, ``differentiable=False``): this
  LAMB has no fused kernel, reads its step count on the host and is not differentiable, so
  True raises ``ValueError`` naming the keyword.

Every hyperparameter is validated in the constructor and in each param-group dict (the
initial groups and :meth:`add_param_group`), with a ``ValueError`` naming it, and again, in
every group, at the start of each step (the groups are read at each step, and may have been
written since), so that a refused step changes no parameter, state or step counter of any
group. A sparse gradient is refused (``RuntimeError``) before any parameter or state changes.
"""
import torch

from ..common import state_storage
from ..common.scalars import step_scalar
from ..common.tensor_ops import foreach_groups, scalar_operand
from ..common.validation import check_betas, check_choice, check_number, check_torch_flags

__all__ = ["LAMB"]

# keyword -> value a group gets when neither the group nor the constructor gives one
# (also what an older state_dict without the keyword loads as)
_OPTION_DEFAULTS = {"maximize": False, "foreach": None, "capturable": False,
                    "differentiable": False, "fused": None}
# a state_dict from before these keywords loads with the constructor's
_STORAGE_OPTIONS = ("state_dtype", "state_rounding", "rounding_seed", "kahan_sum")


def _check_group(group):
    """ValueError naming the first invalid hyperparameter of ``group`` (a dict)."""
    check_number("lr", group["lr"], low=0.0, tensor=True)  # lr, betas: tensors as in AdamW
    check_betas("betas", group["betas"])
    check_number("eps", group["eps"], low=0.0)
    check_number("weight_decay", group["weight_decay"], low=0.0)
    check_choice("maximize", group["maximize"], (False, True))
    check_choice("foreach", group["foreach"], (None, False, True))
    check_torch_flags("LAMB", group)


def _real(t):
    """The real view of a complex tensor (torch.optim's convention); others as they are."""
    return torch.view_as_real(t) if torch.is_complex(t) else t


def _trust(p_norm, r_norm):
    """||p|| / ||r||, 1 when either is 0 (elementwise over stacked norms too; sync-free)."""
    usable = (p_norm > 0) & (r_norm > 0)
    return torch.where(usable, p_norm / torch.where(usable, r_norm, 1.0), 1.0)


def _lamb_loop(params, grads, ms, vs, steps, group):
    """One LAMB step of ``group``, tensor by tensor (real views; ``steps`` already advanced)."""
    beta1, beta2 = group["betas"]
    for p, g, m, v, k in zip(params, grads, ms, vs, steps):
        if group["maximize"]:
            g = -g
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        r = (m / (1 - beta1 ** k)) / ((v / (1 - beta2 ** k)).sqrt() + group["eps"])
        if group["weight_decay"] != 0:
            r = r.add(p, alpha=group["weight_decay"])
        trust = _trust(torch.linalg.vector_norm(p), torch.linalg.vector_norm(r))
        p.sub_(group["lr"] * trust * r)


def _lamb_foreach(params, grads, ms, vs, steps, group):
    """The same step as :func:`_lamb_loop` with ``torch._foreach_*`` kernels, per
    ``tensor_ops.foreach_groups`` group (device, dtype, DTensor mesh: the norms of a group
    are stacked for one trust-ratio computation, which a DTensor can do on one mesh only)."""
    beta1, beta2 = group["betas"]
    eps, weight_decay, lr = group["eps"], group["weight_decay"], group["lr"]
    for idx in foreach_groups(params):
        ps = [params[i] for i in idx]
        gs = [grads[i] for i in idx]
        ms_, vs_ = [ms[i] for i in idx], [vs[i] for i in idx]
        if group["maximize"]:
            gs = torch._foreach_neg(gs)
        torch._foreach_mul_(ms_, scalar_operand(beta1))  # as m.mul_(beta1) rounds
        torch._foreach_add_(ms_, gs, alpha=1 - beta1)
        torch._foreach_mul_(vs_, scalar_operand(beta2))
        torch._foreach_addcmul_(vs_, gs, gs, value=1 - beta2)
        m_hat = torch._foreach_div(ms_, [1 - beta1 ** steps[i] for i in idx])
        denom = torch._foreach_div(vs_, [1 - beta2 ** steps[i] for i in idx])
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, eps)
        rs = torch._foreach_div(m_hat, denom)
        if weight_decay != 0:
            torch._foreach_add_(rs, ps, alpha=weight_decay)
        trust = _trust(torch.stack(torch._foreach_norm(ps)), torch.stack(torch._foreach_norm(rs)))
        torch._foreach_mul_(rs, (lr * trust).unbind(0))
        torch._foreach_sub_(ps, rs)


class LAMB(torch.optim.Optimizer):
    """LAMB.

    Args:
        params: iterable of parameters or param-group dicts.
        lr: learning rate eta (>= 0). betas: (beta1, beta2), each in [0, 1). Each may be a
            one-element CPU tensor, as ``torch.optim.AdamW`` takes them: read on the host in
            an eager step, traced as data by ``torch.compile(opt.step)``, so a scheduler that
            writes into them (``fill_``) never recompiles the step.
        eps: added to sqrt(v_hat) (>= 0). weight_decay: lambda (>= 0), inside the
            trust-ratio update as in the LAMB paper.
        state_dtype, state_rounding, rounding_seed, kahan_sum: the state's storage
            (module docstring; defaults ``None``, ``"nearest"``, ``None``, ``False``).
        maximize: ascend the objective (default False).
        foreach: None (default; foreach on CUDA, the loop otherwise), True or False
            (module docstring).
        capturable, differentiable, fused: only their off values (False, False, None /
            False) are supported; stored in the groups like torch's.

    ``init_state()`` creates the first step's state up front (``step`` = 0), so that
    torchtitan's and DCP's zero-gradient init step, which would advance it, does nothing.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, *,
                 state_dtype=None, state_rounding="nearest", rounding_seed=None,
                 kahan_sum=False, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        state_dtype=state_dtype, state_rounding=state_rounding,
                        rounding_seed=rounding_seed, kahan_sum=kahan_sum,
                        maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused)
        _check_group(defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        """torch's ``add_param_group``, after validating the group's hyperparameters (its
        own, or the constructor's it falls back to)."""
        if isinstance(param_group, dict):
            _check_group({**self.defaults, **param_group})
        super().add_param_group(param_group)
        try:  # the storage options against the group's parameters, once torch listed them
            state_storage.check_storage(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise
        state_storage.resolve_rounding_seed(self, self.param_groups[-1])

    def load_state_dict(self, state_dict):
        """``Optimizer.load_state_dict`` keeping ``state_dtype`` (torch would cast the state to
        the parameter's dtype; ``state_storage.load_state_dict_keeping_storage``)."""
        state_storage.load_state_dict_keeping_storage(self, super().load_state_dict,
                                                      state_dict)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:  # a state_dict saved before these keywords existed
            for key, value in _OPTION_DEFAULTS.items():
                group.setdefault(key, value)
            for key in _STORAGE_OPTIONS:  # the constructor's (as MARS back-fills them)
                group.setdefault(key, self.defaults[key])

    @staticmethod
    def _use_foreach(group, params):
        if group["foreach"] is not None:
            return group["foreach"]
        return all(type(p) in (torch.Tensor, torch.nn.Parameter) and p.is_cuda for p in params)

    def _init_group(self, group, params, grads, ms, vs, counters):
        """Append the group's live tensors (real views) and step counters to the given lists,
        creating state lazily: torch.optim's protocol, which ``torch.compile`` runs eagerly
        at trace time (so the first step's state creation is not a graph of its own)."""
        for p, state in self._create_state(group, [p for p in group["params"]
                                                   if p.grad is not None]):
            params.append(_real(p))
            grads.append(_real(p.grad))
            ms.append(_real(state["exp_avg"]))
            vs.append(_real(state["exp_avg_sq"]))
            counters.append(state["step"])

    def _create_state(self, group, params):
        """Yield (p, state) for each of ``params``, creating an empty state first: ``step`` = 0
        (a float32 CPU tensor), ``exp_avg`` and ``exp_avg_sq`` zeros like ``p`` in the group's
        ``state_dtype`` (cast when it changed since), ``kahan_comp`` with ``kahan_sum``.
        Shared by ``_init_group`` (a step) and ``init_state``."""
        for p in params:
            state = self.state[p]
            if "step" not in state:
                # The step count lives on the CPU (as in torch.optim): no device sync.
                state["step"] = torch.zeros((), dtype=torch.float32)
            state_storage.ensure_state(state, p, group, ("exp_avg", "exp_avg_sq"))
            yield p, state

    @torch.no_grad()
    def init_state(self):
        """Create now the state the first ``step()`` would create, before its update, for
        every parameter of every group that requires a gradient and has no state yet:
        ``step`` = 0 (float32, CPU), ``exp_avg`` and ``exp_avg_sq`` zeros like the parameter
        (``zeros_like``: a DTensor parameter gets DTensor state).

        Why: torchtitan (``init_optim_state``) and DCP (``get_state_dict`` /
        ``set_state_dict`` through ``_init_optim_state``) materialise an empty optimizer
        state by running one ``step()`` with zero gradients and ``lr = 0``; that step
        advances ``step`` to 1, so the first real step takes k = 2 in its bias corrections.
        After ``init_state()`` the state is not empty and their init step returns at once:
        the run is the one without it, bit for bit.

        Parameters and gradients are not touched; nothing is read on the host.  A parameter
        that already has state keeps it (a second call changes nothing); one with
        ``requires_grad=False`` gets none; one that never gets a gradient keeps its zero
        state, and a step without its gradient skips it as always."""
        for group in self.param_groups:
            for _ in self._create_state(group, [p for p in group["params"]
                                                if p.requires_grad and not self.state.get(p)]):
                pass

    def _check_groups(self):
        """Every group's hyperparameters, as the constructor checks them: they are read from
        the groups at each step (a scheduler, or a user, may have written any of them since),
        and a refusal must come before the first group changes -- so that a step that raises
        leaves every parameter, state entry and step counter as it was."""
        for group in self.param_groups:
            _check_group(group)
            state_storage.check_storage(group)
            state_storage.resolve_rounding_seed(self, group)

    @torch.no_grad()
    def step(self, closure=None):
        self._check_groups()  # every group's, before any group changes
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:  # refuse before changing anything, in any group
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError("LAMB does not support sparse gradients")
        compiling = torch.compiler.is_compiling()
        for index, group in enumerate(self.param_groups):
            params, grads, ms, vs, counters = [], [], [], [], []
            self._init_group(group, params, grads, ms, vs, counters)
            for k in counters:
                k += 1
            # working copies in each tensor's compute dtype (real tensors only: the storage
            # options refuse complex ones), rounded back after the update
            back = state_storage.WriteBack(group, index)
            states = [self.state[p] for p in group["params"] if p.grad is not None]
            ms = back.column("exp_avg", ms, params, states)
            vs = back.column("exp_avg_sq", vs, params, states)
            grads = back.read(grads, params)
            params = back.params(params, states)
            # a host read of a CPU counter; traced by torch.compile, the counter itself
            steps = counters if compiling else [int(k.item()) for k in counters]
            if not params:
                continue
            # torch.compile(opt.step): Inductor fuses the traced loop itself (as MARS)
            use_foreach = not compiling and self._use_foreach(group, group["params"])
            run = _lamb_foreach if use_foreach else _lamb_loop
            # lr and betas may be tensors (as AdamW's): numbers here, or traced tensors, so
            # that a scheduler writing into them is new data, never a recompilation
            run(params, grads, ms, vs, steps,
                dict(group, lr=step_scalar(group["lr"]),
                     betas=tuple(step_scalar(b) for b in group["betas"])))
            back.finish()
        return loss
