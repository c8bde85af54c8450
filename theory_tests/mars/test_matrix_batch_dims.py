"""Stacks of matrices (issue 31, item 2): ``matrix_batch_dims`` in MARS-M and MARS.

transformers 5 stores MoE experts fused, e.g. Mixtral's ``gate_up_proj`` (E, 2I, H) and
``down_proj`` (E, H, I).  With ``matrix_batch_dims`` = k >= 1 on a group, a tensor of ndim
k + 2 is a stack of matrices, and each matrix is clipped (M3, M15), scaled (M12's
sqrt(max(1, A/B)), M17's 0.2 sqrt(max(A, B))) and orthogonalised (M13, M16) exactly as a
separate 2-D parameter; with k = 0 nothing changes.  Checked here:

- the oracle (``over_matrices``: an explicit loop over the matrices) against the port for
  MARS-M and MARS-Shampoo/AdamW/Lion, loop and foreach, 8 steps, with a k = 2 stack:
  float64 to 1e-12 (measured <= 2.7e-15), float32 to 1e-5 (measured 9.6e-7);
- THE TWIN: a stack trains exactly as its matrices as separate 2-D parameters fed the same
  gradient slices -- bit for bit for the elementwise rules, within 1e-15 where the batched
  Newton-Schulz (``baddbmm``) or SVD meets one matrix at a time (``addmm``): measured max
  |diff| 4.4e-16 (SVD 1.1e-16) over 6 steps on O(1) parameters; exact mode too; the
  compiled paths, which step a stack matrix by matrix, bit for bit, and the traced
  ``torch.compile(opt.step)`` within 4.4e-16 (both ``-m slow``);
- a tiny transformers Mixtral (float64) trained by MARS-M with its fused experts in a
  ``matrix_batch_dims=1`` group, against the same model whose experts' matrices are separate
  2-D parameters stepped on the stack's gradient slices;
- refusals (k = 0 is today's routing; bad values and ambiguous shapes raise naming the
  option), ``state_dict`` round trips, no host read added, and matrices of very different
  norms in one stack (the per-matrix clip and normalisation are not the stack's).
"""
import copy

import numpy as np
import pytest
import torch

from reference.common.matrix_functions import newton_schulz as ref_newton_schulz
from reference.common.matrix_functions import orthogonalize_svd as ref_svd
from reference.common.matrix_functions import over_matrices
from reference.mars.mars import MARSConfig, MARSReference
from reference.mars.mars_m import MARSMConfig, MARSMReference
from theory_tests.support.mars_property_helpers import F64, spy_on_scalar_reads
from torch_impl import MARS, MARSM, functional
from torch_impl.common.matrix_functions import newton_schulz, orthogonalize_svd
from torch_impl.mars import mars_equations

# Stacks: tall matrices, wide matrices, a k = 2 stack (in their own group), and a 1-D tensor.
TALL, WIDE, DEEP, BIAS = (4, 9, 5), (3, 4, 7), (2, 2, 3, 5), (6,)
STEPS = 8


def _matrix_scales(shape, k, lo=-3.0, hi=2.0):
    """Per-matrix gradient scales from 1e-3 to 1e2, broadcast over each matrix: the clip fires
    on some matrices of a stack only, and a whole-stack norm would differ from every one."""
    n = int(np.prod(shape[:k])) if k else 1
    return np.logspace(lo, hi, n).reshape(shape[:k] + (1,) * (len(shape) - k))


def _problem(shapes, ks, steps=STEPS, seed=0):
    """x0 and gradients g_t (NumPy float64) with per-matrix scales."""
    rng = np.random.default_rng(seed)
    x0 = [rng.normal(size=s) for s in shapes]
    grads = [[rng.normal(size=s) * _matrix_scales(s, k) for s, k in zip(shapes, ks)]
             for _ in range(steps)]
    return x0, grads


def _run_torch(make, x0, grads, dtype=F64):
    params = [torch.nn.Parameter(torch.tensor(x, dtype=dtype)) for x in x0]
    opt = make(params)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = torch.tensor(g, dtype=dtype)
        opt.step()
    return [p.detach().double().numpy() for p in params], opt


def _max_diff(xs, ys):
    return max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(xs, ys))


# ------------------------------------------------------------------ (a) oracle vs port

def _mars_m_oracle(x0, grads, k, **kw):
    rules = ["mars_m" if len(x.shape) == k + 2 else "adamw" for x in x0]
    opt = MARSMReference(x0, rules, MARSMConfig(lr=0.03, matrix_batch_dims=k, **kw))
    for gs in grads:
        xs = opt.step(gs)
    return xs


def _mars_m_port(x0, grads, k, dtype=F64, ns_dtype=F64, foreach=False, **kw):
    return _run_torch(lambda ps: MARSM([dict(params=ps, matrix_batch_dims=k)], lr=0.03,
                                       ns_dtype=ns_dtype, foreach=foreach, **kw),
                      x0, grads, dtype)[0]


MARS_M_CASES = {"approx": {}, "gamma-0.3": dict(gamma=0.3), "no-clip": dict(clip_c=False),
                "efficient": dict(efficient=True, clip_c=False)}


@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
@pytest.mark.parametrize("case", list(MARS_M_CASES))
def test_mars_m_stacks_match_the_oracle_float64(case, foreach):
    """k = 1: a tall and a wide stack and a 1-D tensor (the AdamW backup); k = 2: one deep
    stack.  The oracle loops over the matrices; the port runs each stack batched."""
    for shapes, k in (((TALL, WIDE, BIAS), 1), ((DEEP,), 2)):
        x0, grads = _problem(shapes, [k] * len(shapes))
        err = _max_diff(_mars_m_port(x0, grads, k, foreach=foreach, **MARS_M_CASES[case]),
                        _mars_m_oracle(x0, grads, k, **MARS_M_CASES[case]))
        assert err < 1e-12, (shapes, err)


def test_mars_m_stacks_match_the_oracle_float32():
    """float32 state and Newton-Schulz: ~1e-7 relative per step through NS's Lipschitz
    constant of a few over 8 steps; measured 1.2e-6 on O(1) iterates."""
    x0, grads = _problem((TALL, WIDE, BIAS), [1, 1, 1])
    err = _max_diff(_mars_m_port(x0, grads, 1, dtype=torch.float32, ns_dtype=torch.float32),
                    _mars_m_oracle(x0, grads, 1))
    assert err < 1e-5, err


def _mars_oracle(x0, grads, k, **kw):
    opt = MARSReference(x0, MARSConfig(lr=0.01, weight_decay=0.1, matrix_batch_dims=k, **kw))
    for gs in grads:
        xs = opt.step(gs)
    return xs


def _mars_port(x0, grads, k, dtype=F64, foreach=False, **kw):
    return _run_torch(lambda ps: MARS([dict(params=ps, matrix_batch_dims=k)], lr=0.01,
                                      weight_decay=0.1, ns_dtype=F64 if dtype == F64 else dtype,
                                      foreach=foreach, **kw), x0, grads, dtype)[0]


MARS_CASES = {
    "shampoo": dict(mars_type="mars-shampoo"),
    "shampoo-svd": dict(mars_type="mars-shampoo", orthogonalizer="svd"),
    "shampoo-global": dict(mars_type="mars-shampoo", clip_scope="global"),
    "shampoo-optimize-1d": dict(mars_type="mars-shampoo", optimize_1d=True),
    "adamw": dict(mars_type="mars-adamw"),
    "lion": dict(mars_type="mars-lion"),
}


@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
@pytest.mark.parametrize("case", list(MARS_CASES))
def test_mars_stacks_match_the_oracle_float64(case, foreach):
    for shapes, k in (((TALL, WIDE, BIAS), 1), ((DEEP,), 2)):
        x0, grads = _problem(shapes, [k] * len(shapes))
        err = _max_diff(_mars_port(x0, grads, k, foreach=foreach, **MARS_CASES[case]),
                        _mars_oracle(x0, grads, k, **MARS_CASES[case]))
        assert err < 1e-12, (shapes, err)


def test_mars_shampoo_stacks_match_the_oracle_float32():
    x0, grads = _problem((TALL, WIDE, BIAS), [1, 1, 1])
    err = _max_diff(_mars_port(x0, grads, 1, dtype=torch.float32, mars_type="mars-shampoo"),
                    _mars_oracle(x0, grads, 1, mars_type="mars-shampoo"))
    assert err < 1e-5, err


def test_without_the_option_a_3d_tensor_is_not_a_stack_in_oracle_and_port():
    """k = 0 (the default): a 3-D tensor takes the non-2-D fallback (M14) in both, and with
    ``optimize_1d`` the AdamW rule with one clip norm over the whole tensor."""
    shapes = ((3, 4, 5), (4, 6), BIAS)
    x0, grads = _problem(shapes, [1, 0, 0])
    for kw in (dict(mars_type="mars-shampoo"), dict(mars_type="mars-shampoo", optimize_1d=True)):
        assert _max_diff(_mars_port(x0, grads, 0, **kw), _mars_oracle(x0, grads, 0, **kw)) < 1e-12


def test_newton_schulz_and_svd_of_a_stack_are_each_matrix_s():
    """(M13, M11) on batches (..., A, B), tall and wide, one and two batch dims: the port's
    batched map equals the oracle's loop over the matrices; each matrix normalised by its own
    norm (norms from 1e-3 to 1e2 in one stack)."""
    rng = np.random.default_rng(3)
    for shape, k in ((TALL, 1), (WIDE, 1), (DEEP, 2)):
        stack = rng.normal(size=shape) * _matrix_scales(shape, k)
        expected = over_matrices(ref_newton_schulz, k, stack)
        got = newton_schulz(torch.tensor(stack), dtype=F64).numpy()
        assert np.abs(got - expected).max() < 1e-12
        got = orthogonalize_svd(torch.tensor(stack)).numpy()
        assert np.abs(got - over_matrices(ref_svd, k, stack)).max() < 1e-12


# ------------------------------------------------------------------ (b) the twin

def _twin_errors(make, shape, k, steps=6, seed=1):
    """Max |stack - separate matrices| after ``steps`` steps: ``make(groups)`` builds the
    optimizer; the stack is one parameter in a ``matrix_batch_dims=k`` group, the twin its
    matrices as 2-D parameters with the stack's values and gradient slices."""
    gen = torch.Generator().manual_seed(seed)
    stack = torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=F64))
    matrices = [torch.nn.Parameter(m.clone()) for m in stack.detach().reshape(-1, *shape[k:])]
    opt_stack = make([dict(params=[stack], matrix_batch_dims=k)])
    opt_twin = make([dict(params=matrices)])
    scales = torch.tensor(_matrix_scales(shape, k))
    for _ in range(steps):
        g = torch.randn(shape, generator=gen, dtype=F64) * scales
        stack.grad = g.clone()
        for m, gm in zip(matrices, g.reshape(-1, *shape[k:])):
            m.grad = gm.clone()
        opt_stack.step()
        opt_twin.step()
    twin = torch.stack([m.detach() for m in matrices]).reshape(shape)
    return (stack.detach() - twin).abs().max().item()


TWIN_CASES = {
    "mars-m-loop": (MARSM, dict(gamma=0.3, foreach=False), 1e-15),
    "mars-m-foreach": (MARSM, dict(gamma=0.3, foreach=True), 1e-15),
    "mars-m-efficient": (MARSM, dict(efficient=True, clip_c=False), 1e-15),
    "mars-m-no-clip": (MARSM, dict(clip_c=False, gamma=0.1), 1e-15),
    "shampoo-loop": (MARS, dict(mars_type="mars-shampoo", foreach=False), 1e-15),
    "shampoo-foreach": (MARS, dict(mars_type="mars-shampoo", foreach=True), 1e-15),
    "shampoo-svd": (MARS, dict(mars_type="mars-shampoo", orthogonalizer="svd"), 1e-15),
    # each matrix stored transposed (in x out): s of its true (out, in), as for 2-D Conv1D
    "shampoo-in-out": (MARS, dict(mars_type="mars-shampoo", shape_layout="in_out"), 1e-15),
    "adamw-loop": (MARS, dict(foreach=False), 0.0),
    "adamw-foreach": (MARS, dict(foreach=True), 0.0),
    "lion-foreach": (MARS, dict(mars_type="mars-lion", foreach=True), 0.0),
}


@pytest.mark.parametrize("shape,k", [(TALL, 1), (WIDE, 1), (DEEP, 2)],
                         ids=["tall", "wide", "two-batch-dims"])
@pytest.mark.parametrize("case", list(TWIN_CASES))
def test_a_stack_trains_as_its_matrices(case, shape, k):
    cls, kw, tol = TWIN_CASES[case]
    err = _twin_errors(lambda groups: cls(groups, lr=0.02, weight_decay=0.1, ns_dtype=F64,
                                          **kw), shape, k)
    assert err <= tol, err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_the_twin_holds_in_low_precision_newton_schulz(dtype):
    """The default bf16 Newton-Schulz (and float32): the batched and one-at-a-time products
    round alike to within that precision (measured: bf16 bit for bit, float32 1e-7)."""
    err = _twin_errors(lambda groups: MARSM(groups, lr=0.02, ns_dtype=dtype), TALL, 1)
    assert err < (1e-6 if dtype == torch.float32 else 1e-2), err


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mars-m", "mars-adamw", "mars-lion-group"])
def test_compiled_steps_a_stack_as_its_matrices(case):
    """The compiled kernels run a stack matrix by matrix (views of the stack): bit for bit,
    tall and wide (where 0.2 sqrt(max(A, B)) differs from the stack's 0.2 sqrt(max(E, A)))."""
    cls, kw = {"mars-m": (MARSM, dict(gamma=0.3, ns_dtype=F64)),
               "mars-adamw": (MARS, dict()),
               "mars-lion-group": (MARS, dict(mars_type="mars-lion", compiled="group"))}[case]
    kw.setdefault("compiled", True)
    for shape in (TALL, WIDE):
        assert _twin_errors(lambda groups: cls(groups, lr=0.02, **kw), shape, 1) == 0.0


@pytest.mark.parametrize("cls,kw", [(MARSM, {}), (MARS, dict(mars_type="mars-shampoo")),
                                    (MARS, dict(mars_type="mars-adamw"))],
                         ids=["mars-m", "shampoo", "adamw"])
def test_exact_mode_steps_a_stack_as_its_matrices(cls, kw):
    """Exact mode (M1, closure re-evaluated at x_{t-1}): the stack's previous gradient and
    previous iterate are its matrices' (measured 1.1e-16)."""
    w0 = torch.randn(TALL, dtype=F64, generator=torch.Generator().manual_seed(2))

    def run(stacked):
        if stacked:
            params = [torch.nn.Parameter(w0.clone())]
            opt = cls([dict(params=params, matrix_batch_dims=1)], is_approx=False, lr=0.02,
                      ns_dtype=F64, **kw)
        else:
            params = [torch.nn.Parameter(m.clone()) for m in w0]
            opt = cls(params, is_approx=False, lr=0.02, ns_dtype=F64, **kw)
        for t in range(4):
            def closure():
                opt.zero_grad()
                w = torch.stack(list(params)) if not stacked else params[0]
                loss = (torch.sin((t + 1) * w) * w).sum() * 10.0
                loss.backward()
                return loss
            opt.step(closure)
        return params[0].detach() if stacked else torch.stack([p.detach() for p in params])
    assert (run(True) - run(False)).abs().max() < 1e-15


@pytest.mark.slow
@pytest.mark.parametrize("cls,kw", [(MARSM, {}), (MARS, dict(mars_type="mars-shampoo")),
                                    (MARS, dict(mars_type="mars-adamw"))],
                         ids=["mars-m", "shampoo", "adamw"])
def test_a_traced_step_steps_a_stack_as_its_matrices(cls, kw):
    """``torch.compile(opt.step)`` with a stack against the traced step of its matrices as 2-D
    parameters (the traced step's scalars are float32 constants, so traced against eager
    differs by ~1e-8 in float64 for 2-D parameters too).  On the CPU the stack's clip runs
    matrix by matrix when traced (``_clip_each_matrix_``): Inductor's C++ backend cannot fuse
    a per-matrix norm with the in-place division of the stack.  Measured: 4.4e-16 (MARS-AdamW
    bit for bit)."""
    def make(groups):
        opt = cls(groups, lr=0.02, ns_dtype=F64, **kw)
        opt.step = torch.compile(opt.step)
        return opt
    assert _twin_errors(make, WIDE, 1, steps=3) < 1e-15


def test_the_oracle_steps_a_stack_as_its_matrices():
    """The oracle's own twin: ``over_matrices`` is the loop over separate matrices."""
    x0, grads = _problem((TALL,), [1])
    stack = _mars_m_oracle(x0, grads, 1)[0]
    separate = _mars_m_oracle(list(x0[0]), [list(gs[0]) for gs in grads], 0)
    assert np.array_equal(stack, np.stack(separate))
    stack = _mars_oracle(x0, grads, 1, mars_type="mars-shampoo")[0]
    separate = _mars_oracle(list(x0[0]), [list(gs[0]) for gs in grads], 0,
                            mars_type="mars-shampoo")
    assert np.array_equal(stack, np.stack(separate))


# ------------------------------------------------------------------ (c) a transformers Mixtral

def _mixtral():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32, attn_implementation="eager")
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).double()


def _other_params(model, experts):
    return [p for p in model.parameters() if all(p is not e for e in experts)]


def test_mixtral_experts_as_stacks_train_as_separate_matrices():
    """MARS-M on a tiny Mixtral: the fused experts (4, 48, 16) and (4, 16, 24) in a
    ``matrix_batch_dims=1`` group, the other matrices and gains in an ``"auto"`` group.  The
    twin: the same model whose experts are stepped as 8 separate 2-D parameters (clones fed
    the stack's gradient slices, written back after each step).  Measured max |diff| over 5
    steps: 0.0 here (bit for bit; the bound allows NS batched against one at a time to round
    differently, as it does on other shapes), on O(1) weights that move by 0.09."""
    model, twin = _mixtral(), _mixtral()
    experts = [model.model.layers[0].mlp.experts.gate_up_proj,
               model.model.layers[0].mlp.experts.down_proj]
    twin_experts = [twin.model.layers[0].mlp.experts.gate_up_proj,
                    twin.model.layers[0].mlp.experts.down_proj]
    options = dict(lr=0.02, ns_dtype=F64, gamma=0.1)
    opt = MARSM([dict(params=_other_params(model, experts)),
                 dict(params=experts, matrix_batch_dims=1)], **options)
    slices = [[torch.nn.Parameter(m.detach().clone()) for m in e] for e in twin_experts]
    opt_twin = MARSM([dict(params=_other_params(twin, twin_experts)),
                      dict(params=[m for s in slices for m in s])], **options)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        ids = torch.randint(0, 64, (2, 12), generator=gen)
        for m in (model, twin):
            m.zero_grad(set_to_none=True)
            m(input_ids=ids, labels=ids).loss.backward()
        for e, s in zip(twin_experts, slices):
            for m, g in zip(s, e.grad):
                m.grad = g.clone()
        opt.step()
        opt_twin.step()
        with torch.no_grad():
            for e, s in zip(twin_experts, slices):
                e.copy_(torch.stack([m.detach() for m in s]))
    diffs = [(a - b).abs().max().item() for a, b in zip(model.parameters(), twin.parameters())]
    moved = max((a - b).abs().max().item()
                for a, b in zip(model.parameters(), _mixtral().parameters()))
    assert max(diffs) < 1e-12 and moved > 1e-2, (max(diffs), moved)


# ------------------------------------------------------------------ (d) refusals and routing

def _params(*shapes):
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=F64)) for s in shapes]


def test_without_the_option_3d_under_auto_is_adamw_and_mars_m_refuses_it():
    params = _params((3, 4, 5), (4, 5))
    opt = MARSM(params)  # auto, matrix_batch_dims=0: today's routing
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert set(opt.state[params[0]]) == {"step", "moment1", "moment2"}
    assert set(opt.state[params[1]]) == {"step", "momentum_buffer", "last_grad"}
    with pytest.raises(ValueError, match=r"rule: 'mars_m' orthogonalizes matrices; got shapes "
                                         r"\[\(3, 4, 5\)\]"):
        MARSM([dict(params=_params((3, 4, 5)), rule="mars_m")])
    assert mars_equations.route((3, 4, 5), "mars-shampoo", False) == mars_equations.FALLBACK
    assert mars_equations.route((3, 4, 5), "mars-shampoo", False, 1) == mars_equations.SHAMPOO
    assert mars_equations.route((3, 4, 5), "mars-adamw", False, 1) == mars_equations.ADAMW
    assert mars_equations.route((5,), "mars-shampoo", True, 1) == mars_equations.ADAMW


@pytest.mark.parametrize("value", [-1, 1.0, True, "1", None])
@pytest.mark.parametrize("cls", [MARS, MARSM])
def test_a_bad_matrix_batch_dims_is_refused_naming_it(cls, value):
    with pytest.raises(ValueError, match=r"^matrix_batch_dims: expected an int >= 0"):
        cls(_params((2, 3, 4)), matrix_batch_dims=value)
    with pytest.raises(ValueError, match=r"^matrix_batch_dims: expected an int >= 0"):
        cls([dict(params=_params((2, 3, 4)), matrix_batch_dims=value)])


@pytest.mark.parametrize("shape", [(4, 5), (2, 3, 4, 5)], ids=["2-D", "4-D"])
@pytest.mark.parametrize("cls,kw", [(MARSM, {}), (MARS, dict(mars_type="mars-shampoo")),
                                    (MARS, dict(mars_type="mars-adamw"))],
                         ids=["mars-m", "shampoo", "adamw"])
def test_a_group_of_stacks_refuses_other_matrices_naming_the_shapes(cls, kw, shape):
    """k = 1: ndim 3 is a stack, ndim < 2 routes as usual, anything else is not guessed."""
    with pytest.raises(ValueError, match=r"matrix_batch_dims=1: .* got shapes \[" +
                       str(shape).replace("(", r"\(").replace(")", r"\)")):
        cls([dict(params=_params((3, 4, 5), shape, (5,)), matrix_batch_dims=1)], **kw)
    cls([dict(params=_params((3, 4, 5), (5,)), matrix_batch_dims=1)], **kw)  # fine


def test_rule_mars_m_with_stacks_needs_every_tensor_a_stack():
    with pytest.raises(ValueError, match=r"rule: 'mars_m' with matrix_batch_dims=1 .* "
                                         r"\[\(5,\), \(4, 5\)\]"):
        MARSM([dict(params=_params((3, 4, 5), (5,), (4, 5)), rule="mars_m",
                    matrix_batch_dims=1)])
    MARSM([dict(params=_params((5,), (4, 5)), rule="adamw", matrix_batch_dims=1)])  # elementwise


def test_a_group_changed_to_an_ambiguous_value_fails_before_any_change():
    """matrix_batch_dims is read from the group at each step; a value the group's shapes do
    not fit raises before any group has stepped."""
    params = _params((4, 5), (3, 4, 5))
    opt = MARSM([dict(params=params[:1]), dict(params=params[1:], matrix_batch_dims=1)])
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    opt.param_groups[1]["matrix_batch_dims"] = 2
    with pytest.raises(ValueError, match="matrix_batch_dims=2"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and not opt.state


def test_functional_api_takes_and_checks_matrix_batch_dims():
    p, g = (x.detach() for x in _params((3, 4, 5), (3, 4, 5)))
    buf, last = torch.zeros_like(p), torch.zeros_like(p)
    step = torch.tensor(0.0)
    with pytest.raises(ValueError, match=r"orthogonalises a matrix \(a stack of ndim 3"):
        functional.mars_m([p[0]], [g[0]], [buf[0]], [last[0]], [None], [None], [step], ["mars_m"],
                          lr=0.1, weight_decay=0.0, momentum=0.9, gamma=0.0,
                          matrix_batch_dims=1)
    with pytest.raises(ValueError, match="route 'mars_m' orthogonalises a matrix, got"):
        functional.mars_m([p], [g], [buf], [last], [None], [None], [step], ["mars_m"], lr=0.1,
                          weight_decay=0.0, momentum=0.9, gamma=0.0)
    assert step.item() == 0.0
    functional.mars_m([p], [g], [buf], [last], [None], [None], [step], ["mars_m"], lr=0.1,
                      weight_decay=0.0, momentum=0.9, gamma=0.0, matrix_batch_dims=1)
    assert step.item() == 1.0
    with pytest.raises(ValueError, match="matrix_batch_dims: expected an int >= 0"):
        functional.mars([p], [g], [buf], [None], [None], [last], [step], ["shampoo"], lr=0.1,
                        betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0, amsgrad=False,
                        gamma=0.0, lr_1d_factor=1.0, betas_1d=(0.9, 0.95),
                        weight_decay_1d=0.1, matrix_batch_dims=-1)


# ------------------------------------------------------------------ (e) state_dict

@pytest.mark.parametrize("cls,kw", [(MARSM, {}), (MARS, dict(mars_type="mars-shampoo"))],
                         ids=["mars-m", "shampoo"])
def test_state_dict_round_trip_keeps_the_option(cls, kw):
    x0, grads = _problem((TALL, BIAS), [1, 0], steps=6)

    def make(ps):
        return cls([dict(params=ps, matrix_batch_dims=1)], lr=0.02, ns_dtype=F64, **kw)
    straight, _ = _run_torch(make, x0, grads)
    half, opt = _run_torch(make, x0, grads[:3])
    saved = copy.deepcopy(opt.state_dict())
    assert saved["param_groups"][0]["matrix_batch_dims"] == 1
    params = [torch.nn.Parameter(torch.tensor(x)) for x in half]
    resumed = cls(params, lr=0.02, ns_dtype=F64, **kw)  # constructed without the option
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["matrix_batch_dims"] == 1
    for gs in grads[3:]:
        for p, g in zip(params, gs):
            p.grad = torch.tensor(g)
        resumed.step()
    assert _max_diff([p.detach().numpy() for p in params], straight) == 0.0


@pytest.mark.parametrize("cls", [MARSM, MARS])
def test_an_old_state_dict_without_the_option_loads_with_the_default(cls):
    x0, grads = _problem(((4, 5), BIAS), [0, 0], steps=4)
    straight, _ = _run_torch(lambda ps: cls(ps, lr=0.02), x0, grads)
    half, opt = _run_torch(lambda ps: cls(ps, lr=0.02), x0, grads[:2])
    saved = copy.deepcopy(opt.state_dict())
    del saved["param_groups"][0]["matrix_batch_dims"]  # a checkpoint from before the option
    params = [torch.nn.Parameter(torch.tensor(x)) for x in half]
    resumed = cls(params, lr=0.02)
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["matrix_batch_dims"] == 0
    for gs in grads[2:]:
        for p, g in zip(params, gs):
            p.grad = torch.tensor(g)
        resumed.step()
    assert _max_diff([p.detach().numpy() for p in params], straight) == 0.0


# ------------------------------------------------------------------ (f) per-matrix, not per-stack

def test_each_matrix_is_clipped_and_normalised_by_its_own_norm():
    """Two matrices of norms 1e-4 and 1e4 in one stack, one MARS-M step from zero momentum
    with gamma = 0: M_e = (1 - beta) g_e / max(1, ||g_e||), and the step of each matrix is
    -lr 0.2 sqrt(max(A, B)) NS(M_e) -- the small matrix's NS input is 1e-5, far above the
    1e-7 eps, so its step is a full-size orthogonal direction.  A clip or a normalisation by
    the stack's norm (1e4) would shrink it by 1e8 (NS of a matrix of norm 1e-9)."""
    g = torch.randn(2, 6, 4, dtype=F64, generator=torch.Generator().manual_seed(5))
    g = g / torch.linalg.vector_norm(g, dim=(-2, -1), keepdim=True)
    g[0] *= 1e-4
    g[1] *= 1e4
    p = torch.nn.Parameter(torch.zeros(2, 6, 4, dtype=F64))
    opt = MARSM([dict(params=[p], matrix_batch_dims=1)], lr=0.1, weight_decay=0.0, gamma=0.0,
                ns_dtype=F64)
    p.grad = g.clone()
    opt.step()
    for e in range(2):
        m = 0.05 * g[e] / max(1.0, torch.linalg.vector_norm(g[e]).item())
        expected = -0.1 * 0.2 * 6 ** 0.5 * newton_schulz(m, eps=1e-7, dtype=F64)
        torch.testing.assert_close(p.detach()[e], expected, rtol=0, atol=1e-14)
        assert torch.linalg.matrix_norm(p.detach()[e], ord=2) > 0.05  # not shrunk to nothing


@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
def test_the_per_matrix_clip_of_mars_adamw(foreach):
    """MARS-AdamW with a stack: the clip of (M3) divides each matrix by its own norm, so
    c~ = c / max(1, ||c_e||) matrix by matrix at step 1 (m = (1 - beta1) c~)."""
    g = torch.randn(3, 4, 5, dtype=F64, generator=torch.Generator().manual_seed(6))
    g *= torch.tensor([1e-2, 1.0, 1e2], dtype=F64).reshape(3, 1, 1)
    p = torch.nn.Parameter(torch.zeros(3, 4, 5, dtype=F64))
    opt = MARS([dict(params=[p], matrix_batch_dims=1)], foreach=foreach, gamma=0.0)
    p.grad = g.clone()
    opt.step()
    norms = torch.linalg.vector_norm(g, dim=(-2, -1), keepdim=True).clamp(min=1.0)
    torch.testing.assert_close(opt.state[p]["exp_avg"], 0.05 * g / norms, rtol=4e-15, atol=0)


@pytest.mark.parametrize("cls,kw", [(MARSM, {}), (MARS, dict(mars_type="mars-shampoo"))],
                         ids=["mars-m", "shampoo"])
def test_a_stack_adds_no_host_read(cls, kw, monkeypatch):
    """Every tensor-to-Python read in a step with stacks is a CPU step counter."""
    params = _params((3, 4, 5), (2, 5, 3), (5,))
    opt = cls([dict(params=params, matrix_batch_dims=1)], **kw)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    reads = spy_on_scalar_reads(monkeypatch)
    opt.step()
    monkeypatch.undo()
    counters = [opt.state[p]["step"] for p in params]
    assert reads and all(any(r is c for c in counters) for r in reads)
