"""Small runs of MARS, MARS-M and LAMB for the storage tests of issue 47
(``theory_tests/low_precision/test_state_storage.py``, ``test_state_rounding*.py``,
``test_kahan*.py``): every route of every optimizer that stores state, on a matrix, a vector
and a second matrix, with gradients drawn per step from a seeded generator."""
import torch

from torch_impl import LAMB, MARS, MARSM

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
SHAPES = [(6, 5), (5,), (4, 6)]

# name: factory(params, **options).  Together they take every route: MARS's AdamW / Lion /
# Shampoo rules on the matrices and the 1-D fallback (M14) on the vector, amsgrad, MARS-M's
# matrix rule, its efficient recursion and its AdamW backup, LAMB.  lr is large enough that a
# step moves a bf16 parameter.
OPTIMIZERS = {
    "mars-adamw": lambda ps, **kw: MARS(ps, **{**dict(lr=1e-2, gamma=0.1, weight_decay=0.1), **kw}),
    "mars-adamw-amsgrad-1d": lambda ps, **kw: MARS(ps, **{**dict(
        lr=1e-2, gamma=0.1, amsgrad=True, optimize_1d=True, clip_scope="global"), **kw}),
    "mars-lion": lambda ps, **kw: MARS(ps, **{**dict(lr=1e-2, gamma=0.1, mars_type="mars-lion"),
                                            **kw}),
    "mars-shampoo": lambda ps, **kw: MARS(ps, **{**dict(
        lr=1e-2, gamma=0.1, mars_type="mars-shampoo", ns_dtype=F32), **kw}),
    "mars-m": lambda ps, **kw: MARSM(ps, **{**dict(lr=1e-2, gamma=0.1, ns_dtype=F32), **kw}),
    "mars-m-efficient": lambda ps, **kw: MARSM(ps, **{**dict(
        lr=1e-2, gamma=0.1, efficient=True, ns_dtype=F32), **kw}),
    "lamb": lambda ps, **kw: LAMB(ps, **{**dict(lr=1e-2, weight_decay=0.1), **kw}),
}


def make_params(dtype, seed=0, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def clone(params, dtype=None):
    return [torch.nn.Parameter(p.detach().clone().to(dtype or p.dtype)) for p in params]


def grads(t, dtype, seed=0, shapes=SHAPES):
    """Step t's gradients in ``dtype`` (bf16 values widened when ``dtype`` is wider, so that a
    float32 run can take the very values a bf16 run takes)."""
    gen = torch.Generator().manual_seed(1000 * seed + t)
    return [(torch.randn(s, generator=gen) * (2.0 if t % 2 else 0.5)).to(BF16).to(dtype)
            for s in shapes]


def step(opt, params, gs):
    for p, g in zip(params, gs):
        p.grad = g.clone().to(p.dtype)
    opt.step()


def state_entries(opt, p):
    """p's floating state, ``step`` aside."""
    return {k: v for k, v in opt.state[p].items() if k != "step" and torch.is_tensor(v)}


def bits(t):
    """Bit patterns (-0.0 and 0.0 differ, as do NaN payloads)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().contiguous().view(ints[t.element_size()])


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))
