"""The fused experts' rows are recomputed with the arithmetic their forward really ran
(issue 45; ``torch_impl/kronecker/experts/arithmetic.py``, ``recompute.py``): the dtypes are
read from the forward itself, the recomputed rows are the rows the forward's products
multiplied (captured by a dispatch-mode recorder around the real forward,
``theory_tests/support/expert_products.py``), and their statistics are those rows'.

Cases (transformers 5.25, tiny configs, ``theory_tests/support/moe_models.py``): the default
``grouped_mm`` of a float32 Mixtral / Qwen2-MoE under CPU bf16 autocast (float32 rows: the
grouped mm is not autocast), the eager loop under autocast (bf16 rows), ``batched_mm`` of the
privacy filter under autocast (bf16 rows, the bias added in place), and the float64 models
whose own forwards compute in float32 somewhere: the privacy filter (float32 products and
accumulator), Inkling2 (a float32 accumulator), NemotronH (none: all float64)."""
import pytest
import torch

pytest.importorskip("transformers")

from theory_tests.support.expert_products import record_products  # noqa: E402
from theory_tests.support.moe_twin import build_twin  # noqa: E402
from theory_tests.support.moe_models import (  # noqa: E402
    distinct_ids, experts_of, loss_of, tiny_moe)
from torch_impl import MKOR  # noqa: E402
from torch_impl.kronecker.experts.arithmetic import Product, observe  # noqa: E402
from torch_impl.kronecker.experts.transformers import (  # noqa: E402
    bind_expert_inputs, expert_projections, expert_rows, observe_arithmetic)

f32, f64, bf16 = torch.float32, torch.float64, torch.bfloat16

# (family, experts implementation, model dtype, bf16 autocast) -> what the forward computes
# in: {projection: Product}, accumulator; measured from transformers 5.25's code (module
# docstring of arithmetic.py says where each comes from)
CASES = {
    ("mixtral", "grouped_mm", f32, True): ({"gate_up_proj": Product(f32),
                                            "down_proj": Product(f32)}, f32),
    ("qwen2_moe", "grouped_mm", f32, True): ({"gate_up_proj": Product(f32),
                                              "down_proj": Product(f32)}, f32),
    ("mixtral", "eager", f32, True): ({"gate_up_proj": Product(bf16, per_expert=True),
                                       "down_proj": Product(bf16, per_expert=True)}, f32),
    ("openai_privacy_filter", "batched_mm", f32, True): (
        {"gate_up_proj": Product(bf16, f32, bf16), "down_proj": Product(bf16, f32, bf16)},
        bf16),
    ("openai_privacy_filter", "eager", f64, False): (
        {"gate_up_proj": Product(f32, f32, f32, per_expert=True),
         "down_proj": Product(f32, f32, f32, per_expert=True)}, f32),
    ("inkling2", "eager", f64, False): ({"gate_up_proj": Product(f64, per_expert=True),
                                         "down_proj": Product(f64, per_expert=True)}, f32),
    ("nemotron_h", "eager", f64, False): ({"up_proj": Product(f64, per_expert=True),
                                           "down_proj": Product(f64, per_expert=True)}, f64),
}
IDS = [f"{f}-{i}-{str(d)[6:]}{'-amp' if a else ''}" for f, i, d, a in CASES]


def _run(family, implementation, dtype, amp, seed=0):
    """One forward and backward: per experts module, the call's inputs, the arithmetic read
    in the forward hook, the output's gradient, and the products the forward ran."""
    model = tiny_moe(family, implementation, dtype)
    calls, removers = [], []
    for _, module in experts_of(model):
        recorder, remove = record_products(module)
        call = {"module": module, "recorder": recorder}

        def hook(mod, args, kwargs, output, call=call):
            call["inputs"] = bind_expert_inputs(mod, args, kwargs)
            call["arithmetic"] = observe_arithmetic(mod, *call["inputs"])
            output.register_hook(lambda g: call.__setitem__("grad", g))
        removers += [module.register_forward_hook(hook, with_kwargs=True).remove, remove]
        calls.append(call)
    with torch.autocast("cpu", dtype=bf16, enabled=amp):
        loss = loss_of(model, distinct_ids(seed))
        for call in calls:
            call["recorder"].hook_gradients()
    loss.float().backward()
    for remove in removers:
        remove()
    return model, calls


@pytest.mark.parametrize("case", list(CASES), ids=IDS)
def test_the_forward_is_read_as_it_ran(case):
    """The arithmetic read in the forward hook is the implementation's: the products' dtype
    (float32 for grouped_mm under bf16 autocast, float32 for the privacy filter's float64
    forward), the bias add's (batched_mm's in place: rounded to bf16), the structure (one
    expert's matrix at a time, or a stack) and the accumulator (Inkling2's float32)."""
    products, accumulator = CASES[case]
    _, calls = _run(*case)
    for call in calls:
        assert call["arithmetic"].products == products, call["arithmetic"]
        assert call["arithmetic"].accumulator == accumulator, call["arithmetic"]


def _unit(dtype):
    return torch.finfo(dtype).eps / 2


def _row_errors(recomputed, forward):
    """max over rows of |recomputed - forward|_inf / |forward|_inf, each recomputed row paired
    with the forward's nearest one (distinct tokens: an expert's rows are told apart)."""
    a_r, g_r = (t.double() for t in recomputed)
    a_f, g_f = (t.double() for t in forward)
    nearest = (a_r[:, None, :] - a_f[None]).abs().amax(-1).argmin(1)
    assert nearest.unique().numel() == nearest.numel(), "two rows paired with one"
    scale = (lambda t: t.abs().amax(1).clamp(min=torch.finfo(f64).tiny))
    a_m, g_m = a_f[nearest], g_f[nearest]
    return (((a_r - a_m).abs().amax(1) / scale(a_m)).max().item(),
            ((g_r - g_m).abs().amax(1) / scale(g_m)).max().item())


@pytest.mark.parametrize("case", list(CASES), ids=IDS)
def test_the_recomputed_rows_are_the_rows_the_forward_multiplied(case):
    """Each projection's recomputed (a, g), expert by expert, against the operands and result
    gradients of the forward's own products: the same dtype (but where autocast cast the
    rows: a is then the rows before its cast, every layer's convention under autocast, and
    equals the operand once rounded to it); bit for bit where the forward multiplied one
    expert at a time (the eager loops, float64 included) and where it multiplied in bf16;
    within 16 unit roundoffs of the product's dtype per row (relative to the row's largest
    entry) where a stack was multiplied in float32 (another kernel than the per-expert
    product: measured <= 5.4 u)."""
    products, _ = CASES[case]
    _, calls = _run(*case)
    for call in calls:
        module = call["module"]
        projections = [(n, p.weight, p.transposed) for n, p in expert_projections(module)]
        forward = call["recorder"].rows(projections)
        with torch.autocast("cpu", dtype=bf16, enabled=case[3]):
            _, expert, rows = expert_rows(module, *call["inputs"], call["grad"],
                                          call["arithmetic"])
        for (name, _, _), (a, g) in zip(projections, rows):
            product = products[name]
            exact = product.per_expert or product.dtype == bf16
            assert sorted(forward[name]) == sorted(expert.unique().tolist())
            autocast_cast = case[3] and product.dtype == bf16
            for e, (a_f, g_f) in forward[name].items():
                pick = expert == e
                assert g.dtype == g_f.dtype, (name, g.dtype, g_f.dtype)
                if not autocast_cast:
                    assert a.dtype == a_f.dtype, (name, a.dtype, a_f.dtype)
                elif name == projections[0][0]:  # the up projection's: the module's input
                    assert a.dtype == call["inputs"][0].dtype, (name, a.dtype)
                err_a, err_g = _row_errors((a[pick].to(a_f.dtype), g[pick]), (a_f, g_f))
                bound = 0.0 if exact else 16 * _unit(product.dtype)
                assert err_a <= bound and err_g <= bound, (name, e, err_a, err_g)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_under_bf16_autocast_the_default_experts_give_the_float32_rows_statistics(family):
    """A float32 model with transformers' default experts implementation (grouped_mm) under
    bf16 autocast multiplies float32 rows; MKOR's captured per-expert a_bar (the rows' mean)
    and g_bar (their sum) equal those of the rows the forward multiplied, to float32
    rounding: measured <= 1.8e-7 relative to the largest entry (rows recomputed in bf16, as
    before issue 45: up to 6.7e-3)."""
    model = tiny_moe(family, None, f32)
    (name, module), = experts_of(model)
    recorder, remove = record_products(module)
    mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1), inv_freq=1,
                factor_dtype=f64)
    with torch.autocast("cpu", dtype=bf16):
        loss = loss_of(model, distinct_ids(0))
        recorder.hook_gradients()
    loss.backward()
    remove()
    vectors = mkor.pending_vectors()
    projections = [(n, p.weight, p.transposed) for n, p in expert_projections(module)]
    forward = recorder.rows(projections)
    for projection, _, _ in projections:
        a_bar, g_bar = vectors[f"{name}.{projection}"]
        for e, (a_f, g_f) in forward[projection].items():
            assert a_f.dtype == g_f.dtype == f32
            want_a, want_g = a_f.double().mean(0), g_f.double().sum(0)
            err_a = (a_bar[e].double() - want_a).abs().max() / want_a.abs().max()
            err_g = (g_bar[e].double() - want_g).abs().max() / want_g.abs().max()
            assert err_a <= 1e-5 and err_g <= 1e-5, (projection, e, err_a, err_g)
    mkor.remove()


def test_under_bf16_autocast_the_eager_experts_read_their_inputs_as_linear_layers():
    """Where autocast casts an expert's rows to bf16 (the eager loop's ``F.linear``), its a
    rows are the rows before that cast, as an ``nn.Linear``'s under autocast: MKOR's per-expert
    a_bar and g_bar of a float32 Mixtral equal those of its twin, whose experts are
    ``nn.Linear`` layers (float32 sums in another order: <= 1e-6 asserted; bf16 a rows would
    be ~1e-3 off)."""
    model = tiny_moe("mixtral", "eager", f32)
    twin = build_twin(model)
    (name, module), = experts_of(model)
    vectors = []
    for net in (model, twin):
        mkor = MKOR(net, torch.optim.SGD(net.parameters(), lr=0.1), inv_freq=1,
                    factor_dtype=f64)
        with torch.autocast("cpu", dtype=bf16):
            loss = loss_of(net, distinct_ids(0))
        loss.backward()
        vectors.append(mkor.pending_vectors())
        mkor.remove()
    fused, linear = vectors
    compared = 0
    for projection, part in (("gate_up_proj", "gate_up"), ("down_proj", "down")):
        a_bar, g_bar = fused[f"{name}.{projection}"]
        for e in range(module.num_experts):
            twin_name = f"{name}.experts.{e}.{part}"
            if twin_name not in linear:  # an expert routed nothing
                continue
            a_lin, g_lin = linear[twin_name]
            for mine, theirs in ((a_bar[e], a_lin), (g_bar[e], g_lin)):
                err = (mine.double() - theirs.double()).abs().max() / theirs.abs().max()
                assert err <= 1e-6, (projection, e, err.item())
                compared += 1
    assert compared >= 8  # both projections of at least two experts, a and g


def test_the_output_gradient_is_rounded_to_the_forward_accumulator():
    """Inkling2's own forward sums the routed outputs in float32 and returns them in the
    model's float64, so the gradient reaches every pair rounded to float32 (in the model a
    float32 convolution after the experts has rounded it already; here the module alone
    gets a float64 gradient): the recomputed gradient rows are the forward's bit for bit,
    and differ from rows of the unrounded gradient."""
    model = tiny_moe("inkling2", "eager", f64)
    (_, module), = experts_of(model)[:1]
    g = torch.Generator().manual_seed(3)
    T, E = 6, module.num_experts
    hidden = torch.randn(T, module.hidden_dim, generator=g, dtype=f64)
    index = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    weights = torch.rand(T, 2, generator=g)  # the router's float32 weights
    grad = torch.randn(T, module.hidden_dim, generator=g, dtype=f64)
    recorder, remove = record_products(module)
    out = module(hidden, index, weights)
    recorder.hook_gradients()
    out.backward(grad)
    remove()
    arithmetic = observe_arithmetic(module, hidden, index, weights)
    assert out.dtype == f64 and arithmetic.accumulator == f32
    projections = [(n, p.weight, p.transposed) for n, p in expert_projections(module)]
    forward = recorder.rows(projections)
    _, expert, rows = expert_rows(module, hidden, index, weights, grad, arithmetic)
    arithmetic.accumulator = f64
    _, _, unrounded = expert_rows(module, hidden, index, weights, grad, arithmetic)
    for (name, _, _), (a, g_rows), (_, g_plain) in zip(projections, rows, unrounded):
        for e, (a_f, g_f) in forward[name].items():
            pick = expert == e
            assert _row_errors((a[pick], g_rows[pick]), (a_f, g_f)) == (0.0, 0.0), (name, e)
        assert not torch.equal(g_rows, g_plain), name


# -- what the observation refuses ------------------------------------------------------------

class _Probe(torch.nn.Module):
    """A stand-in experts module: ``up`` and ``down`` (E, d, d) stacks and a forward given
    as a function, to see what the observation makes of it."""

    def __init__(self, forward):
        super().__init__()
        self.up = torch.nn.Parameter(torch.randn(2, 3, 3))
        self.down = torch.nn.Parameter(torch.randn(2, 3, 3))
        self.fn = forward

    def forward(self, x):
        return self.fn(self, x)


def _projections(module):
    from types import SimpleNamespace
    return [(n, SimpleNamespace(weight=getattr(module, n), bias=None)) for n in ("up", "down")]


@pytest.mark.parametrize("forward, message", [
    (lambda m, x: x @ m.down[0], "up: no product seen"),
    (lambda m, x: (x @ m.up[0]) @ m.down[0] + (x.double() @ m.up[1].double()).float(),
     "up: products in several dtypes"),
    (lambda m, x: x @ (m.up[0] + m.down[0]), "combined the weights"),
    (lambda m, x: x @ m.up[0] @ m.down, "one projection expert by expert"),
], ids=["a projection never multiplied", "two dtypes", "both weights at once",
        "per expert and stacked"])
def test_a_forward_that_cannot_be_followed_is_named(forward, message):
    module = _Probe(forward)
    with pytest.raises(ValueError, match=message):
        observe(module, (torch.randn(1, 3),), {}, _projections(module))
