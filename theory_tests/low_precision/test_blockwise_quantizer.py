"""LP4's quantizer, the port against the oracle bit for bit (codes, absmax, dequantized values)
on random values over 60 decades of magnitude with a shorter last block, zero blocks, negative
values under the unsigned map, float32's extremes and non-finite values; its memory (1 byte
per value and 4 per block); the errors for bad input; no data read on the host."""
import numpy as np
import pytest
import torch

from theory_tests.support.blockwise_cases import MAPS, bits, run_both, wide_values
from torch_impl.common import blockwise as port

KINDS = sorted(MAPS)
# (size, block size): shorter last blocks of 1 and of block - 1 values, an exact multiple, a
# tensor smaller than one block, block size 1
SIZES = [(1000, 64), (1025, 256), (767, 256), (512, 256), (100, 256), (33, 1), (0, 8)]


def _assert_same(out):
    (q, s, d), (qt, st, dt) = out["oracle"], out["port"]
    assert qt.dtype == np.uint8 and st.dtype == np.float32
    assert np.array_equal(q, qt)
    assert np.array_equal(bits(s), bits(st))
    assert np.array_equal(bits(d), bits(dt))


@pytest.mark.parametrize("size, block", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_port_equals_oracle_bit_for_bit_with_a_shorter_last_block(kind, size, block):
    x = wide_values(size + block, size)
    if kind == "unsigned":
        x = np.abs(x)
    _assert_same(run_both(x, kind, block))


@pytest.mark.parametrize("kind", KINDS)
def test_port_equals_oracle_on_extremes_zero_blocks_and_negative_values(kind):
    """Blocks: all zeros; float32's largest and subnormal values; negatives (under the unsigned
    map they go to its 0, the nearest entry); a block of one value."""
    x = np.concatenate([np.zeros(16), [3.4e38, -1e38, 1.0, 0.0] * 4,
                        [1e-44, -3e-45, 1e-40, 0.0] * 4,
                        -np.abs(wide_values(1, 16)), np.zeros(16), [-2.5]]).astype(np.float32)
    out = run_both(x.reshape(1, -1), kind, 16)
    _assert_same(out)
    q, s, d = out["port"]
    assert s[0] == 0.0 and s[4] == 0.0 and np.all(d.reshape(-1)[:16] == 0.0)
    if kind == "unsigned":
        assert np.all(d.reshape(-1)[48:64] == 0.0)  # the block of negatives


def test_a_zero_block_has_scale_zero_and_the_code_of_zero_without_nan():
    for kind, zero_index in (("signed", 127), ("unsigned", 0)):
        q, s, d = run_both(np.zeros((3, 5), np.float32), kind, 4)["port"]
        assert np.all(q == zero_index) and np.array_equal(s, [0, 0, 0, 0])
        assert np.array_equal(bits(d), bits(np.zeros((3, 5))))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("kind", KINDS)
def test_a_non_finite_block_dequantizes_to_nan_and_leaves_the_other_blocks_alone(kind, bad):
    x = np.abs(wide_values(2, 50, decades=4))
    y = x.copy()
    y[23] = bad  # block 2 of blocks of 8
    out = run_both(y, kind, 8)
    _assert_same(out)
    q, s, d = out["port"]
    clean_q, clean_s, clean_d = run_both(x, kind, 8)["port"]
    assert np.isnan(s[2]) and np.all(np.isnan(d[16:24]))
    assert np.all(q[16:24] == (127 if kind == "signed" else 0))  # the codes of 0
    others = np.r_[0:16, 24:50]
    assert np.array_equal(q[others], clean_q[others])
    assert np.array_equal(bits(d[others]), bits(clean_d[others]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_other_input_dtypes_are_read_as_float32_and_dequantize_to_any_dtype(dtype):
    x = torch.from_numpy(wide_values(3, 300, decades=6)).to(dtype)
    code = port.signed_code()
    q, s = port.quantize_blockwise(x, code, 64)
    q32, s32 = port.quantize_blockwise(x.to(torch.float32), code, 64)
    assert torch.equal(q, q32) and torch.equal(s, s32) and s.dtype == torch.float32
    d = port.dequantize_blockwise(q, s, code, 64, dtype=dtype)
    assert d.dtype == dtype
    assert torch.equal(d, port.dequantize_blockwise(q, s, code, 64).to(dtype))


def test_memory_is_one_byte_per_value_and_four_per_block():
    for numel, block in ((4096, 256), (1000, 256), (4096, 2048)):
        q, s = port.quantize_blockwise(torch.randn(numel), port.unsigned_code(), block)
        stored = q.numel() * q.element_size() + s.numel() * s.element_size()
        assert q.dtype == torch.uint8 and q.numel() == numel
        assert stored == numel + 4 * -(-numel // block)
    assert 4096 + 4 * 4096 / 256 == 4096 * (1 + 4 / 256)  # LP6's 1 + 4/B bytes per value


def test_bad_input_gets_an_error_naming_what_is_wrong():
    code, x = port.signed_code(), torch.randn(10)
    for block in (0, -3, True, 2.0, None):
        with pytest.raises(ValueError, match="block_size"):
            port.quantize_blockwise(x, code, block)
    with pytest.raises(ValueError, match="complex.*view_as_real"):
        port.quantize_blockwise(torch.randn(10, dtype=torch.complex64), code, 4)
    with pytest.raises(ValueError, match="real floating-point"):
        port.quantize_blockwise(torch.arange(10), code, 4)
    for bad_code in (code.double(), code[None], torch.zeros(257), [0.0, 1.0]):
        with pytest.raises(ValueError, match="code"):
            port.quantize_blockwise(x, bad_code, 4)
    q, s = port.quantize_blockwise(x, code, 4)
    with pytest.raises(ValueError, match="codes: expected a uint8"):
        port.dequantize_blockwise(q.long(), s, code, 4)
    for bad_s in (s[:2], s.double(), s[None]):
        with pytest.raises(ValueError, match=r"absmax: expected float32 of shape \(3,\)"):
            port.dequantize_blockwise(q, bad_s, code, 4)


def test_quantize_and_dequantize_read_no_data_on_the_host():
    """On the meta device a tensor has no data: any host read (``.item()``, a branch on a
    value, a data-dependent shape) raises, so passing is the no-synchronisation contract."""
    x = torch.empty(1000, 3, device="meta")
    code = port.unsigned_code("meta")
    q, s = port.quantize_blockwise(x, code, 256)
    assert q.shape == (1000, 3) and q.dtype == torch.uint8 and s.shape == (12,)
    assert port.dequantize_blockwise(q, s, code, 256, torch.bfloat16).shape == (1000, 3)
    with pytest.raises(Exception):  # the premise: a host read of a meta tensor raises
        s.sum().item()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_equals_the_cpu_bit_for_bit_without_synchronising(kind):
    x = torch.from_numpy(wide_values(4, 100_003))
    code_cpu, code_gpu = MAPS[kind][1](), MAPS[kind][1]("cuda")
    assert torch.equal(code_gpu.cpu(), code_cpu)
    q, s = port.quantize_blockwise(x, code_cpu, 256)
    xg = x.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        qg, sg = port.quantize_blockwise(xg, code_gpu, 256)
        dg = port.dequantize_blockwise(qg, sg, code_gpu, 256)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(qg.cpu(), q) and torch.equal(sg.cpu(), s)
    assert torch.equal(dg.cpu(), port.dequantize_blockwise(q, s, code_cpu, 256))
