"""The subjects of the atomic-refusal battery (``theory_tests/common/test_atomic_refusals.py``):
every optimizer ``torch_impl`` exports, built with two or three parameter groups, and for each
hyperparameter its groups hold (``optimizer.defaults``, i.e. what the constructor puts in every
group) the values that the step must refuse when they appear on the *last* group.

``BAD[name][key]`` lists (group update, message pattern) pairs: the update is written into
the last group after a first step (so every group has state and counters), and the step must
then raise a ``ValueError`` matching the pattern, which names ``key``.  An update may set more
than one key when a value is refused only in combination (``amsgrad`` with ``mars-lion``), or
when it becomes invalid through a change against what the group holds (``matrix_batch_dims``
that the group's stacks no longer fit).  ``UNCHECKED[name]`` maps a key to the reason it
cannot be refused; the battery fails unless every key of ``defaults`` is in exactly one of
the two, so an option added later is not silently left out.
"""
from dataclasses import dataclass
from typing import Callable

import torch

from torch_impl import KFAC, LAMB, MARS, MARS_M, MARSM, MKOR, MARS_M_Efficient

F64 = torch.float64

__all__ = ["SUBJECTS", "BAD", "UNCHECKED", "PRECONDITIONERS", "Subject"]


@dataclass(frozen=True)
class Subject:
    """``build()`` -> (optimizer, parameters, ``grads(t)``: gives every parameter a gradient
    for step t; the optimizer's counters beyond its state_dict, e.g. a preconditioner's)."""

    build: Callable
    counters: Callable = lambda opt: ()


def _params(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=F64)) for s in shapes]


def _feeder(params):
    def grads(t):
        g = torch.Generator().manual_seed(100 + t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    return grads


def _plain(make):
    """A first-order optimizer over explicit parameters: ``make(params) -> optimizer``."""
    def build():
        params = _params((4, 3), (3,), (2, 4, 3), (2, 3, 5), seed=1)
        return make(params), params, _feeder(params)
    return Subject(build)


def _mars(params):
    # the last group holds stacks of matrices (fused experts): matrix_batch_dims = 1
    return MARS([dict(params=params[:2]), dict(params=params[2:], matrix_batch_dims=1)],
                lr=1e-2, ns_dtype=F64)


def _mars_m(params):
    # the last group: MARS-M's matrix rule on stacks (issue 45's case)
    return MARSM([dict(params=params[:2]),
                  dict(params=params[2:], rule="mars_m", matrix_batch_dims=1)],
                 lr=1e-2, ns_dtype=F64)


def _authors(cls):
    def make(params):  # the authors' constructor: a mars_m group and an adamw group
        opt = cls(lr=1e-2, muon_params=params[:1], adamw_params=params[1:2], ns_dtype=F64)
        opt.add_param_group(dict(params=params[2:], rule="mars_m", matrix_batch_dims=1))
        return opt
    return make


def _lamb(params):
    return LAMB([dict(params=params[:2]), dict(params=params[2:])], lr=1e-2)


def _preconditioned(cls):
    """MKOR / K-FAC over a LAMB backbone of two groups (one per layer): their groups, and so
    their hyperparameters, are the backbone's."""
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(),
                                    torch.nn.Linear(3, 2)).double()
        backbone = LAMB([dict(params=model[0].parameters()),
                         dict(params=model[2].parameters())], lr=1e-2)
        opt = cls(model, backbone, inv_freq=1)

        def grads(t):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(100 + t), dtype=F64)
            opt.zero_grad()
            model(x).square().mean().backward()
        return opt, list(model.parameters()), grads
    return Subject(build, counters=lambda opt: (opt.steps,))


SUBJECTS = {
    "MARS": _plain(_mars),
    "MARSM": _plain(_mars_m),
    "MARS_M": _plain(_authors(MARS_M)),
    "MARS_M_Efficient": _plain(_authors(MARS_M_Efficient)),
    "LAMB": _plain(_lamb),
    "MKOR": _preconditioned(MKOR),
    "KFAC": _preconditioned(KFAC),
}
PRECONDITIONERS = ("MKOR", "KFAC")


def _named(key, *values):
    """(update, pattern) pairs that set ``key`` alone and expect the usual "<key>: ..."."""
    return [({key: v}, rf"^{key}: ") for v in values]


# the storage options (issue 47), shared by MARS, MARS-M and LAMB: the battery's parameters are
# float64, so stochastic rounding without a 16-bit state_dtype has nothing to round
_STORAGE = {
    "state_dtype": _named("state_dtype", torch.int64),
    "state_rounding": _named("state_rounding", "sometimes") + [
        ({"state_rounding": "stochastic"}, r"^state_rounding: 'stochastic' rounds state")],
    "rounding_seed": _named("rounding_seed", -1, "seven"),
    "kahan_sum": _named("kahan_sum", 1),
}
# MARS and MARS-M: 8-bit moments; the battery's tensors are all smaller than a default block
_QUANTIZATION = {
    "state_quantization": _named("state_quantization", "int8") + [
        ({"state_quantization": "blockwise8"}, r"^state_quantization='blockwise8' with block_size=256")],
    "block_size": _named("block_size", 0, 2.5),
}


def _flags(owner):
    return {flag: [({flag: True}, rf"^{owner}: {flag}=True is not supported")]
            for flag in ("fused", "capturable", "differentiable")}


_LAMB = {
    "lr": _named("lr", -1.0, torch.tensor(-1.0), torch.tensor([1e-2, 1e-2])),
    "betas": [({"betas": (1.5, 0.999)}, r"^betas\[0\]: "), ({"betas": (0.9,)}, r"^betas: ")],
    "eps": _named("eps", -1e-8),
    "weight_decay": _named("weight_decay", -0.1),
    "maximize": _named("maximize", "yes"),
    "foreach": _named("foreach", "sometimes"),
    **_STORAGE,
    **_flags("LAMB"),
}

_MARS_M = {
    "lr": _named("lr", -1.0, torch.tensor(-1.0)),
    "weight_decay": _named("weight_decay", -0.1),
    "momentum": _named("momentum", 1.0, torch.tensor(1.5)) + [
        ({"momentum": 0.0, "efficient": True}, r"^momentum: the efficient recursion")],
    "ns_steps": _named("ns_steps", 0, 2.5),
    "gamma": _named("gamma", 1.5),
    "clip_c": _named("clip_c", 1),
    # the mode every group shares: one group changed alone is refused
    "is_approx": [({"is_approx": False}, r"^is_approx: every parameter group")] +
                 _named("is_approx", "no"),
    "adamw_betas": [({"adamw_betas": (0.9, 1.0)}, r"^adamw_betas\[1\]: ")],
    "adamw_eps": _named("adamw_eps", -1.0),
    "rule": _named("rule", "muon"),
    "efficient": _named("efficient", "yes"),
    "ns_dtype": _named("ns_dtype", torch.int32),
    "ns_coefficients": _named("ns_coefficients", "fast", (1.0, float("inf"), 0.0)),
    "orthogonalizer": _named("orthogonalizer", "svd") + [
        ({"orthogonalizer": "gram_newton_schulz", "ns_dtype": torch.float16},
         r"^orthogonalizer: 'gram_newton_schulz' .*float16")],
    "shape_layout": _named("shape_layout", "rows"),
    "maximize": _named("maximize", 0),
    "foreach": _named("foreach", "sometimes"),
    "compiled": _named("compiled", "group"),
    "orthogonalize_on": _named("orthogonalize_on", "nowhere"),
    **_STORAGE,
    **_QUANTIZATION,
    # changed after the group has state: its stacks no longer fit (issue 45: the group of
    # rule "mars_m" is the last, and the earlier groups must not have stepped)
    "matrix_batch_dims": _named("matrix_batch_dims", -1, "1") + [
        ({"matrix_batch_dims": 0}, r"^rule: 'mars_m' orthogonalizes matrices; .*matrix_batch_dims"),
        ({"matrix_batch_dims": 2}, r"^rule: 'mars_m' with matrix_batch_dims=2 ")],
    **_flags("MARSM"),
}

_MARS = {
    "lr": _named("lr", -1.0, torch.tensor(-1.0), torch.tensor([1e-2, 1e-2])),
    "betas": [({"betas": (1.5, 0.99)}, r"^betas\[0\]: ")],
    "eps": _named("eps", -1e-8),
    "weight_decay": _named("weight_decay", -0.1),
    "amsgrad": _named("amsgrad", 1) + [
        ({"amsgrad": True, "mars_type": "mars-lion"}, r"^amsgrad: mars-lion keeps no")],
    "gamma": _named("gamma", -0.1, 1.5),
    "is_approx": [({"is_approx": False}, r"^is_approx: every parameter group")] +
                 _named("is_approx", "no"),
    "mars_type": _named("mars_type", "mars-sgd"),
    "optimize_1d": _named("optimize_1d", "yes"),
    "lr_1d_factor": _named("lr_1d_factor", -1.0),
    "betas_1d": [({"betas_1d": (0.9, 1.0)}, r"^betas_1d\[1\]: ")],
    "weight_decay_1d": _named("weight_decay_1d", -0.1),
    "clip_scope": _named("clip_scope", "row"),
    "orthogonalizer": _named("orthogonalizer", "qr") + [
        ({"orthogonalizer": "gram_newton_schulz", "ns_dtype": torch.float16},
         r"^orthogonalizer: 'gram_newton_schulz' .*float16")],
    "ns_steps": _named("ns_steps", 0),
    "ns_dtype": _named("ns_dtype", torch.int32),
    "ns_coefficients": _named("ns_coefficients", "fast"),
    "weight_decay_1d_source": _named("weight_decay_1d_source", "model"),
    **_STORAGE,
    **_QUANTIZATION,
    "maximize": _named("maximize", "no"),
    "foreach": _named("foreach", "sometimes"),
    "compiled": _named("compiled", "always"),
    "shape_layout": _named("shape_layout", "rows"),
    "orthogonalize_on": _named("orthogonalize_on", "nowhere"),
    # changed after the group has state: its 3-D stacks are not stacks of 2 dims
    "matrix_batch_dims": _named("matrix_batch_dims", -1, True) + [
        ({"matrix_batch_dims": 2}, r"^matrix_batch_dims=2: the group's tensors must be")],
    **_flags("MARS"),
}

BAD = {
    "MARS": _MARS,
    "MARSM": _MARS_M,
    "MARS_M": _MARS_M,
    # every group efficient: a group turned exact is refused by its own check first
    "MARS_M_Efficient": dict(_MARS_M, is_approx=[
        ({"is_approx": False}, r"^efficient: .* no exact mode; use is_approx=True")] +
        _named("is_approx", "no")),
    "LAMB": _LAMB,
    # a preconditioner's groups are its backbone's (here LAMB's)
    "MKOR": _LAMB,
    "KFAC": _LAMB,
}

# Every key of every subject's defaults is refused in some value: nothing is exempt.
UNCHECKED = {name: {} for name in SUBJECTS}
