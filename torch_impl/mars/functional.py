"""Functional forms of the optimizers, in the manner of ``torch.optim``'s functional API.

``mars(...)`` and ``mars_m(...)`` take parallel lists (parameters, gradients, state tensors,
CPU step counters, routes) and every hyperparameter as a keyword; they update everything in
place.  The ``Optimizer`` classes only gather those lists from their groups and call these.
Each dispatches to a single-tensor loop, the multi-tensor (foreach) kernels or the compiled
kernels; all three run the same equation functions (``mars_equations``, ``mars_m_equations``).

Sharded matrices (FSDP2 ``DTensor``): ``orthogonalize_on="owner"`` (default) runs each
Newton-Schulz / SVD of a call once, on an owner rank, all of them in one exchange per call
(``common.sharding.orthogonalize_on_owners``); ``"every_rank"`` all-gathers each matrix on
every rank and runs every orthogonalisation everywhere (``sharding.on_full_matrix``). Both
give the same numbers; plain tensors are unaffected. The compiled MARS-M kernels
(``compiled=True``) fuse Newton-Schulz into each matrix's kernel and keep ``"every_rank"``.
A stack of matrices sharded on its leading dims only (FSDP2's ``Shard(0)`` of fused experts;
torchtitan's expert-parallel ``(_StridedShard(0), Shard(0))``) is orthogonalised on each rank's
own whole matrices in either mode, with no communication (``sharding.on_local_matrices``).

``matrix_batch_dims`` = k (both functions; issue 31): a tensor of ndim k + 2 is a stack of
matrices whose k leading dims index them; each is clipped, scaled by its own shape and
orthogonalised as a 2-D parameter would be (``mars_equations.matrix_batch_dims_of``).
"""
import functools

import torch

from . import mars_compiled
from . import mars_m_compiled
from . import mars_equations
from . import mars_m_equations
from .mars_m_equations import (BACKUP, EFFICIENT, MATRIX, backup_adamw_step_,
                                efficient_argument, efficient_buffer_, mars_m_direction,
                                mars_m_momentum_, mars_m_step_, match_rms_scale)
from ..common.sharding import (ORTHOGONALIZE_ON, is_dtensor, orthogonalize_by_shape,
                               orthogonalize_on_owners)
from ..common.tensor_ops import FOREACH, SINGLE
from ..common.validation import check_choice, check_int
from .functional_checks import check_lists

__all__ = ["mars", "mars_m", "corrected_norms", "default_foreach"]


def default_foreach(params):
    """``foreach=None``: the multi-tensor kernels when every parameter is on CUDA."""
    return bool(params) and all(p.is_cuda for p in params)


def corrected_norms(grads, last_grads, kinds, gamma, beta1, *, maximize=False):
    """||c_t||_F of every MARS-path tensor without changing anything: the first pass of the
    global clip, whose one norm spans every group with ``clip_scope="global"``."""
    beta1 = mars_equations._number(beta1)  # a tensor beta1 (as AdamW takes): a number, or traced
    return [torch.linalg.vector_norm(mars_equations.corrected_gradient_(
                last.clone(), -g if maximize else g, gamma, beta1))
            for g, last, kind in zip(grads, last_grads, kinds) if kind != mars_equations.FALLBACK]


def mars(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, last_grads, state_steps, kinds,
         *, lr, betas, eps, weight_decay, amsgrad, gamma, lr_1d_factor, betas_1d,
         weight_decay_1d, weight_decay_1d_source="constructor", clip_scope="tensor",
         orthogonalizer="newton_schulz", ns_steps=5, ns_dtype=torch.bfloat16,
         ns_coefficients="authors", shampoo_scales=None, maximize=False, foreach=None, compiled=False,
         write_last_grad=True, global_clip_norm=None, orthogonalize_on="owner",
         matrix_batch_dims=0):
    r"""One MARS step (M1-M14) over parallel lists; see ``torch_impl.MARS`` for the algorithm.

    ``kinds[i]`` is ``mars_equations.route(...)`` of tensor i (``"adamw"``, ``"lion"``,
    ``"shampoo"`` or ``"fallback"``); ``exp_avg_sqs`` / ``max_exp_avg_sqs`` / ``last_grads``
    hold ``None`` where a route keeps no such buffer.  Lists of different lengths, another
    kind, or a missing or misshapen buffer raise ``ValueError`` before anything changes
    (``functional_checks``).
    ``state_steps`` are CPU tensors, incremented here.  ``write_last_grad``: approx mode keeps
    the raw g_t for the next step; exact mode leaves c~_t (the caller refills ``last_grad``).
    ``global_clip_norm``: the joint norm when it spans more than these tensors (else computed
    here).  ``shampoo_scales[i]`` overrides s for a Shampoo matrix (``None``: from its shape).
    ``orthogonalize_on``: ``"owner"`` or ``"every_rank"``, where a sharded (DTensor) Shampoo
    matrix is orthogonalised (module docstring); a collective for sharded matrices.
    ``matrix_batch_dims``: a Shampoo tensor then has ndim ``matrix_batch_dims`` + 2, and every
    tensor of that ndim on a MARS route is a stack of matrices (module docstring).
    """
    check_choice("orthogonalize_on", orthogonalize_on, ORTHOGONALIZE_ON)
    check_int("matrix_batch_dims", matrix_batch_dims, low=0)
    moments = ("grads", "exp_avgs", "exp_avg_sqs")
    check_lists("mars", params, dict(grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
                                     max_exp_avg_sqs=max_exp_avg_sqs, last_grads=last_grads,
                                     state_steps=state_steps, shampoo_scales=shampoo_scales),
                kinds, {mars_equations.ADAMW: moments + ("last_grads",) + (
                            ("max_exp_avg_sqs",) if amsgrad else ()),
                        mars_equations.LION: ("grads", "exp_avgs", "last_grads"),
                        mars_equations.SHAMPOO: ("grads", "exp_avgs", "last_grads"),
                        mars_equations.FALLBACK: moments},
                matrices=(mars_equations.SHAMPOO,), optional=("shampoo_scales",) + (
                    () if amsgrad else ("max_exp_avg_sqs",)),
                matrix_batch_dims=matrix_batch_dims)
    if not params:
        return
    for p in params:  # a shape that matrix_batch_dims does not fit raises before any write
        mars_equations.matrix_batch_dims_of(p.shape, matrix_batch_dims)
    hypers = {kind: mars_equations.resolve_hyperparameters(
                  kind, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, gamma=gamma,
                  lr_1d_factor=lr_1d_factor, betas_1d=betas_1d, weight_decay_1d=weight_decay_1d,
                  weight_decay_1d_source=weight_decay_1d_source)
              for kind in set(kinds)}
    if torch.compiler.is_compiling():  # torch.compile(opt.step): Inductor fuses the traced
        compiled, foreach = False, False  # loop itself; counters stay tensors (_step_count)
    torch._foreach_add_(state_steps, 1.0)  # one CPU kernel for every counter
    if maximize:
        grads = torch._foreach_neg(grads)
    if clip_scope == "global" and global_clip_norm is None:
        global_clip_norm = mars_equations.global_norm(
            corrected_norms(grads, last_grads, kinds, gamma, betas[0]))
    buffers = [params, grads, exp_avgs, exp_avg_sqs,
               max_exp_avg_sqs if amsgrad else [None] * len(params), last_grads]
    if shampoo_scales is None:
        shampoo_scales = [None] * len(params)
    shampoo = dict(orthogonalizer=orthogonalizer, ns_steps=ns_steps, ns_dtype=ns_dtype,
                   ns_coefficients=ns_coefficients)
    if compiled:
        # MARS-Shampoo's matrices are matmul-bound: they stay eager
        eager = [i for i, k in enumerate(kinds) if k == mars_equations.SHAMPOO]
        fused = [i for i, k in enumerate(kinds) if k != mars_equations.SHAMPOO]
        mars_compiled.update([_take(b, fused) for b in buffers], [state_steps[i] for i in fused],
                             [kinds[i] for i in fused], hypers, clip_scope, global_clip_norm,
                             write_last_grad, grouped=compiled == "group",
                             matrix_batch_dims=matrix_batch_dims)
        buffers, kinds = [_take(b, eager) for b in buffers], [kinds[i] for i in eager]
        state_steps, shampoo_scales = _take(state_steps, eager), _take(shampoo_scales, eager)
        foreach = False
    if foreach is None:
        foreach = default_foreach(params)
    run = _multi_tensor_mars if foreach else _single_tensor_mars
    deferred = []  # the Shampoo matrices, orthogonalised together after the loop
    run(buffers, state_steps, kinds, hypers, clip_scope, global_clip_norm, write_last_grad,
        shampoo, shampoo_scales, deferred, matrix_batch_dims=matrix_batch_dims)
    if deferred:
        _shampoo_steps_(deferred, shampoo, orthogonalize_on)


def _take(xs, idx):
    return [xs[i] for i in idx]


def _single_tensor_mars(buffers, steps, kinds, hypers, scope, total, write_last, shampoo,
                        scales, deferred=None, matrix_batch_dims=0):
    """The loop: each tensor's whole chain before the next (one temporary alive at a time).
    ``matrix_batch_dims``: the option, under which a stack's clip is each matrix's."""
    for (p, g, m, v, v_max, last), k, kind, scale in zip(zip(*buffers), steps, kinds, scales):
        h = mars_equations.with_bias_corrections(  # CPU: no sync
            hypers[kind], mars_equations._step_count(k), SINGLE)
        if kind == mars_equations.FALLBACK:  # (M14) on the raw gradient
            mars_equations.adamw_rule_(p, g, m, v, None, h, SINGLE)
            continue
        c = mars_equations.corrected_gradient_(last, g, h.gamma, h.beta1, SINGLE)
        if scope == "tensor":  # each matrix of a stack on its own
            mars_equations.clip_matrices_(c, matrix_batch_dims, SINGLE)
        elif scope == "global":
            SINGLE.divide_by_clamped_(c, total)
        if kind == mars_equations.LION:
            mars_equations.lion_rule_(p, c, m, h, SINGLE)
        elif kind == mars_equations.SHAMPOO:
            mars_equations.momentum_(m, c, h.beta1, SINGLE)
            _shampoo_step_(p, m, h, scale, shampoo, deferred)
        else:
            mars_equations.adamw_rule_(p, c, m, v, v_max, h, SINGLE)
        if write_last:  # keep the raw g_t (copied: never an alias of p.grad) for step t+1
            last.copy_(g)


def _multi_tensor_mars(buffers, steps, kinds, hypers, scope, total, write_last, shampoo, scales,
                       deferred=None, matrix_batch_dims=0):
    """The same chain as one ``torch._foreach_*`` call per equation, per (route, device,
    dtype) bucket (and per DTensor mesh within it: the ``FOREACH`` table splits each call by
    ``tensor_ops.foreach_groups``)."""
    buckets = {}
    for i, (p, kind) in enumerate(zip(buffers[0], kinds)):
        buckets.setdefault((kind, p.device, p.dtype), []).append(i)
    for (kind, _, _), idx in buckets.items():
        ps, gs, ms, vs, vmaxs, lasts = (_take(b, idx) for b in buffers)
        h = mars_equations.with_bias_corrections(
            hypers[kind], [steps[i].item() for i in idx], FOREACH)
        if kind == mars_equations.FALLBACK:
            mars_equations.adamw_rule_(ps, gs, ms, vs, None, h, FOREACH)
            continue
        cs = mars_equations.corrected_gradient_(lasts, gs, h.gamma, h.beta1, FOREACH)
        if scope == "tensor":  # each matrix of a stack on its own
            mars_equations.clip_matrices_(cs, matrix_batch_dims, FOREACH)
        elif scope == "global":
            FOREACH.divide_by_clamped_(cs, [total] * len(cs))
        if kind == mars_equations.LION:
            mars_equations.lion_rule_(ps, cs, ms, h, FOREACH)
        elif kind == mars_equations.SHAMPOO:
            # the orthogonalizer is a matrix function: one call per tensor
            mars_equations.momentum_(ms, cs, h.beta1, FOREACH)
            for i, p, m in zip(idx, ps, ms):
                _shampoo_step_(p, m, h, scales[i], shampoo, deferred)
        else:
            mars_equations.adamw_rule_(ps, cs, ms, vs, None if vmaxs[0] is None else vmaxs, h,
                                       FOREACH)
        if write_last:
            FOREACH.copy_(lasts, gs)


def _shampoo_step_(p, m, h, scale, shampoo, deferred):
    """(M12) later, with every other Shampoo matrix of the call (``_shampoo_steps_``): the
    update of p needs only its own m, so the order of the tensors does not matter."""
    if p.numel():
        deferred.append((p, m, h, scale))


def _shampoo_steps_(deferred, shampoo, orthogonalize_on):
    """(M11)-(M13) for the deferred matrices: O(m / (1 - beta1)) of the sharded ones on their
    owner ranks (owner mode, ``sharding.orthogonalize_on_owners``), of the rest in one batched
    call per shape (``orthogonalize_by_shape``; DTensors in every-rank mode one by one), then
    each update.  beta1 and eps are the route's (one ``Hyper`` per call; bias corrections do
    not enter the direction)."""
    h = deferred[0][2]
    direction = functools.partial(mars_equations.shampoo_direction, beta1=h.beta1, eps=h.eps,
                                  **shampoo)
    ms = [m for _, m, _, _ in deferred]
    directions = (orthogonalize_on_owners(direction, ms) if orthogonalize_on == "owner"
                  else [None] * len(ms))
    rest = [i for i, d in enumerate(directions) if d is None]
    for i, d in zip(rest, orthogonalize_by_shape(direction, [ms[i] for i in rest])):
        directions[i] = d
    for (p, m, h, scale), d in zip(deferred, directions):
        mars_equations.shampoo_step_(p, m, h, scale=scale, direction=d, **shampoo)


def mars_m(params, grads, momentum_buffers, last_grads, exp_avgs, exp_avg_sqs, state_steps,
           kinds, *, lr, weight_decay, momentum, gamma, ns_steps=5, ns_dtype=torch.bfloat16,
           ns_coefficients="authors", orthogonalizer="newton_schulz", clip_c=True, adamw_betas=(0.9, 0.95), adamw_eps=1e-8, shape_scales=None,
           maximize=False, foreach=None, compiled=False, write_last_grad=True,
           orthogonalize_on="owner", matrix_batch_dims=0):
    r"""One MARS-M step (M15-M18 and the AdamW backup) over parallel lists.

    ``kinds[i]``: "mars_m", "mars_m_efficient" or "adamw".  Buffers that a kind does not keep
    are ``None``; the lists are checked as ``mars``'s are, before anything changes.  ``shape_scales[i]`` overrides 0.2 sqrt(max(A, B)) (``None``: p's shape).
    ``state_steps`` (CPU tensors) are incremented here.  ``compiled``: one
    ``torch.compile``d call per tensor (``mars_m_compiled``), the same equations.
    ``orthogonalize_on``: ``"owner"`` or ``"every_rank"``, where a sharded (DTensor) matrix's
    Newton-Schulz runs (module docstring); a collective for sharded matrices.
    ``matrix_batch_dims``: every matrix tensor has ndim ``matrix_batch_dims`` + 2, a stack
    whose matrices are each clipped, scaled by 0.2 sqrt(max(A, B)) of its own (A, B) and
    orthogonalised on its own.
    """
    check_choice("orthogonalize_on", orthogonalize_on, ORTHOGONALIZE_ON)
    check_int("matrix_batch_dims", matrix_batch_dims, low=0)
    check_lists("mars_m", params, dict(grads=grads, momentum_buffers=momentum_buffers,
                                       last_grads=last_grads, exp_avgs=exp_avgs,
                                       exp_avg_sqs=exp_avg_sqs, state_steps=state_steps,
                                       shape_scales=shape_scales),
                kinds, {MATRIX: ("grads", "momentum_buffers", "last_grads"),
                        EFFICIENT: ("grads", "momentum_buffers"),
                        BACKUP: ("grads", "exp_avgs", "exp_avg_sqs")},
                matrices=(MATRIX, EFFICIENT), optional=("shape_scales",),
                matrix_batch_dims=matrix_batch_dims)
    if not params:
        return
    hypers = {kind: mars_m_equations.resolve_hyperparameters(
                  kind, lr=lr, weight_decay=weight_decay, momentum=momentum, gamma=gamma,
                  adamw_betas=adamw_betas, adamw_eps=adamw_eps)
              for kind in set(kinds)}
    torch._foreach_add_(state_steps, 1.0)
    if maximize:
        grads = torch._foreach_neg(grads)
    if shape_scales is None:
        shape_scales = [None] * len(params)
    if torch.compiler.is_compiling():  # torch.compile(opt.step): the traced loop is fused
        compiled, foreach = False, False
    if foreach is None:
        foreach = default_foreach(params)
    columns = list(zip(params, grads, momentum_buffers, last_grads, exp_avgs, exp_avg_sqs,
                       state_steps, kinds, shape_scales))
    ns = dict(ns_steps=ns_steps, ns_dtype=ns_dtype, ns_coefficients=ns_coefficients,
              orthogonalizer=orthogonalizer)
    if compiled:
        mars_m_compiled.update(columns, hypers, clip_c, ns, write_last_grad, matrix_batch_dims)
        return
    for kind in (MATRIX, EFFICIENT, BACKUP):
        rows = [r for r in columns if r[7] == kind]
        if not rows:
            continue
        if kind == BACKUP:
            _mars_m_backup(rows, hypers[kind], foreach)
        else:
            _mars_m_matrices(rows, hypers[kind], kind, clip_c, ns, foreach, write_last_grad,
                             orthogonalize_on, matrix_batch_dims)


def _mars_m_matrices(rows, h, kind, clip, ns, foreach, write_last, orthogonalize_on="owner",
                     matrix_batch_dims=0):
    """(M15)-(M18) for the matrices: the momenta, then every Newton-Schulz of the call -- the
    sharded matrices' on their owner ranks (owner mode), the rest in one batched call per
    shape (``orthogonalize_by_shape``) -- then the updates.  ``ns``: ``mars_m_direction``'s
    keywords."""
    ps, gs, bufs, lasts = ([r[i] for r in rows] for i in range(4))
    if kind == EFFICIENT:
        if foreach:
            efficient_buffer_(bufs, gs, h.gamma, h.beta1, FOREACH)
        else:
            for b, g in zip(bufs, gs):
                efficient_buffer_(b, g, h.gamma, h.beta1, SINGLE)
        args = [efficient_argument(b, g, h.gamma, h.beta1) for b, g in zip(bufs, gs)]
    elif foreach:
        args = mars_m_momentum_(bufs, gs, lasts, h, clip, FOREACH, matrix_batch_dims)
    else:
        args = [mars_m_momentum_(b, g, last, h, clip, SINGLE, matrix_batch_dims)
                for b, g, last in zip(bufs, gs, lasts)]
    live = [(p, m, r) for p, m, r in zip(ps, args, rows) if p.numel()]
    direction = functools.partial(mars_m_direction, **ns)
    owned = [None] * len(live)
    if orthogonalize_on == "owner":  # sharded matrices: each NS once, on its owner rank
        owned = orthogonalize_on_owners(direction, [m for _, m, _ in live],
                                        out_dtype=ns["ns_dtype"])
    rest = [i for i, o in enumerate(owned) if o is None]
    cast = [live[i][1] if is_dtensor(live[i][1]) else live[i][1].to(ns["ns_dtype"])
            for i in rest]  # NS casts first: stacking the cast halves the copy (bf16)
    for i, o in zip(rest, orthogonalize_by_shape(direction, cast)):
        owned[i] = o
    for (p, m, r), o in zip(live, owned):
        scale = match_rms_scale(p.shape[-2:]) if r[8] is None else r[8]  # each matrix's (A, B)
        mars_m_step_(p, o, h._replace(scale=scale))
    if write_last and kind == MATRIX:  # the raw g_t, copied (never an alias of p.grad)
        if foreach:
            FOREACH.copy_(lasts, gs)
        else:
            for last, g in zip(lasts, gs):
                last.copy_(g)


def _mars_m_backup(rows, h, foreach):
    if foreach:
        ks = [r[6].item() for r in rows]  # CPU counters: no sync
        backup_adamw_step_(*([r[i] for r in rows] for i in (0, 1, 4, 5)),
                           mars_equations.with_bias_corrections(h, ks, FOREACH), FOREACH)
        return
    for p, g, _, _, m, v, k, _, _ in rows:
        backup_adamw_step_(p, g, m, v, mars_equations.with_bias_corrections(
            h, mars_equations._step_count(k), SINGLE), SINGLE)
