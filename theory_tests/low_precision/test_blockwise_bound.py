"""LP4's per-value bound, exhaustively at every midpoint of both maps, in the oracle and in the
port: a value at a midpoint has the error s gap / 2 exactly (the bound is attained) and goes to
the entry of smaller magnitude (the tie rule); one float32 step past it goes to the other
entry. At any scale (not only powers of two) every value is within ``error_bound``. A
quantized tensor quantizes to itself (idempotent)."""
import numpy as np
import pytest
import torch

from reference.common import blockwise as oracle
from theory_tests.support.blockwise_cases import MAPS, bits, run_both, wide_values
from torch_impl.common import blockwise as port

KINDS = sorted(MAPS)
WHERE = ("oracle", "port")


def _quantize(where, kind, x, block_size):
    if where == "oracle":
        return oracle.quantize_blockwise(x, MAPS[kind][0](), block_size)
    q, s = port.quantize_blockwise(torch.from_numpy(x), MAPS[kind][1](), block_size)
    return q.numpy(), s.numpy()


def _midpoint_probe(kind, scale):
    """One block: the value 1 (so s = scale), then for every midpoint m_k between entries k and
    k + 1: scale m_k, and scale times the float32 just below and just above m_k."""
    code = MAPS[kind][0]().astype(np.float64)
    mid = ((code[1:] + code[:-1]) / 2).astype(np.float32)
    below = np.nextafter(mid, np.float32(-np.inf))
    above = np.nextafter(mid, np.float32(np.inf))
    x = np.concatenate([[1.0], mid, below, above]).astype(np.float32) * np.float32(scale)
    return code, x


@pytest.mark.parametrize("scale", [1.0, 2.0 ** -20, 2.0 ** 100])
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("kind", KINDS)
def test_every_midpoint_is_a_tie_to_the_smaller_magnitude_and_one_step_past_it_is_not(
        kind, where, scale):
    """With s a power of two, x / s is exact: at the midpoint between entries k and k + 1 the
    error is s gap / 2, the bound, attained; one float32 below goes to k, one above to k + 1."""
    code, x = _midpoint_probe(kind, scale)
    q, s = _quantize(where, kind, x, x.size)
    assert s[0] == np.float32(scale)
    at, below, above = q[1:256].astype(int), q[256:511].astype(int), q[511:].astype(int)
    k = np.arange(255)
    tie_winner = np.where(np.abs(code[k]) < np.abs(code[k + 1]), k, k + 1)
    assert np.array_equal(at, tie_winner)
    assert np.array_equal(below, k) and np.array_equal(above, k + 1)
    gap = code[k + 1] - code[k]
    error = np.abs(x[1:256].astype(np.float64) - scale * code[at])
    assert np.array_equal(error, scale * gap / 2)  # the bound, attained at every midpoint
    bound = oracle.error_bound(x, MAPS[kind][0](), x.size)[1:256]
    assert np.all(error <= bound) and np.all(bound - error <= 3 * 2.0 ** -24 * scale + 2.0 ** -150)


@pytest.mark.parametrize("scale", [3.7, 1e-30, 7.3e35])
@pytest.mark.parametrize("kind", KINDS)
def test_every_value_is_within_its_bound_at_any_scale(kind, scale):
    """A scale that is not a power of two rounds x / s: the 3 u s term of the bound covers it
    (the midpoint probe sits where rounding matters most), and random values over 60 decades
    in blocks of 64 with a shorter last block."""
    _, probe = _midpoint_probe(kind, scale)
    rand = wide_values(5, 1000) * np.float32(scale / 1e30)
    for x, block in ((probe, probe.size), (rand, 64)):
        if kind == "unsigned":
            x = np.abs(x)
        for where in WHERE:
            d = run_both(x, kind, block)[where][2]
            error = np.abs(x.astype(np.float64) - d)
            bound = oracle.error_bound(x, MAPS[kind][0](), block)
            assert np.all(error <= bound), (where, np.max(error / bound))


def test_the_bound_below_the_unsigned_maps_range_is_the_distance_to_zero():
    x = np.array([1.0, -0.25, -1.0, 0.5], np.float32)
    d = run_both(x, "unsigned", 4)["port"][2]
    bound = oracle.error_bound(x, MAPS["unsigned"][0](), 4)
    assert np.array_equal(d[1:3], [0.0, 0.0])
    assert np.all(np.abs(x - d) <= bound) and bound[2] - 1.0 < 1e-6


@pytest.mark.parametrize("block", [64, 100])
@pytest.mark.parametrize("kind", KINDS)
def test_a_quantized_tensor_quantizes_to_itself(kind, block):
    """quantize(dequantize(quantize(x))) = quantize(x), codes and scales bit for bit (the
    scales' magnitudes keep every product s code[q] a normal float32)."""
    x = wide_values(6, 1000, decades=20)
    x = np.abs(x) if kind == "unsigned" else x
    for where in WHERE:
        q, s, d = run_both(x, kind, block)[where]
        q2, s2 = _quantize(where, kind, d.astype(np.float32), block)
        assert np.array_equal(q2, q) and np.array_equal(bits(s2), bits(s)), where
