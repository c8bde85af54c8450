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
# paper_notes/conformance.md (``applicability_table``).
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
    "compile": "5. torch.compile(opt.step) equals eager (float32)",
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

    def kwargs(self, **overrides):
        return {**self.hyper, **overrides}

    def make(self, model, params=None, **overrides):
        """The optimizer over ``params`` (default: every parameter of ``model``)."""
        params = list(model.parameters()) if params is None else params
        return self.factory(model, params, **self.kwargs(**overrides))

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
}

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
    "sgd_complex": "within 1e-14 relative, not bit-identical: SGD steps the complex tensor, "
                   "whose complex-by-real products round differently from the real view's "
                   "(measured 1 ulp)",
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
         rejects=frozenset({"complex", "sparse"}),
         skips={**MARS_SKIPS, "state_dtype": WHY["no_state_dtype"]}),
    Case(name="lamb", family="first_order", factory=_first_order(LAMB),
         hyper=dict(lr=1e-2, weight_decay=1e-2),
         bad_hyper=(({"lr": -1.0}, LR_NAMED), ({"betas": (1.5, 0.999)}, r"betas")),
         rejects=frozenset({"sparse"}),
         skips={**FIRST_ORDER_ONLY, "state_dtype": WHY["no_state_dtype"],
                "complex_refused": WHY["complex_supported"]}),
    Case(name="sgd_reference", family="preconditioner",
         factory=lambda model, params, **kw: torch.optim.SGD(params, **kw),
         hyper=dict(lr=0.1, momentum=0.9), reference=True, momentum_key="momentum",
         bad_hyper=(({"lr": -1.0}, TORCH_LR), ({"momentum": -0.5}, r"momentum")),
         frozen=("gain",), slow=COMPILE_SLOW, complex_exact=False, notes=PRECONDITIONER_NOTES,
         skips={**{k: v for k, v in PRECONDITIONER_SKIPS.items() if k != "copy"},
                "copy_refused": "SGD is a plain optimizer: it copies (behaviour copy)"}),
    Case(name="mkor", family="preconditioner", factory=_preconditioned(MKOR),
         hyper=dict(lr=0.1, momentum=0.9, inv_freq=1), momentum_key="momentum",
         bad_hyper=(({"lr": -1.0}, TORCH_LR), ({"inv_freq": 0}, r"inv_freq")),
         frozen=("gain",), scaler_keyword=True, slow=COMPILE_SLOW, complex_exact=False,
         skips=dict(PRECONDITIONER_SKIPS), notes=PRECONDITIONER_NOTES),
    Case(name="kfac", family="preconditioner", factory=_preconditioned(KFAC),
         hyper=dict(lr=0.1, momentum=0.9, inv_freq=1, factor_freq=1), momentum_key="momentum",
         bad_hyper=(({"lr": -1.0}, TORCH_LR), ({"damping": 0.0}, r"damping")),
         frozen=("gain",), scaler_keyword=True, slow=COMPILE_SLOW, complex_exact=False,
         skips=dict(PRECONDITIONER_SKIPS), notes=PRECONDITIONER_NOTES),
]

BY_NAME = {case.name: case for case in CASES}


def cases_for(behaviour):
    """pytest params (id = the case's name) of every case that takes part in ``behaviour``;
    a case listed as slow for it carries ``pytest.mark.slow``."""
    return [pytest.param(case, id=case.name,
                         marks=[pytest.mark.slow] if behaviour in case.slow else [])
            for case in CASES if case.applies(behaviour)]


def applicability_table():
    """The behaviour x case table of paper_notes/conformance.md (Markdown): "✓" where the case
    runs the behaviour's test ("✓ slow": under ``-m slow``; "✓ [n]": with the documented
    difference n), else "N/A [n]" with n the reason (``WHY``, or the case's own words)."""
    footnotes, lines = [], []

    def footnote(text):
        if text not in footnotes:
            footnotes.append(text)
        return f"[{footnotes.index(text) + 1}]"

    lines += ["| behaviour | " + " | ".join(c.name for c in CASES) + " |",
              "|" + "---|" * (len(CASES) + 1)]
    for key, title in BEHAVIOURS.items():
        cells = []
        for case in CASES:
            if not case.applies(key):
                cells.append("N/A " + footnote(case.skips[key]))
                continue
            cell = "✓ slow" if key in case.slow else "✓"
            if key in case.notes:
                cell += " " + footnote(case.notes[key])
            cells.append(cell)
        lines.append(f"| {title} (`{key}`) | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"[{i + 1}] {text}" + ("  " if i + 1 < len(footnotes) else "")
              for i, text in enumerate(footnotes)]
    return "\n".join(lines)
