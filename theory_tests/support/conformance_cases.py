"""The registry of the conformance battery (``conformance/test_conformance.py``), after torch's
``OptimizerInfo`` (torch/testing/_internal/common_optimizers.py): one :class:`Case` per optimizer
under test, saying how to build it on a small model, which keywords and behaviours it has,
which reference it is held to, and -- for every behaviour it is left out of -- why.

The optimizers: MARS with each ``mars_type`` (approx mode) and MARS-AdamW in exact mode, MARS-M,
LAMB, and the preconditioners MKOR and K-FAC on an SGD backbone.  The references run in the same
tests as the optimizers: ``torch.optim.AdamW`` for the first-order ones and ``torch.optim.SGD``
(the backbone alone) for the preconditioners, so every assertion is also shown to hold for
torch's own optimizer (or, where it does not, the difference is listed with its reason).

Tests take a case and ask it for an optimizer on a model: ``case.make(model)`` (all of the model's
parameters) or ``case.make(model, params_or_groups, **overrides)``.  For MKOR / K-FAC the
parameters (or group dicts) and the backbone's keywords go to ``SGD``, the preconditioner's own
keywords (``inv_freq``, ``grad_scaler``, ...) to ``MKOR`` / ``KFAC``, which hook ``model``.
"""
import inspect
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from torch_impl import MARS, MARSM
from torch_impl.baselines import KFAC, LAMB
from torch_impl.mkor import MKOR

F64 = torch.float64

# -- the model and the data ---------------------------------------------------------------------


class TinyNet(nn.Module):
    """Linear(4, 3) -> tanh -> Linear(3, 3), times a per-output ``gain``.

    Two same-shaped biases (the load_state_dict hook swaps their state), 2-D weights (the
    MARS / MARS-M matrix paths, MKOR / K-FAC's preconditioned layers) and ``gain``, a parameter
    outside every layer (the one a preconditioner test can freeze without touching a layer)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 3)
        self.fc2 = nn.Linear(3, 3)
        self.gain = nn.Parameter(torch.linspace(0.8, 1.2, 3))

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))) * self.gain


def tiny_model(dtype=F64, seed=0):
    """A fresh TinyNet; the same ``seed`` gives bit-identical parameters."""
    torch.manual_seed(seed)
    return TinyNet().to(dtype)


def batch(t, dtype=F64):
    """Step ``t``'s batch (6 samples): the same for every run of every test."""
    gen = torch.Generator().manual_seed(1000 + t)
    x = torch.randn(6, 4, generator=gen, dtype=F64)
    y = torch.randn(6, 3, generator=gen, dtype=F64)
    return x.to(dtype), y.to(dtype)


def loss_of(model, t):
    """The mean squared error of step ``t``'s batch, in the model's dtype."""
    x, y = batch(t, next(model.parameters()).dtype)
    return ((model(x) - y) ** 2).mean()


# -- the cases ---------------------------------------------------------------------------------

# The behaviours of the battery, one test function (or a pair) each; a case takes part in every
# behaviour that its ``skips`` does not name.  Keys are used in ``skips`` and in the table of
# theory_tests/conformance/README.md (``applicability_table``).
BEHAVIOURS = {
    "construct": "1. construction: parameter list, named_parameters, per-group dicts, "
                 "add_param_group",
    "bad_hyper_ctor": "1. bad hyperparameter in the constructor: ValueError naming it",
    "bad_hyper_group": "1. bad hyperparameter in a group dict: ValueError naming it",
    "hooks": "2. the six optimizer hooks fire once per call with the optimizer",
    "load_hook_remap": "2. a load_state_dict pre-hook that swaps two states is honoured",
    "checkpoint": "3. state_dict through torch.save/torch.load continues bit-identically",
    "copy": "3. deepcopy / pickle of (model, opt) continue bit-identically",
    "copy_refused": "3. deepcopy / pickle of the preconditioner: TypeError naming state_dict",
    "model_copy_inert": "3. a deepcopy of the hooked model does not change the original's step",
    "schedulers": "4. StepLR / LambdaLR equal setting lr by hand",
    "onecycle": "4. OneCycleLR(cycle_momentum=True) equals setting lr and momentum by hand",
    "compile": "5. torch.compile(opt.step) equals eager (float32; bf16 within a derived bound)",
    "bf16": "6. bf16 parameters keep their dtype, the step runs",
    "fp16": "6. fp16 parameters keep their dtype, the step runs",
    "state_dtype": "6. state_dtype: float32 state for bf16 parameters; bf16 state with lr=0",
    "complex_equal": "7. a complex parameter equals its view_as_real",
    "complex_refused": "7. a complex parameter: clear error, nothing changed",
    "sparse_refused": "7. a sparse gradient: clear error, nothing changed",
    "sparse_passed": "7. a sparse gradient reaches the backbone as in SGD alone",
    "no_grad": "8. parameters without gradients: no state, unchanged",
    "freeze": "8. a parameter frozen mid-training stops; the others as without it",
    "duplicate_param": "8. a parameter in two groups: ValueError at construction",
    "maximize": "9. maximize=True equals minimising the negated loss",
    "foreach": "9. foreach=True equals foreach=False",
    "grad_scaler": "10. GradScaler with unscale_ + clipping equals the unscaled loop; "
                   "an overflow step changes nothing",
    "atomic": "11. a bad gradient in the second group: the first group is untouched",
    "torch_flags_off": "12. fused=False, capturable=False, differentiable=False accepted",
    "torch_flags_on": "12. fused/capturable/differentiable=True: ValueError naming it",
}


# The dtypes of the battery (issue 30): every behaviour that steps runs with float64 parameters
# and again with bf16 and fp16 ones; a comparison bit for bit in float64 is bit for bit there
# too (the same assertion), except where a reason in the registry says otherwise.
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bf16": torch.bfloat16,
          "fp16": torch.float16}
LOW_PRECISION = ("bf16", "fp16")
BASE_DTYPE = {"compile": "float32",  # the dtype of the behaviour's first run (else float64)
              "bf16": "bf16", "fp16": "fp16", "state_dtype": "bf16 + float32"}

# Behaviours that run in one dtype only, and why.
_NO_ARITHMETIC = ("raises at construction, before any step: no arithmetic that a dtype could "
                  "change (float64 only)")
ONE_DTYPE = {
    "bad_hyper_ctor": _NO_ARITHMETIC, "bad_hyper_group": _NO_ARITHMETIC,
    "duplicate_param": _NO_ARITHMETIC, "torch_flags_on": _NO_ARITHMETIC,
    "bf16": "is itself the bf16 run", "fp16": "is itself the fp16 run",
    "state_dtype": "its dtypes are the behaviour: bf16 parameters with float32 state, float32 "
                   "parameters with bf16 state",
}

# (behaviour, dtype name) left out for every case, and why (measured).
LOW_PRECISION_SKIPS = {
    ("complex_equal", "bf16"): "torch has no complex bf16 dtype (fp16's is complex32)",
    ("compile", "fp16"): "no bound tighter than a step: fp16 stores AdamW-type second moments "
                         "of these gradients ((1 - beta2) g^2 < 6e-5) as subnormals, where "
                         "eager's per-operation rounding and Inductor's float32 chain differ "
                         "by a large part of v (measured: AdamW 4.8 eps of max |p|, a fifth "
                         "of a step); bf16 (float32's exponent range) carries the behaviour",
    ("grad_scaler", "fp16"): "torch's GradScaler refuses fp16 gradients (unscale_: ValueError "
                             "\"Attempting to unscale FP16 gradients.\"): it is made for float32 "
                             "parameters under fp16 autocast",
}


@dataclass(frozen=True)
class Case:
    """One optimizer under test (an ``OptimizerInfo``).

    name: the pytest id.  family: ``"first_order"`` (held to AdamW) or ``"preconditioner"``
        (MKOR, K-FAC and their reference, the SGD backbone alone).
    factory(model, params_or_groups, **kwargs): builds the optimizer.
    hyper: the battery's hyperparameters (each test may override them).
    reference: torch's own optimizer, run in the same tests as the spec.
    closure: ``step`` needs a closure (MARS exact mode).
    momentum_key: what OneCycleLR(cycle_momentum=True) drives: ``"betas"`` (its first entry)
        or ``"momentum"``.
    zero_lr: the overrides that make the learning rate 0 (MARS keeps its 1-D learning rate as
        ``lr_1d / lr``, so lr = 0 needs lr_1d = 0 too).
    bad_hyper: ((keyword overrides, regex the ValueError must match), ...): ``lr=-1`` and one
        optimizer-specific hyperparameter.
    rejects: the bad gradients a step refuses (``"complex"``, ``"sparse"``).
    frozen: names of the TinyNet parameters the freeze test stops mid-training.
    scaler_keyword: the constructor takes ``grad_scaler=`` (MKOR / K-FAC: the documented loop
        calls ``scaler.unscale_(opt)`` before ``scaler.step(opt)`` and passes the scaler).
    low_precision: extra overrides for fp16 parameters (see ``ADAMW_FP16``).
    complex_exact: a complex parameter trains bit-identically to its real view (the
        optimizer steps the real view); False: within ``COMPLEX_RTOL`` of the test file.
    skips: {behaviour: reason} for every behaviour the case is left out of.
    notes: {behaviour: a documented difference}, shown next to the ✓ in the table.
    slow: behaviours whose test runs under ``@pytest.mark.slow`` for this case.
    low_precision_skips: {(behaviour, dtype name): reason} for a bf16 / fp16 variant the case
        is left out of (``DTYPES``; the float64 run stays).
    low_precision_xfails: {(behaviour, dtype name): reason}: a variant that runs and is
        expected to fail (``xfail(strict=True)``): a documented difference of torch's own code.
    low_precision_slow: behaviours whose bf16 / fp16 variants run under ``-m slow``.
    """

    name: str
    family: str
    factory: object
    hyper: dict
    reference: bool = False
    closure: bool = False
    momentum_key: str = "betas"
    zero_lr: dict = field(default_factory=lambda: {"lr": 0.0})
    bad_hyper: tuple = ()
    rejects: frozenset = frozenset()
    frozen: tuple = ("gain", "fc1.weight")
    scaler_keyword: bool = False
    low_precision: dict = field(default_factory=dict)
    complex_exact: bool = True
    skips: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)
    slow: frozenset = frozenset()
    low_precision_skips: dict = field(default_factory=dict)
    low_precision_xfails: dict = field(default_factory=dict)
    low_precision_slow: frozenset = frozenset()

    def kwargs(self, **overrides):
        return {**self.hyper, **overrides}

    def make(self, model, params=None, **overrides):
        """The optimizer over ``params`` (default: every parameter of ``model``); on an fp16
        model with the case's fp16 overrides (``low_precision``) under the test's own."""
        params = list(model.parameters()) if params is None else params
        dtype = next(model.parameters()).dtype
        extra = self.low_precision.get("fp16", {}) if dtype == torch.float16 else {}
        return self.factory(model, params, **self.kwargs(**{**extra, **overrides}))

    def applies(self, behaviour):
        assert behaviour in BEHAVIOURS, behaviour
        return behaviour not in self.skips

    def __repr__(self):
        return self.name


def _first_order(cls):
    def factory(model, params, **kwargs):
        return cls(params, **kwargs)
    return factory


def _preconditioned(cls):
    """``cls(model, SGD(params, **backbone keywords), **the preconditioner's keywords)``."""
    own = set(inspect.signature(cls.__init__).parameters) - {"self", "model", "optimizer"}

    def factory(model, params, **kwargs):
        mine = {k: v for k, v in kwargs.items() if k in own}
        sgd = torch.optim.SGD(params, **{k: v for k, v in kwargs.items() if k not in own})
        return cls(model, sgd, **mine)
    return factory


# Why a case is left out of a behaviour (each reason once, referred to by the cases).
WHY = {
    "torch_no_group_check": "torch validates hyperparameters only in the constructor; a group "
                            "dict with lr=-1 is accepted (measured: AdamW and SGD)",
    "groups_are_backbone": "the group dicts are the SGD backbone's (torch does not validate "
                           "them, as for sgd_reference); the preconditioner has no per-group "
                           "hyperparameters",
    "copies_refused": "a preconditioner holds hooks on its model, so it refuses to be copied "
                      "(behaviour copy_refused); its checkpoint is state_dict (checkpoint)",
    "only_preconditioners": "only a preconditioner hooks the model or refuses copies; the "
                            "first-order optimizers copy with the model (behaviour copy)",
    "compile_closure": "exact mode's step(closure) re-runs forward and backward at x_{t-1} "
                       "(eager Python by design), so there is no step() after backward to compile",
    "scaler_closure": "GradScaler.step refuses a closure, which the exact mode's step needs (a "
                      "scaled exact-mode loop is the authors' update_previous_grad(grad_scaler=) "
                      "loop, a different driver)",
    "freeze_exact": "exact mode evaluates the gradient at x_{t-1}, where a parameter frozen at "
                    "step t still has its previous value, so 'the same run without it' is a "
                    "different algorithm",
    "no_state_dtype": "no state_dtype keyword (the state takes the parameter's dtype)",
    "complex_supported": "complex parameters are supported (the complex_equal behaviour)",
    "complex_rejected": "complex parameters are refused (the complex_refused behaviour)",
    "sparse_supported": "SGD supports sparse gradients, so the backbone takes them "
                        "(the sparse_passed behaviour)",
    "sparse_rejected": "sparse gradients are refused (the sparse_refused behaviour)",
    "adamw_not_atomic": "torch's AdamW is not atomic across groups: it updates the first "
                        "group before raising on a sparse gradient in the second (measured); "
                        "it supports complex parameters",
    "nothing_rejected": "SGD takes complex parameters and sparse gradients, so no step of it "
                        "(or of a preconditioner over it) raises for a bad gradient",
    "torch_supports_flags": "torch's AdamW supports fused / capturable / differentiable = True "
                            "(not refused; only the False half applies)",
    "flags_are_backbone": "fused / capturable / differentiable are the SGD backbone's "
                          "keywords; MKOR / KFAC have none",
    "sgd_foreach_rounds": "torch's SGD (the backbone): foreach=True multiplies the momentum "
                          "buffer by momentum = 0.9 rounded to the dtype (0.8984375 in bf16, "
                          "0.89990234 in fp16: on the CPU torch._foreach_mul_ with a number "
                          "rounds it), the loop by the float32 0.9: not bit-identical "
                          "(measured; xfail, strict)",
    "no_fp16_sparse_add": "torch's CPU sparse add has no fp16 kernel (NotImplementedError: "
                          "\"cadd_sparse\" not implemented for 'Half'): SGD itself cannot take "
                          "an fp16 sparse gradient",
}

# What torch's SGD, the backbone of sgd_reference / mkor / kfac, does in bf16 / fp16.
SGD_LOW_PRECISION_XFAILS = {("foreach", "bf16"): WHY["sgd_foreach_rounds"],
                            ("foreach", "fp16"): WHY["sgd_foreach_rounds"]}
SGD_LOW_PRECISION_SKIPS = {("sparse_passed", "fp16"): WHY["no_fp16_sparse_add"]}

FIRST_ORDER_ONLY = {"copy_refused": WHY["only_preconditioners"],
                    "model_copy_inert": WHY["only_preconditioners"],
                    "sparse_passed": WHY["sparse_rejected"]}

MARS_SKIPS = {**FIRST_ORDER_ONLY, "complex_equal": WHY["complex_rejected"]}

PRECONDITIONER_SKIPS = {
    "bad_hyper_group": WHY["groups_are_backbone"], "copy": WHY["copies_refused"],
    "state_dtype": WHY["no_state_dtype"], "complex_refused": WHY["complex_supported"],
    "sparse_refused": WHY["sparse_supported"], "atomic": WHY["nothing_rejected"],
    "torch_flags_off": WHY["flags_are_backbone"], "torch_flags_on": WHY["flags_are_backbone"]}

# AdamW's default eps = 1e-8 rounds to 0 in float16 (smallest subnormal 6e-8), so an entry whose
# gradient underflows to 0 takes 0 / (0 + 0) = NaN (measured); fp16 runs give it eps = 1e-4.
ADAMW_FP16 = {"eps": 1e-4}

NOTE = {
    "torch_lr": "torch's message names the learning rate in words (\"Invalid learning rate: "
                "-1.0\"), so the test matches \"learning rate\" rather than \"lr\"",
    "adamw_fp16": "run with eps=1e-4: AdamW's default eps=1e-8 rounds to 0 in fp16, and an "
                  "entry whose gradient underflows to 0 becomes 0/0 = NaN (measured)",
    "sgd_complex": "within 1e-14 relative (fp16, complex32: 8 eps = 7.8e-3), not "
                   "bit-identical: SGD steps the complex tensor, whose complex-by-real "
                   "products round differently from the real view's (measured 1 ulp; fp16 "
                   "0.33 eps)",
    "frozen_gain": "freezes only ``gain``, a parameter outside every layer: MKOR "
                   "preconditions a layer's weight and bias together and K-FAC's KL clip sums "
                   "over all layers, so a frozen layer parameter is not the same as one that "
                   "was never there",
}

PRECONDITIONER_NOTES = {"bad_hyper_ctor": NOTE["torch_lr"], "complex_equal": NOTE["sgd_complex"],
                        "freeze": NOTE["frozen_gain"]}

# torch.compile(opt.step) of MKOR / K-FAC (and their reference SGD) runs under -m slow: measured
# on a cold inductor cache, MKOR's step is 8 graphs (~14 s of CPU), K-FAC's 5 (~5 s), where the
# whole default battery has ~40 s of CPU; the first-order kinds compile in the default run.
COMPILE_SLOW = frozenset({"compile"})
# The bf16 compile runs by default for mars_adamw only (one compile, ~4 s of CPU), the other
# cases' under -m slow (``low_precision_slow``).

LR_NAMED = r"\blr\b"         # our optimizers name the keyword
TORCH_LR = "learning rate"   # torch's message: "Invalid learning rate: -1.0"


def _mars(mars_type, *, exact=False):
    name = "mars_" + mars_type.split("-")[1] + ("_exact" if exact else "")
    skips = dict(MARS_SKIPS)
    if exact:
        skips.update(compile=WHY["compile_closure"], grad_scaler=WHY["scaler_closure"],
                     freeze=WHY["freeze_exact"])
    slow = COMPILE_SLOW if mars_type != "mars-adamw" else frozenset()
    return Case(
        name=name, family="first_order", factory=_first_order(MARS),
        hyper=dict(lr=1e-2, weight_decay=1e-2, mars_type=mars_type, is_approx=not exact,
                   ns_dtype=F64),
        closure=exact, zero_lr={"lr": 0.0, "lr_1d": 0.0},
        bad_hyper=(({"lr": -1.0}, LR_NAMED), ({"betas": (1.5, 0.99)}, r"betas"),
                   ({"gamma": 2.0}, r"gamma")),
        rejects=frozenset({"complex", "sparse"}), skips=skips, slow=slow)


CASES = [
    Case(name="adamw_reference", family="first_order", factory=_first_order(torch.optim.AdamW),
         hyper=dict(lr=1e-2, weight_decay=1e-2), reference=True,
         bad_hyper=(({"lr": -1.0}, TORCH_LR), ({"betas": (1.5, 0.999)}, r"beta")),
         rejects=frozenset({"sparse"}), low_precision={"fp16": ADAMW_FP16},
         low_precision_slow=COMPILE_SLOW,
         notes={"bad_hyper_ctor": NOTE["torch_lr"], "fp16": NOTE["adamw_fp16"]},
         skips={**FIRST_ORDER_ONLY, "bad_hyper_group": WHY["torch_no_group_check"],
                "state_dtype": WHY["no_state_dtype"], "complex_refused": WHY["complex_supported"],
                "atomic": WHY["adamw_not_atomic"], "torch_flags_on": WHY["torch_supports_flags"]}),
    _mars("mars-adamw"),
    _mars("mars-lion"),
    _mars("mars-shampoo"),
    _mars("mars-adamw", exact=True),
    Case(name="mars_m", family="first_order", factory=_first_order(MARSM),
         hyper=dict(lr=1e-2, weight_decay=1e-2, ns_dtype=F64), momentum_key="momentum",
         bad_hyper=(({"lr": -1.0}, LR_NAMED), ({"momentum": 1.5}, r"momentum")),
         rejects=frozenset({"complex", "sparse"}), low_precision_slow=COMPILE_SLOW,
         skips=MARS_SKIPS),
    Case(name="lamb", family="first_order", factory=_first_order(LAMB),
         hyper=dict(lr=1e-2, weight_decay=1e-2),
         bad_hyper=(({"lr": -1.0}, LR_NAMED), ({"betas": (1.5, 0.999)}, r"betas")),
         rejects=frozenset({"sparse"}), low_precision_slow=COMPILE_SLOW,
         skips={**FIRST_ORDER_ONLY, "complex_refused": WHY["complex_supported"]}),
    Case(name="sgd_reference", family="preconditioner",
         factory=lambda model, params, **kw: torch.optim.SGD(params, **kw),
         hyper=dict(lr=0.1, momentum=0.9), reference=True, momentum_key="momentum",
         bad_hyper=(({"lr": -1.0}, TORCH_LR), ({"momentum": -0.5}, r"momentum")),
         frozen=("gain",), slow=COMPILE_SLOW, complex_exact=False, notes=PRECONDITIONER_NOTES,
         low_precision_xfails=SGD_LOW_PRECISION_XFAILS, low_precision_skips=SGD_LOW_PRECISION_SKIPS,
         skips={**{k: v for k, v in PRECONDITIONER_SKIPS.items() if k != "copy"},
                "copy_refused": "SGD is a plain optimizer: it copies (behaviour copy)"}),
    Case(name="mkor", family="preconditioner", factory=_preconditioned(MKOR),
         hyper=dict(lr=0.1, momentum=0.9, inv_freq=1), momentum_key="momentum",
         bad_hyper=(({"lr": -1.0}, TORCH_LR), ({"inv_freq": 0}, r"inv_freq")),
         frozen=("gain",), scaler_keyword=True, slow=COMPILE_SLOW, complex_exact=False,
         low_precision_xfails=SGD_LOW_PRECISION_XFAILS, low_precision_skips=SGD_LOW_PRECISION_SKIPS,
         skips=dict(PRECONDITIONER_SKIPS), notes=PRECONDITIONER_NOTES),
    Case(name="kfac", family="preconditioner", factory=_preconditioned(KFAC),
         hyper=dict(lr=0.1, momentum=0.9, inv_freq=1, factor_freq=1), momentum_key="momentum",
         bad_hyper=(({"lr": -1.0}, TORCH_LR), ({"damping": 0.0}, r"damping")),
         frozen=("gain",), scaler_keyword=True, slow=COMPILE_SLOW, complex_exact=False,
         low_precision_xfails=SGD_LOW_PRECISION_XFAILS, low_precision_skips=SGD_LOW_PRECISION_SKIPS,
         skips=dict(PRECONDITIONER_SKIPS), notes=PRECONDITIONER_NOTES),
]

BY_NAME = {case.name: case for case in CASES}


def cases_for(behaviour):
    """pytest params (id = the case's name) of every case that takes part in ``behaviour``;
    a case listed as slow for it carries ``pytest.mark.slow``."""
    return [pytest.param(case, id=case.name,
                         marks=[pytest.mark.slow] if behaviour in case.slow else [])
            for case in CASES if case.applies(behaviour)]


def dtypes_of(behaviour):
    """The dtype names ``behaviour`` runs in: its base dtype (float64; ``BASE_DTYPE``) and,
    unless ``ONE_DTYPE`` says why not, bf16 and fp16."""
    base = BASE_DTYPE.get(behaviour, "float64")
    return (base,) if behaviour in ONE_DTYPE else (base,) + LOW_PRECISION


def case_dtypes_for(behaviour):
    """pytest params ``(case, dtype)`` of ``behaviour``: every case of ``cases_for`` in each
    dtype of ``dtypes_of`` (ids: the case's name in the base dtype, as before the dtypes came,
    then ``-bf16`` / ``-fp16``), less the case's ``low_precision_skips``; its
    ``low_precision_xfails`` carry ``xfail(strict=True)``, its ``low_precision_slow`` and
    ``slow`` behaviours ``pytest.mark.slow``."""
    params = []
    for case in CASES:
        if not case.applies(behaviour):
            continue
        for i, name in enumerate(dtypes_of(behaviour)):
            if (behaviour, name) in case.low_precision_skips or \
                    (behaviour, name) in LOW_PRECISION_SKIPS:
                continue
            marks = []
            if behaviour in case.slow or (i and behaviour in case.low_precision_slow):
                marks.append(pytest.mark.slow)
            if (behaviour, name) in case.low_precision_xfails:
                marks.append(pytest.mark.xfail(
                    strict=True, reason=case.low_precision_xfails[behaviour, name]))
            params.append(pytest.param(case, DTYPES[name], marks=marks,
                                       id=case.name if i == 0 else f"{case.name}-{name}"))
    return params


def applicability_table():
    """The behaviour x case table of theory_tests/conformance/README.md (Markdown): "✓" where the case
    runs the behaviour's test ("✓ slow": under ``-m slow``; "✓ [n]": with the documented
    difference n), else "N/A [n]" with n the reason (``WHY``, or the case's own words).  The
    dtypes column says what every case runs the behaviour in ("[n]": why not the others); a
    cell adds a case's own exceptions ("no fp16 [n]", "bf16 xfail [n]", "bf16 slow")."""
    footnotes, lines = [], []

    def footnote(text):
        if text not in footnotes:
            footnotes.append(text)
        return f"[{footnotes.index(text) + 1}]"

    lines += ["| behaviour | dtypes | " + " | ".join(c.name for c in CASES) + " |",
              "|" + "---|" * (len(CASES) + 2)]
    for key, title in BEHAVIOURS.items():
        names = dtypes_of(key)
        dtypes = ", ".join(n for n in names if (key, n) not in LOW_PRECISION_SKIPS)
        if key in ONE_DTYPE:
            dtypes += " " + footnote(ONE_DTYPE[key])
        for n in names:
            if (key, n) in LOW_PRECISION_SKIPS:
                dtypes += f"; no {n} " + footnote(LOW_PRECISION_SKIPS[key, n])
        cells = []
        for case in CASES:
            if not case.applies(key):
                cells.append("N/A " + footnote(case.skips[key]))
                continue
            cell = "✓ slow" if key in case.slow else "✓"
            if key in case.notes:
                cell += " " + footnote(case.notes[key])
            low = [n for n in names[1:] if (key, n) not in LOW_PRECISION_SKIPS]
            if key in case.low_precision_slow and key not in case.slow and low:
                cell += f", {'/'.join(low)} slow"
            for kind, table in (("no", case.low_precision_skips),
                                ("xfail", case.low_precision_xfails)):
                hit = [n for n in low if (key, n) in table]
                if hit:
                    label = f"no {'/'.join(hit)}" if kind == "no" else f"{'/'.join(hit)} xfail"
                    cell += f", {label} " + footnote(table[key, hit[0]])
            cells.append(cell)
        lines.append(f"| {title} (`{key}`) | {dtypes} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"[{i + 1}] {text}" + ("  " if i + 1 < len(footnotes) else "")
              for i, text in enumerate(footnotes)]
    return "\n".join(lines)
