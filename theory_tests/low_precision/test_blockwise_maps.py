"""LP4's two code maps: 256 distinct ascending float32 entries, 0 and +-1 (signed) or 0 and 1
(unsigned), the dynamic tree's decades as the oracle's docstring builds them, exact float32
midpoints (so "nearest" decides without rounding), and the port's maps equal to the oracle's
bit for bit."""
import numpy as np
import pytest
import torch

from reference.common import blockwise as oracle
from theory_tests.support.blockwise_cases import MAPS, bits
from torch_impl.common import blockwise as port

KINDS = sorted(MAPS)


def _maps(kind):
    return {"oracle": MAPS[kind][0](), "port": MAPS[kind][1]().numpy()}


@pytest.mark.parametrize("kind", KINDS)
def test_port_maps_equal_the_oracles_bit_for_bit(kind):
    maps = _maps(kind)
    assert maps["port"].dtype == maps["oracle"].dtype == np.float32
    assert np.array_equal(bits(maps["port"]), bits(maps["oracle"]))


@pytest.mark.parametrize("where", ["oracle", "port"])
@pytest.mark.parametrize("kind", KINDS)
def test_maps_are_256_distinct_ascending_entries_with_their_ends(kind, where):
    code = _maps(kind)[where].astype(np.float64)
    assert code.shape == (256,)
    assert np.all(np.diff(code) > 0)  # ascending, hence distinct
    low = -1.0 if kind == "signed" else 0.0
    assert code[0] == low and code[-1] == 1.0 and 0.0 in code
    assert np.sum(code < 0) == (127 if kind == "signed" else 0)


@pytest.mark.parametrize("where", ["oracle", "port"])
def test_the_signed_map_is_symmetric_but_for_its_entry_ten_to_the_minus_seven(where):
    code = _maps("signed")[where]
    unmatched = sorted(set(code.tolist()) - set((-code).tolist()))
    assert unmatched == [np.float32(oracle._round_significant(np.float64(1e-7)))]
    assert code[127] == 0.0 and code[128] == unmatched[0]  # next to 0, the smallest positive


@pytest.mark.parametrize("kind, bits_", [("signed", 7), ("unsigned", 8)])
def test_decades_hold_the_trees_counts_and_tops(kind, bits_):
    """Decade z, (10^-(z+1), 10^-z], holds 2^(bits-1-z) evenly spaced positive entries whose top
    is 10^-z (both to 16 significant bits): the finest spacing near 1, coarser ones below."""
    code = _maps(kind)["port"].astype(np.float64)
    for z in range(bits_):
        top, bottom = 10.0 ** -z, 10.0 ** -(z + 1)
        decade = code[(code > bottom * (1 + 2 ** -15)) & (code <= top * (1 + 2 ** -15))]
        n = 2 ** (bits_ - 1 - z)
        assert decade.size == n, (z, decade.size)
        assert abs(decade[-1] - top) <= top * 2 ** -16
        spacing = np.diff(np.concatenate([[bottom], decade]))
        assert np.allclose(spacing, 0.9 * top / n, rtol=0, atol=top * 2 ** -15), z  # 2 roundings
    assert np.sum(code > 0) == 2 ** bits_ - 1 + (kind == "signed")


@pytest.mark.parametrize("kind", KINDS)
def test_entries_have_16_significant_bits_and_every_midpoint_is_a_float32(kind):
    code = _maps(kind)["port"].astype(np.float64)
    mantissa, _ = np.frexp(code)
    assert np.array_equal(mantissa * 2.0 ** 16, np.round(mantissa * 2.0 ** 16))
    mid = (code[1:] + code[:-1]) / 2  # exact in float64
    assert np.array_equal(mid.astype(np.float32).astype(np.float64), mid)
    # the check has teeth: a map of plain float32 decimals has midpoints that round
    plain = np.linspace(0, 1, 256, dtype=np.float32).astype(np.float64) ** 3
    plain_mid = (plain[1:] + plain[:-1]) / 2
    assert not np.array_equal(plain_mid.astype(np.float32).astype(np.float64), plain_mid)


def test_the_port_caches_one_map_per_device_and_builds_it_without_data_reads():
    assert port.signed_code() is port.signed_code("cpu")
    assert port.unsigned_code() is not port.signed_code()
    meta = port.unsigned_code("meta")  # a meta tensor has no data: a host read would raise
    assert meta.device.type == "meta" and meta.shape == (256,) and meta.dtype == torch.float32
