"""The compiled paths in the default run: one cheap case per option (issue 12 item 3).

``compiled=True`` runs the equation functions of ``mars_equations`` / ``mars_m_equations``
with the ``COMPILED`` ops table inside ``torch.compile``d kernels (``mars_compiled``,
``mars_m_compiled``), so each option has code of its own there: the AMSGrad maximum, the 1-D
fallback's weight decay (``weight_decay_1d_source``), the ``write_last`` flag of exact mode,
the negated gradients of ``maximize``, the Lion kernel, MARS-Shampoo's split (matrices eager,
the rest compiled), and MARS-M's matrix and backup kernels.  Each case below runs a few float64
steps of tiny tensors through the compiled path and through the single-tensor loop and asks for
the same iterates and state to a few ulps (Inductor may reassociate).

Cost: torch.compile on CPU pays seconds per graph, so the cases share graphs: every MARS case
uses the same shapes, and the options that only change numbers (the 1-D source, maximize) reuse
the kernels compiled for the others.  The exhaustive option grid stays under ``-m slow``
(``mars/test_fast_paths.py``, ``mars/test_mars_m_contract.py``).
"""
import pytest
import torch

from theory_tests.support.mars_harness import batches, initial_params, run_torch
from theory_tests.support.mars_property_helpers import F64, clone_params, feed, make_params
from torch_impl import MARS, MARSM

# a matrix (MARS rule), a 1-D and a 3-D tensor (the AdamW fallback, M14)
SHAPES = [(6, 5), (7,), (3, 2, 2)]
STEPS = 4


def _grads(t, shapes=SHAPES):
    """Gaussian gradients whose scale alternates 3 and 0.3: the clip fires on some steps and
    v shrinks on others, so AMSGrad's running max differs from v."""
    gen = torch.Generator().manual_seed(400 + t)
    return [torch.randn(s, generator=gen, dtype=F64) * (3.0 if t % 2 == 0 else 0.3)
            for s in shapes]


def _assert_same_run(a, opt_a, b, opt_b):
    """float64: a few ulps per step of O(1) quantities (Inductor's reassociation)."""
    for p, q in zip(a, b):
        torch.testing.assert_close(q, p, rtol=1e-13, atol=1e-15)
        assert opt_a.state[p].keys() == opt_b.state[q].keys()
        for key, value in opt_a.state[p].items():
            torch.testing.assert_close(opt_b.state[q][key], value, rtol=1e-13, atol=1e-15)


# weight_decay differs from weight_decay_1d in every case, so that a fallback decayed by the
# wrong source moves differently
MARS_CASES = {
    "amsgrad": dict(amsgrad=True, weight_decay=0.2, weight_decay_1d=0.05),
    "wd1d-constructor": dict(weight_decay_1d_source="constructor", weight_decay=0.3,
                             weight_decay_1d=0.05),
    "wd1d-group": dict(weight_decay_1d_source="group", weight_decay=0.3, weight_decay_1d=0.05),
    "maximize": dict(maximize=True, weight_decay=0.2),
    "adamw": dict(mars_type="mars-adamw", weight_decay=0.2),
    "lion": dict(mars_type="mars-lion", weight_decay=0.2),
    "shampoo": dict(mars_type="mars-shampoo", ns_dtype=F64, weight_decay=0.2),
}


@pytest.mark.parametrize("case", list(MARS_CASES))
def test_compiled_mars_option_equals_the_single_tensor_loop(case):
    kw = dict(lr=3e-2, gamma=0.3, lr_1d=1e-2, betas_1d=(0.8, 0.9), **MARS_CASES[case])
    a = make_params(SHAPES, 21)
    b = clone_params(a)
    opt_a, opt_b = MARS(a, foreach=False, **kw), MARS(b, compiled=True, **kw)
    for t in range(STEPS):
        grads = _grads(t)
        feed(opt_a, a, grads)
        feed(opt_b, b, grads)
    _assert_same_run(a, opt_a, b, opt_b)


def test_compiled_exact_mode_equals_the_single_tensor_loop():
    """Exact mode (closure, M1) compiled: the kernels run with ``write_last=False`` and the
    closure refills ``last_grad`` with grad f(x_{t-1}, xi_t) before each step."""
    kw = dict(lr=3e-2, gamma=0.3, is_approx=False, weight_decay=0.2)
    xis = batches(STEPS)
    _, a, opt_a = run_torch(lambda ps: MARS(ps, foreach=False, **kw), initial_params(), xis)
    _, b, opt_b = run_torch(lambda ps: MARS(ps, compiled=True, **kw), initial_params(), xis)
    _assert_same_run(a, opt_a, b, opt_b)


# One matrix and one backup tensor: each matrix shape compiles a graph of its own (several
# seconds with Newton-Schulz inside), so both cases share the shapes and the backup's graph.
MARS_M_SHAPES = [(3, 7), (5,)]
MARS_M_CASES = {
    "default": dict(gamma=0.3),
    "efficient": dict(efficient=True, clip_c=False, gamma=0.3),
}


@pytest.mark.parametrize("case", list(MARS_M_CASES))
def test_compiled_mars_m_equals_the_eager_loop(case):
    shapes = MARS_M_SHAPES
    kw = dict(lr=0.05, weight_decay=0.1, ns_dtype=F64, **MARS_M_CASES[case])
    a = make_params(shapes, 22)
    b = clone_params(a)
    opt_a, opt_b = MARSM(a, foreach=False, **kw), MARSM(b, compiled=True, **kw)
    for t in range(STEPS):
        grads = _grads(t, shapes)
        feed(opt_a, a, grads)
        feed(opt_b, b, grads)
    _assert_same_run(a, opt_a, b, opt_b)
