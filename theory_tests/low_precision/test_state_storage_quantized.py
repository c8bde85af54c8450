"""``state_quantization="blockwise8"`` and ``block_size`` on MARS and MARS-M (issue 47 item 4, LP4),
the contract around the quantizer (``torch_impl/common/quantized_state.py``): which buffers are
held as ``<name>_codes`` (uint8) / ``<name>_absmax`` (float32), the step on their dequantized
working copies written back quantized, ``load_state_dict`` keeping codes uint8 and scales
float32 (torch would cast both to the parameter's dtype), ``init_state()``, the conversion
when a group's option changes, the refusals.  The runs against the oracle with the quantizer
at its stores are helper B's (``test_quantized_state.py``)."""
import copy

import pytest
import torch

from theory_tests.support.low_precision_runs import (BF16, F32, clone, grads, make_params,
                                                     same_bits, step)
from torch_impl import LAMB, MARS, MARSM
from torch_impl.common.blockwise import (dequantize_blockwise, quantize_blockwise, signed_code,
                                         unsigned_code)

F64 = torch.float64
BLOCK = 16
SHAPES = [(6, 5), (20,), (4, 6)]  # 30 = one block and 14; 20 = one and 4; 24 = one and 8

OPTIMIZERS = {
    "mars-adamw-amsgrad": lambda ps, **kw: MARS(ps, lr=1e-2, amsgrad=True, **kw),
    "mars-lion": lambda ps, **kw: MARS(ps, lr=1e-2, mars_type="mars-lion", **kw),
    "mars-shampoo": lambda ps, **kw: MARS(ps, lr=1e-2, mars_type="mars-shampoo", ns_dtype=F32,
                                          **kw),
    "mars-m": lambda ps, **kw: MARSM(ps, lr=1e-2, ns_dtype=F32, **kw),
    "mars-m-efficient": lambda ps, **kw: MARSM(ps, lr=1e-2, ns_dtype=F32, efficient=True, **kw),
}
Q = dict(state_quantization="blockwise8", block_size=BLOCK)
# the buffers held in 8 bits (signed map?) and the ones that stay plain
SIGNED = {"exp_avg": True, "exp_avg_sq": False, "max_exp_avg_sq": False,
          "momentum_buffer": True, "moment1": True, "moment2": False}


def _run(name, dtype=F32, steps=3, seed=30, **kw):
    params = make_params(dtype, seed=seed, shapes=SHAPES)
    opt = OPTIMIZERS[name](params, **{**Q, **kw})
    for t in range(steps):
        step(opt, params, grads(t, F32, seed=seed, shapes=SHAPES))
    return opt, params


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_moments_are_codes_and_scales_and_each_step_quantizes_its_working_copy(name, dtype):
    """After a step: each moment is ``<name>_codes`` (uint8, the parameter's shape) and
    ``<name>_absmax`` (float32, one per block), nothing of it held plain, ``last_grad`` plain;
    and the step is the float32 step from the dequantized moments (a twin with float32
    parameters and plain float32 state loaded with them), its new moments quantized by LP4
    (the same codes and scales), a bf16 parameter the float32 one rounded to nearest."""
    opt, params = _run(name, dtype=dtype)
    before = copy.deepcopy(opt.state_dict())
    twin_params = clone(params, F32)
    twin = OPTIMIZERS[name](twin_params)  # plain float32 state: the dequantized values
    twin.load_state_dict(copy.deepcopy(before))
    for group in twin.param_groups:
        group["state_quantization"] = None
    gs = grads(3, F32, seed=30, shapes=SHAPES)
    step(twin, twin_params, gs)  # converts (dequantizes) at this step, then steps
    step(opt, params, gs)
    quantized = 0
    for p, q in zip(params, twin_params):
        st = opt.state[p]
        assert same_bits(p.detach(), q.detach().to(dtype))
        for key, signed in SIGNED.items():
            if key + "_codes" not in st:
                assert key not in twin.state[q], key
                continue
            quantized += 1
            assert key not in st
            codes, absmax = st[key + "_codes"], st[key + "_absmax"]
            assert codes.dtype == torch.uint8 and codes.shape == p.shape
            assert absmax.dtype == F32 and absmax.shape == (-(-p.numel() // BLOCK),)
            code = signed_code() if signed else unsigned_code()
            want_codes, want_absmax = quantize_blockwise(twin.state[q][key], code, BLOCK)
            assert torch.equal(codes, want_codes) and same_bits(absmax, want_absmax), key
        if "last_grad" in twin.state[q]:
            assert st["last_grad"].dtype == dtype
    assert quantized >= len(params)


@pytest.mark.parametrize("name", ["mars-adamw-amsgrad", "mars-m"])
def test_under_stochastic_rounding_the_moments_are_still_quantized_by_lp4(name):
    """bf16 parameters and state with ``state_rounding="stochastic"``: the 8-bit moments are
    written by the quantizer (the codes of the float32 step's moments), the rest by LP1."""
    params = make_params(BF16, seed=33, shapes=SHAPES)
    opt = OPTIMIZERS[name](params, state_rounding="stochastic", rounding_seed=3, **Q)
    twin_params = clone(params, F32)
    twin = OPTIMIZERS[name](twin_params)  # the same first step, float32, plain state
    gs = grads(0, F32, seed=33, shapes=SHAPES)
    step(opt, params, gs)
    step(twin, twin_params, gs)
    checked = 0
    for p, q in zip(params, twin_params):
        for key, signed in SIGNED.items():
            if key in twin.state[q]:
                code = signed_code() if signed else unsigned_code()
                want = quantize_blockwise(twin.state[q][key], code, BLOCK)
                assert torch.equal(opt.state[p][key + "_codes"], want[0]), key
                assert same_bits(opt.state[p][key + "_absmax"], want[1]), key
                checked += 1
    assert checked >= len(params)


@pytest.mark.parametrize("name", ["mars-adamw-amsgrad", "mars-m"])
@pytest.mark.parametrize("dtype", [BF16, F64], ids=["bf16", "f64"])
def test_a_checkpoint_keeps_codes_uint8_and_scales_float32_and_resumes_bit_for_bit(name, dtype,
                                                                                    tmp_path):
    """torch's ``load_state_dict`` casts every state tensor of a floating parameter to its
    dtype (uint8 codes to bf16 / float64 numbers, float32 scales to bf16); the load keeps
    them, and the resumed run (``torch.save`` / ``torch.load``) is the uninterrupted one."""
    opt, params = _run(name, dtype=dtype, steps=2)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    twin_params = clone(params)
    twin = OPTIMIZERS[name](twin_params, **Q)
    twin.load_state_dict(torch.load(tmp_path / "opt.pt"))
    for p in twin_params:
        for key, value in twin.state[p].items():
            if key.endswith("_codes"):
                assert value.dtype == torch.uint8, key
            elif key.endswith("_absmax"):
                assert value.dtype == F32, key
    for t in range(2, 4):
        step(opt, params, grads(t, F32, seed=30, shapes=SHAPES))
        step(twin, twin_params, grads(t, F32, seed=30, shapes=SHAPES))
    for p, q in zip(params, twin_params):
        assert same_bits(p.detach(), q.detach())
        assert opt.state[p].keys() == twin.state[q].keys()
        for key, value in opt.state[p].items():
            assert same_bits(twin.state[q][key], value), key


def test_a_dcp_round_trip_resumes_bit_for_bit(tmp_path):
    from theory_tests.support.checkpoint_checks import dcp_round_trip
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6, bias=False), torch.nn.Linear(6, 4, bias=False))
    fresh = copy.deepcopy(model)
    opt, fresh_opt = MARS(model.parameters(), lr=1e-2, **Q), MARS(fresh.parameters(), lr=1e-2, **Q)
    fresh_opt.init_state()  # the template names the codes and scales

    def train(m, o, t):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(t))
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
    for t in range(2):
        train(model, opt, t)
    dcp_round_trip(model, opt, fresh, fresh_opt, tmp_path / "ckpt")
    for t in range(2, 4):
        train(model, opt, t)
        train(fresh, fresh_opt, t)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert same_bits(p.detach(), q.detach())
        for key, value in opt.state[p].items():
            assert same_bits(fresh_opt.state[q][key], value), key


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_init_state_creates_the_first_steps_codes_and_scales(name):
    """``init_state()`` creates the state the first step creates: the same keys, dtypes and
    shapes, the codes of 0 and scales 0 (the quantization of zeros: every moment reads 0)."""
    params = make_params(F32, seed=31, shapes=SHAPES)
    opt = OPTIMIZERS[name](params, **Q)
    opt.init_state()
    stepped, _ = _run(name, steps=1, seed=31)
    for p, q in zip(params, stepped.param_groups[0]["params"]):
        st = opt.state[p]
        assert {k: (v.dtype, v.shape) for k, v in st.items()} == \
            {k: (v.dtype, v.shape) for k, v in stepped.state[q].items()}
        for key, signed in SIGNED.items():
            if key + "_codes" in st:
                code = signed_code() if signed else unsigned_code()
                zeros = quantize_blockwise(torch.zeros(p.shape), code, BLOCK)
                assert torch.equal(st[key + "_codes"], zeros[0])
                assert not bool(st[key + "_absmax"].any())
                assert not bool(dequantize_blockwise(st[key + "_codes"], st[key + "_absmax"],
                                                     code, BLOCK).any())


def test_turning_the_option_on_quantizes_the_state_and_off_dequantizes_it():
    """A group switched to 8 bits quantizes its plain state at its next step (that step reads
    the dequantized values: a plain twin given them steps to the same codes); switched back,
    the codes are dequantized into plain float32 state."""
    params = make_params(F32, seed=32, shapes=SHAPES)
    opt = OPTIMIZERS["mars-m"](params)
    step(opt, params, grads(0, F32, seed=32, shapes=SHAPES))
    twin_params = clone(params)
    twin = OPTIMIZERS["mars-m"](twin_params)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p in twin_params:  # what the converted state reads
        st = twin.state[p]
        for key in ("momentum_buffer", "moment1", "moment2"):
            if key in st:
                code = signed_code() if SIGNED[key] else unsigned_code()
                st[key] = dequantize_blockwise(*quantize_blockwise(st[key], code, BLOCK), code,
                                               BLOCK)
    opt.param_groups[0].update(Q)
    gs = grads(1, F32, seed=32, shapes=SHAPES)
    step(opt, params, gs)
    step(twin, twin_params, gs)
    for p, q in zip(params, twin_params):
        assert same_bits(p.detach(), q.detach())
        for key in ("momentum_buffer", "moment1", "moment2"):
            if key in twin.state[q]:
                assert key not in opt.state[p]
                code = signed_code() if SIGNED[key] else unsigned_code()
                want = quantize_blockwise(twin.state[q][key], code, BLOCK)
                assert torch.equal(opt.state[p][key + "_codes"], want[0]), key
    opt.param_groups[0]["state_quantization"] = None
    step(opt, params, grads(2, F32, seed=32, shapes=SHAPES))
    for p in params:
        assert not any(k.endswith("_codes") or k.endswith("_absmax") for k in opt.state[p])
        assert {opt.state[p][k].dtype for k in ("momentum_buffer", "moment1", "moment2")
                if k in opt.state[p]} == {F32}


def test_the_loop_and_foreach_store_the_same_codes_and_rounding_options_compose():
    """foreach equals the loop bit for bit (the quantizer runs at the shared write-back); with
    bf16 parameters, stochastic rounding of ``last_grad`` and Kahan parameters, the moments are
    still codes, ``last_grad`` bf16, ``kahan_comp`` bf16."""
    for name in ("mars-adamw-amsgrad", "mars-m"):
        a, pa = _run(name)
        b, pb = _run(name, foreach=True)
        for p, q in zip(pa, pb):
            assert same_bits(p.detach(), q.detach())
            for key, value in a.state[p].items():
                assert same_bits(b.state[q][key], value), key
    opt, params = _run("mars-adamw-amsgrad", dtype=BF16, state_rounding="stochastic",
                       kahan_sum=True, rounding_seed=1)
    st = opt.state[params[0]]
    assert st["exp_avg_codes"].dtype == torch.uint8 and st["last_grad"].dtype == BF16
    assert st["kahan_comp"].dtype == BF16 and bool(st["kahan_comp"].any())


def test_bytes_per_parameter_read_from_the_state_dict():
    """LP6 for the 8-bit options, from ``state_dict()``: 1 + 4 / B bytes per value of each
    8-bit buffer, 4 per float32 ``last_grad`` (B = 256; a tensor of whole blocks)."""
    def per_value(make, rule_buffers):
        p = torch.nn.Parameter(torch.zeros(64, 64))
        p.grad = torch.randn(64, 64)
        opt = make([p])
        opt.step()
        state = opt.state_dict()["state"][0]
        stored = sum(t.numel() * t.element_size() for k, t in state.items()
                     if torch.is_tensor(t) and k != "step")
        assert sorted(k for k in state if k != "step") == sorted(rule_buffers)
        return stored / p.numel()
    eight = 1 + 4 / 256
    assert per_value(lambda ps: MARS(ps, state_quantization="blockwise8"), [
        "exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax",
        "last_grad"]) == 2 * eight + 4
    assert per_value(lambda ps: MARS(ps, mars_type="mars-lion", state_quantization="blockwise8"),
                     ["exp_avg_codes", "exp_avg_absmax", "last_grad"]) == eight + 4
    assert per_value(lambda ps: MARSM(ps, state_quantization="blockwise8"), [
        "momentum_buffer_codes", "momentum_buffer_absmax", "last_grad"]) == eight + 4
    assert per_value(lambda ps: MARSM(ps, efficient=True, state_quantization="blockwise8"), [
        "momentum_buffer_codes", "momentum_buffer_absmax"]) == eight


# ------------------------------------------------------------------ refusals

def test_a_tensor_smaller_than_a_block_is_refused_naming_both_options_and_its_shape():
    small = torch.nn.Parameter(torch.zeros(5, 7))
    for make in (MARS, MARSM):
        with pytest.raises(ValueError, match=r"^state_quantization='blockwise8' with "
                                             r"block_size=64: the tensor of shape \(5, 7\) has "
                                             r"35 elements, fewer than a block \(put such "
                                             r"tensors in another group"):
            make([small], state_quantization="blockwise8", block_size=64)
        make([small], state_quantization="blockwise8", block_size=35)  # one whole block
    opt = MARS([dict(params=[torch.nn.Parameter(torch.zeros(8, 8))]),
                dict(params=[small], state_quantization=None)], state_quantization="blockwise8",
               block_size=64)  # the small tensor in a group of its own: accepted
    opt.param_groups[1]["state_quantization"] = "blockwise8"  # and refused at the step
    with pytest.raises(ValueError, match=r"^state_quantization='blockwise8'"):
        opt.step()


def test_complex_and_bad_values_are_refused():
    z = torch.nn.Parameter(torch.zeros(16, 16, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"^state_quantization: a complex parameter"):
        MARS([z], **Q)
    f = [torch.nn.Parameter(torch.zeros(16, 16))]
    for make in (MARS, MARSM):
        with pytest.raises(ValueError, match=r"^state_quantization: expected one of"):
            make(f, state_quantization="int8")
        for bad in (0, 2.5, True):
            with pytest.raises(ValueError, match=r"^block_size: expected an int >= 1"):
                make(f, state_quantization="blockwise8", block_size=bad)
    with pytest.raises(TypeError):  # LAMB has no 8-bit state (the issue: MARS and MARS-M)
        LAMB(f, state_quantization="blockwise8")


def test_a_changed_block_size_is_refused_once_the_state_is_quantized():
    opt, params = _run("mars-m", steps=1)
    opt.param_groups[0]["block_size"] = 8
    with pytest.raises(ValueError, match=r"^block_size: the state of the tensor of shape"):
        step(opt, params, grads(1, F32, seed=30, shapes=SHAPES))


def _dtensor_refused(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world_size,))
    p = torch.nn.Parameter(distribute_tensor(torch.zeros(16, 16), mesh, [Shard(0)]))
    try:
        MARS([p], **Q)
    except ValueError as error:
        return str(error)
    return None


def test_a_dtensor_parameter_is_refused():
    """FSDP2's DTensor parameters: a block would cut across shards (one rank, gloo)."""
    from theory_tests.support.distributed_harness import run
    (message,) = run(_dtensor_refused, 1)
    assert message is not None and message.startswith("state_quantization: a DTensor (FSDP2)")
