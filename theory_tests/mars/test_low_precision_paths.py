"""foreach=True equals foreach=False bit for bit on the CPU in bf16 and fp16 (issue 30, item 4),
for every rule: MARS (AdamW, Lion, Shampoo, the 1-D fallback, amsgrad, each clip scope, exact
mode), MARS-M (matrix, efficient, the AdamW backup, exact mode) and LAMB.

Why it holds, and why it did not: the two paths run the same equations with the same
scalars, and the CPU foreach kernels run per tensor, so they round alike -- except that
``torch._foreach_mul_(xs, number)`` on the CPU multiplies bf16 / fp16 tensors by the number
*rounded to their dtype* (its per-tensor fallback is C++ ``Tensor::mul_(Scalar)``, which puts
the scalar first and so misses the kernel that keeps it in float32), where ``x.mul_(number)``
multiplies by the float32 number and rounds once.  0.997 (1 - lr wd here) is 0.99609375 in
bf16, 0.95 is 0.94921875: measured before the fix over 40 draws of 4 steps, the parameters and
states were up to 4.6 ulps of a tensor's largest entry apart (MARS-AdamW 4.0 in fp16, 1.0 in
bf16; MARS-M 4.6; LAMB 4.0), every rule but a float32 state_dtype's.  ``scalar_operand`` hands the
foreach kernel a 0-d float64 tensor instead, which takes the Tensor overload and multiplies
as the loop does.  float64 and float32 are unaffected (MT20 and the differential tests run
float64).

The hyperparameters are chosen so that every scalar an in-place multiply uses (1 - lr wd,
beta2, MARS-M's beta, LAMB's beta1, the fallback's 0.95) is not a bf16 / fp16 number: a path
that rounds one of them differently is seen.  Three seeds, four closure-driven steps on five
tensors (2-D, 1-D, 3-D; gradient scales 0.05 to 5, so the clip both acts and does not).
"""
import pytest
import torch

from torch_impl import MARS, MARSM
from torch_impl.baselines import LAMB

SHAPES = [(5, 3), (4, 4), (3,), (2, 3, 2), (1, 6)]
SEEDS = (0, 1, 2)
STEPS = 4
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}

MARS_HYPER = dict(lr=1e-2, weight_decay=0.3, betas=(0.9, 0.99), gamma=0.1, eps=1e-4)
MARS_M_HYPER = dict(lr=1e-2, weight_decay=0.3, momentum=0.95, gamma=0.1, adamw_eps=1e-4)

# rule -> factory(params, foreach): every route of every optimizer the project steps.
RULES = {
    "mars-adamw": lambda ps, fe: MARS(ps, foreach=fe, **MARS_HYPER),  # + the 1-D fallback
    "mars-adamw-amsgrad-1d-noclip": lambda ps, fe: MARS(
        ps, foreach=fe, amsgrad=True, optimize_1d=True, clip_scope="none", **MARS_HYPER),
    "mars-adamw-global": lambda ps, fe: MARS(ps, foreach=fe, clip_scope="global", **MARS_HYPER),
    "mars-adamw-exact-maximize": lambda ps, fe: MARS(ps, foreach=fe, is_approx=False,
                                                     maximize=True, **MARS_HYPER),
    "mars-adamw-state-f32": lambda ps, fe: MARS(ps, foreach=fe, state_dtype=torch.float32,
                                                **MARS_HYPER),
    "mars-lion": lambda ps, fe: MARS(ps, foreach=fe, mars_type="mars-lion", optimize_1d=True,
                                     clip_scope="global", **MARS_HYPER),
    "mars-shampoo": lambda ps, fe: MARS(ps, foreach=fe, mars_type="mars-shampoo",
                                        optimize_1d=True, amsgrad=True, **MARS_HYPER),
    "mars-m": lambda ps, fe: MARSM(ps, foreach=fe, **MARS_M_HYPER),  # + the AdamW backup
    "mars-m-efficient": lambda ps, fe: MARSM(ps, foreach=fe, efficient=True, clip_c=False,
                                             **MARS_M_HYPER),
    "mars-m-exact-noclip": lambda ps, fe: MARSM(ps, foreach=fe, is_approx=False, clip_c=False,
                                                **MARS_M_HYPER),
    "lamb": lambda ps, fe: LAMB(ps, foreach=fe, lr=1e-2, weight_decay=0.1, eps=1e-4),
    "lamb-maximize-wd0": lambda ps, fe: LAMB(ps, foreach=fe, lr=1e-2, eps=1e-4, maximize=True),
}


def bits(t):
    """Bit patterns (-0.0 and 0.0 differ)."""
    return t.contiguous().view(_INT[t.element_size()]) if t.is_floating_point() else t


def run(rule, dtype, seed, foreach):
    """STEPS closure-driven steps of a quadratic loss sum(a p + b p^2 / 2) whose coefficients
    are drawn per step (so the gradient depends on p: exact mode's x_{t-1} evaluation is a
    different gradient)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype))
              for s in SHAPES]
    start = [p.detach().clone() for p in params]
    opt = RULES[rule](params, foreach)
    for t in range(STEPS):
        scale = (0.05, 1.0, 5.0)[(seed + t) % 3]
        a = [(torch.randn(s, generator=gen, dtype=torch.float64) * scale).to(dtype)
             for s in SHAPES]
        b = [torch.rand(s, generator=gen, dtype=torch.float64).to(dtype) for s in SHAPES]

        def closure():
            opt.zero_grad(set_to_none=True)
            loss = sum((ai * p + 0.5 * bi * p * p).sum() for ai, bi, p in zip(a, b, params))
            loss.backward()
            return loss
        opt.step(closure)
    assert all(not torch.equal(p, q) for p, q in zip(params, start))  # every tensor moved
    return params, opt


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("rule", sorted(RULES))
def test_foreach_equals_the_loop_bit_for_bit_in_low_precision(rule, dtype):
    """Parameters and every state tensor bit-identical between foreach=True and foreach=False,
    bf16 / fp16 parameters, three seeds."""
    for seed in SEEDS:
        (ps_fe, opt_fe), (ps_loop, opt_loop) = (run(rule, DTYPES[dtype], seed, fe)
                                                for fe in (True, False))
        for i, (p, q) in enumerate(zip(ps_fe, ps_loop)):
            assert p.dtype == q.dtype == DTYPES[dtype]
            assert torch.equal(bits(p.detach()), bits(q.detach())), \
                f"seed {seed}, parameter {i} {tuple(p.shape)}: max |diff| " \
                f"{(p.double() - q.double()).abs().max().item():.3g}"
            st_fe, st_loop = opt_fe.state[p], opt_loop.state[q]
            assert st_fe.keys() == st_loop.keys()
            for key, value in st_fe.items():
                if torch.is_tensor(value):
                    assert torch.equal(bits(value), bits(st_loop[key])), \
                        f"seed {seed}, parameter {i}, state {key!r}"
                else:
                    assert value == st_loop[key], key


def test_the_foreach_multiply_keeps_its_number_in_float32():
    """The root cause, pinned: ``FOREACH.mul_`` equals ``SINGLE.mul_`` in bf16 / fp16 (a
    multiply by the float32 number, one rounding) where torch's own
    ``torch._foreach_mul_(xs, number)`` rounds the number to the tensors' dtype first on the
    CPU (if torch changes that, the second assertion tells us and ``scalar_operand`` can go)."""
    from torch_impl.common.tensor_ops import FOREACH, SINGLE
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES.values():
        xs = [torch.randn(64, generator=gen).to(dtype) for _ in range(3)]
        loop = [SINGLE.mul_(x.clone(), 0.997) for x in xs]
        assert all(torch.equal(a, b) for a, b in zip(FOREACH.mul_([x.clone() for x in xs], 0.997),
                                                     loop))
        torchs = [x.clone() for x in xs]
        torch._foreach_mul_(torchs, 0.997)
        assert not all(torch.equal(a, b) for a, b in zip(torchs, loop))
