"""Issue 32 in the optimizers: ``ns_coefficients`` and ``orthogonalizer="gram_newton_schulz"``
for MARS-Shampoo (``MARS``) and MARS-M (``MARSM``), against the oracle in float64, and the
batching of same-shape matrices proved against the per-matrix path bit for bit (one group,
batched, against one group per matrix, where every call has one matrix)."""
import copy

import numpy as np
import pytest
import torch

from reference.mars.mars import MARSConfig, MARSReference
from reference.mars.mars_m import MARSMConfig, MARSMReference
from torch_impl import MARS, MARSM
from torch_impl.common import matrix_functions as T

F64 = torch.float64
SHAPES = [(6, 20), (6, 20), (20, 6), (6, 20), (9, 9), (20, 6), (7,)]  # wide, tall, square, bias
OPTIONS = {
    "polar-express": dict(ns_coefficients="polar_express"),
    "triple": dict(ns_coefficients=(3.0, -3.2, 1.2)),
    "sequence": dict(ns_coefficients=[(3.4445, -4.7750, 2.0315), (2.0, -1.5, 0.5)]),
    "gram": dict(orthogonalizer="gram_newton_schulz"),
    "gram-polar-express": dict(orthogonalizer="gram_newton_schulz",
                               ns_coefficients="polar_express"),
}


def _problem(steps=4, seed=0):
    rng = np.random.default_rng(seed)
    x0 = [rng.normal(size=s) for s in SHAPES]
    grads = [[rng.normal(size=s) * 10.0 ** rng.uniform(-2, 1) for s in SHAPES]
             for _ in range(steps)]
    return x0, grads


def _run(make, x0, grads, dtype=F64):
    params = [torch.nn.Parameter(torch.tensor(x, dtype=dtype)) for x in x0]
    opt = make(params)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = torch.tensor(g, dtype=dtype)
        opt.step()
    return params, opt


def _max_diff(params, xs):
    return max(float(np.abs(p.detach().numpy() - x).max()) for p, x in zip(params, xs))


@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_mars_m_options_match_the_oracle_float64(option, foreach):
    x0, grads = _problem()
    rules = ["mars_m" if x.ndim == 2 else "adamw" for x in x0]
    ref = MARSMReference(x0, rules, MARSMConfig(lr=0.03, gamma=0.3, **OPTIONS[option]))
    for gs in grads:
        xs = ref.step(gs)
    params, _ = _run(lambda ps: MARSM(ps, lr=0.03, gamma=0.3, ns_dtype=F64, foreach=foreach,
                                      **OPTIONS[option]), x0, grads)
    assert _max_diff(params, xs) < 1e-12


@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_mars_shampoo_options_match_the_oracle_float64(option, foreach):
    x0, grads = _problem()
    ref = MARSReference(x0, MARSConfig(lr=0.03, mars_type="mars-shampoo", **OPTIONS[option]))
    for gs in grads:
        xs = ref.step(gs)
    params, _ = _run(lambda ps: MARS(ps, lr=0.03, mars_type="mars-shampoo", ns_dtype=F64,
                                     foreach=foreach, **OPTIONS[option]), x0, grads)
    assert _max_diff(params, xs) < 1e-12


def _batched_and_per_matrix(cls, dtype=torch.float32, **kw):
    """One group (same-shape matrices batched) and one group per tensor (every call has one
    matrix): the same optimizer otherwise."""
    x0, grads = _problem(steps=3, seed=1)
    batched, _ = _run(lambda ps: cls(ps, lr=0.03, **kw), x0, grads, dtype)
    single, _ = _run(lambda ps: cls([dict(params=[p]) for p in ps], lr=0.03, **kw), x0, grads,
                     dtype)
    return batched, single


CASES = [(MARSM, dict(gamma=0.3)), (MARSM, dict(gamma=0.3, efficient=True, clip_c=False)),
         (MARS, dict(mars_type="mars-shampoo"))]


@pytest.mark.parametrize("option", ["authors", "gram-polar-express"])
@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
@pytest.mark.parametrize("cls,kw", CASES, ids=["mars-m", "mars-m-efficient", "mars-shampoo"])
def test_batching_same_shapes_is_the_per_matrix_step_bit_for_bit(cls, kw, foreach, option):
    calls = []
    original = T.newton_schulz

    def spy(M, *args, **kwargs):
        calls.append(tuple(M.shape))
        return original(M, *args, **kwargs)
    with pytest.MonkeyPatch.context() as mp:
        for module in ("torch_impl.mars.mars_m_equations", "torch_impl.mars.mars_equations",
                       "torch_impl.common.matrix_functions"):
            mp.setattr(f"{module}.newton_schulz", spy)
        batched, single = _batched_and_per_matrix(
            cls, foreach=foreach, **kw, **OPTIONS.get(option, {}))
    for a, b in zip(batched, single):
        assert torch.equal(a, b)
    if option == "authors":  # three (6, 20), two (20, 6): one call each per step (batched)
        assert calls.count((3, 6, 20)) == 3 and calls.count((2, 20, 6)) == 3


@pytest.mark.parametrize("option", ["authors", "gram-polar-express"])
def test_the_compiled_mars_m_batches_per_shape_as_the_eager_step(option):
    """``compiled=True``: one compiled call per shape group; equal to the eager batched step
    up to Inductor's fused reductions.  In float32 Newton-Schulz (bf16 would turn those
    last-bit differences into bf16 rounding flips) that is eps_f32 = 1.2e-7 through NS's
    Lipschitz constant of a few, over 3 steps, on O(1) parameters: bound 1e-5."""
    torch._dynamo.reset()
    x0, grads = _problem(steps=3, seed=2)
    kw = dict(lr=0.03, gamma=0.3, ns_dtype=torch.float32, **OPTIONS.get(option, {}))
    eager, _ = _run(lambda ps: MARSM(ps, **kw), x0, grads, torch.float32)
    compiled, _ = _run(lambda ps: MARSM(ps, compiled=True, **kw), x0, grads, torch.float32)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_gamma_zero_mars_m_with_polar_express_is_torch_muon_with_its_coefficients():
    """Muon takes one triple; MARS-M at gamma = 0 (no clip) with that triple is Muon."""
    x0, grads = _problem(steps=3, seed=3)
    mats = [i for i, x in enumerate(x0) if x.ndim == 2]
    x0, grads = [x0[i] for i in mats], [[g[i] for i in mats] for g in grads]
    triple = (3.0, -3.2, 1.2)
    ours, _ = _run(lambda ps: MARSM(ps, lr=0.03, gamma=0.0, clip_c=False, weight_decay=0.1,
                                    ns_coefficients=triple), x0, grads, torch.float32)
    muon, _ = _run(lambda ps: torch.optim.Muon(ps, lr=0.03, weight_decay=0.1, momentum=0.95,
                                               nesterov=False, ns_coefficients=triple,
                                               adjust_lr_fn="match_rms_adamw"),
                   x0, grads, torch.float32)
    for a, b in zip(ours, muon):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cls,kw", [(MARSM, {}), (MARS, dict(mars_type="mars-shampoo"))])
def test_bad_options_are_refused_naming_them(cls, kw):
    p = [torch.nn.Parameter(torch.zeros(4, 8))]
    for bad, name in ((dict(ns_coefficients="chebyshev"), "ns_coefficients"),
                      (dict(ns_coefficients=(1.0, 2.0)), "ns_coefficients"),
                      (dict(ns_coefficients=(1.0, float("nan"), 2.0)), "ns_coefficients"),
                      (dict(orthogonalizer="qr"), "orthogonalizer"),
                      (dict(orthogonalizer="gram_newton_schulz", ns_dtype=torch.float16),
                       "orthogonalizer")):
        with pytest.raises(ValueError, match=name):
            cls(p, **kw, **bad)
        opt = cls(p, **kw)
        with pytest.raises(ValueError, match=name):
            opt.add_param_group(dict(params=[torch.nn.Parameter(torch.zeros(3, 3))], **bad))


@pytest.mark.parametrize("cls,kw", [(MARSM, {}), (MARS, dict(mars_type="mars-shampoo"))])
def test_the_options_are_group_hyperparameters_kept_by_state_dict(cls, kw):
    x0, grads = _problem(steps=2, seed=4)
    options = OPTIONS["gram-polar-express"]
    params, opt = _run(lambda ps: cls(ps, lr=0.03, **kw, **options), x0, grads, torch.float32)
    state = copy.deepcopy(opt.state_dict())
    assert all(g["ns_coefficients"] == "polar_express" and
               g["orthogonalizer"] == "gram_newton_schulz" for g in state["param_groups"])
    fresh = cls([torch.nn.Parameter(p.detach().clone()) for p in params], lr=0.03, **kw)
    fresh.load_state_dict(state)
    assert fresh.param_groups[0]["ns_coefficients"] == "polar_express"
    old = copy.deepcopy(state)  # a checkpoint from before the options: the defaults
    for g in old["param_groups"]:
        del g["ns_coefficients"]
        if cls is MARSM:
            del g["orthogonalizer"]
    fresh.load_state_dict(old)
    fresh.__setstate__(fresh.__dict__)
    assert fresh.param_groups[0]["ns_coefficients"] == "authors"
