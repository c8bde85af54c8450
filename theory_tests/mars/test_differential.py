"""Differential tests: ``torch_impl.MARS`` against the NumPy float64 oracle ``reference.mars.mars``.

Every mars_type x clip scope x approx/exact x optimize_1d x foreach, 20 steps, on a parameter
set mixing 1-D, 2-D (wide and tall) and 4-D tensors.  float64 must agree to 1e-12 (only
summation order differs); float32 to the tolerance stated below.
"""
import itertools

import numpy as np
import pytest
import torch

from theory_tests.support.mars_harness import batches, grad_oracle, initial_params, run_torch
from reference.mars.mars import MARSConfig, mars_trajectory
from torch_impl import MARS

STEPS = 20
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05, gamma=0.1, lr_1d=5e-3,
             betas_1d=(0.85, 0.95), weight_decay_1d=0.1)


def configs():
    for mars_type, scope, approx, opt1d in itertools.product(
            ("mars-adamw", "mars-lion", "mars-shampoo"), ("tensor", "global", "none"),
            (True, False), (False, True)):
        yield dict(mars_type=mars_type, clip_scope=scope, is_approx=approx, optimize_1d=opt1d)


def _compare(cfg, foreach, dtype, device, rtol, atol, extra=None):
    extra = extra or {}
    x0, xis = initial_params(), batches(STEPS)
    ref_cfg = MARSConfig(**HYPER, **cfg, **{k: v for k, v in extra.items() if k != "ns_dtype"})
    expected = mars_trajectory(x0, grad_oracle, xis, ref_cfg)
    ns_dtype = extra.get("ns_dtype", torch.float64)
    kw = {k: v for k, v in extra.items() if k != "ns_dtype"}
    got, _, _ = run_torch(lambda ps: MARS(ps, **HYPER, **cfg, **kw, ns_dtype=ns_dtype,
                                          foreach=foreach), x0, xis, dtype=dtype, device=device)
    for t, (xs_ref, xs_got) in enumerate(zip(expected, got)):
        for i, (r, g) in enumerate(zip(xs_ref, xs_got)):
            np.testing.assert_allclose(g, r, rtol=rtol, atol=atol,
                                       err_msg=f"step {t}, tensor {i}, {cfg}, foreach={foreach}")


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("cfg", list(configs()), ids=lambda c: "-".join(str(v) for v in c.values()))
def test_float64_matches_reference(cfg, foreach, device):
    _compare(cfg, foreach, torch.float64, device, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("extra", [dict(amsgrad=True), dict(orthogonalizer="svd"),
                                   dict(weight_decay_1d_source="group"), dict(ns_steps=3)],
                         ids=["amsgrad", "svd", "wd1d-group", "ns3"])
@pytest.mark.parametrize("mars_type", ["mars-adamw", "mars-shampoo"])
def test_float64_options_match_reference(extra, mars_type, device):
    # amsgrad reaches MARS-Shampoo only through the AdamW rule of its non-2-D tensors
    optimize_1d = mars_type == "mars-shampoo" and "amsgrad" in extra
    for approx in (True, False):
        _compare(dict(mars_type=mars_type, clip_scope="tensor", is_approx=approx,
                      optimize_1d=optimize_1d), False, torch.float64, device, 1e-12, 1e-12, extra)


# float32: each step perturbs the iterate by O(1e-7) relative rounding, amplified at most by
# the Adam denominator (|u| <= 1/(1-beta1) per coordinate) and by lr: after 20 steps of lr 1e-2
# the drift stays below 2e-5 absolute.  Lion is excluded because a rounding-sized change of an
# m_i near 0 may flip sign(m_i), a discrete change of 2 lr that is not a tolerance question.
@pytest.mark.parametrize("mars_type", ["mars-adamw", "mars-shampoo"])
@pytest.mark.parametrize("approx", [True, False])
def test_float32_within_stated_tolerance(mars_type, approx, device):
    cfg = dict(mars_type=mars_type, clip_scope="tensor", is_approx=approx, optimize_1d=False)
    _compare(cfg, False, torch.float32, device, rtol=0, atol=2e-5,
             extra=dict(ns_dtype=torch.float32))


def test_bfloat16_newton_schulz_within_its_precision(device):
    """Official default ns_dtype=bfloat16: 8 mantissa bits, so each Shampoo step's direction
    carries ~1e-2 relative error; after 20 steps of lr 1e-2 the iterates stay within 20 * lr *
    s * 2e-2 ~ 5e-3 of the float64 oracle."""
    cfg = dict(mars_type="mars-shampoo", clip_scope="tensor", is_approx=True, optimize_1d=False)
    _compare(cfg, False, torch.float64, device, rtol=0, atol=5e-3,
             extra=dict(ns_dtype=torch.bfloat16))
