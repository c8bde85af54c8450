"""LP1 / LP2: stochastic rounding against its oracle, its law (unbiased, the variance the
neighbours predict) and its streams."""
import math

import numpy as np
import pytest
import torch

from reference.common import rounding as oracle
from torch_impl.common.rounding import (default_rounding_seed, name_word, stochastic_round,
                                        stochastic_round_with_uniform, stream_seed)

NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
PAIRS = [(torch.float64, torch.bfloat16), (torch.float64, torch.float16),
         (torch.float64, torch.float32), (torch.float32, torch.bfloat16),
         (torch.float32, torch.float16)]


def _values(dtype, narrow, n=4000, seed=0):
    """Values spread over many binades of the narrow type (subnormals of it included), both
    signs, some already representable in it."""
    g = torch.Generator().manual_seed(seed)
    tiny = torch.finfo(narrow).tiny
    mags = torch.exp(torch.empty(n, dtype=torch.float64).uniform_(
        math.log(tiny / 64), math.log(1e4), generator=g))
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    x = (mags * signs).to(dtype)
    x[::7] = x[::7].to(narrow).to(dtype)  # exact in the narrow type
    x[0] = 0.0
    return x


@pytest.mark.parametrize("wide,narrow", PAIRS)
def test_the_port_is_the_oracle_given_the_uniforms(wide, narrow):
    x = _values(wide, narrow)
    u = torch.rand(x.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = stochastic_round_with_uniform(x, narrow, u.to(wide)).double().numpy()
    want = oracle.stochastic_round(x.double().numpy(), u.to(wide).double().numpy(), NAMES[narrow])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("wide,narrow", PAIRS)
def test_the_oracle_neighbours_are_adjacent_values_of_the_type(wide, narrow):
    x = _values(wide, narrow)
    lo, hi = oracle.neighbours(x.double().numpy(), NAMES[narrow])
    lo_t, hi_t = torch.from_numpy(lo).to(narrow), torch.from_numpy(hi).to(narrow)
    assert torch.equal(lo_t.double(), torch.from_numpy(lo))
    assert torch.equal(hi_t.double(), torch.from_numpy(hi))  # both are values of the type
    xd = x.double()
    assert bool(((torch.from_numpy(lo) <= xd) & (xd <= torch.from_numpy(hi))).all())
    inexact = torch.from_numpy(lo) != torch.from_numpy(hi)
    assert torch.equal(torch.nextafter(lo_t, torch.full_like(lo_t, math.inf))[inexact],
                       hi_t[inexact])  # nothing of the type lies between them
    assert torch.equal(torch.from_numpy(lo)[~inexact], xd[~inexact])


def _fast_path_uniforms(x, seed):
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(0, 1 << 16, x.shape, generator=g, dtype=torch.int32).double()
    return torch.where(x >= 0, (65535.5 - r) / 65536, (r + 0.5) / 65536)


def test_the_bf16_bit_path_is_the_rule_with_its_uniforms():
    x = _values(torch.float32, torch.bfloat16, n=20000)
    for seed in (3, 4):
        fast = stochastic_round(x, torch.bfloat16, seed)
        rule = stochastic_round_with_uniform(x.double(), torch.bfloat16,
                                             _fast_path_uniforms(x, seed))
        assert torch.equal(fast.view(torch.int16), rule.view(torch.int16))


@pytest.mark.parametrize("wide,narrow", PAIRS)
def test_unbiased_with_the_variance_of_its_neighbours(wide, narrow, device):
    """Per value, the mean over N seeded draws is x within 5 standard errors of the law's own
    variance (hi - x)(x - lo)/N, and the sample variance matches it; the rounding of each value
    is drawn N times by N seeds.  Round-to-nearest or toward zero fail by hundreds of SEs."""
    n_draws = 400
    x = _values(wide, narrow, n=64, seed=5).to(device)
    draws = torch.stack([stochastic_round(x, narrow, stream_seed(9, k)).to(torch.float64)
                         for k in range(n_draws)])
    lo, hi = (torch.from_numpy(v).to(device)
              for v in oracle.neighbours(x.double().cpu().numpy(), NAMES[narrow]))
    xd = x.double()
    var = (hi - xd) * (xd - lo)
    assert bool(((draws == lo) | (draws == hi)).all())
    se = (var / n_draws).sqrt()
    err = (draws.mean(0) - xd).abs()
    assert bool((err <= 5 * se + 1e-300).all()), (err / se).max()
    inexact = var > 0
    # the sample variance of a two-point law: its relative SE is below 1 / sqrt(N) * 3 here
    ratio = draws.var(0, unbiased=False)[inexact] / var[inexact]
    p = ((xd - lo) / (hi - lo))[inexact]
    se_ratio = ((1 - 4 * p * (1 - p)) / (p * (1 - p)) / n_draws).sqrt()
    assert bool(((ratio - 1).abs() <= 5 * se_ratio + 0.05).all())


def test_exact_values_non_finite_and_overflow_round_to_nearest():
    for narrow in (torch.bfloat16, torch.float16):
        big = torch.finfo(narrow).max
        x = torch.tensor([1.0, -0.5, 0.0, math.inf, -math.inf, math.nan, big * 1.001, -big * 1.5],
                         dtype=torch.float32)
        for seed in range(20):
            out = stochastic_round(x, narrow, seed)
            assert torch.equal(out[:5], x[:5].to(narrow)) and torch.isnan(out[5])
            assert torch.equal(out[6:], x[6:].to(narrow))  # -> inf, as nearest gives


def test_a_seed_fixes_the_result_and_another_seed_changes_it():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    a, b = stochastic_round(x, torch.bfloat16, 7), stochastic_round(x, torch.bfloat16, 7)
    c = stochastic_round(x, torch.bfloat16, 8)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_stream_seeds_differ_in_every_word():
    base = (11, 3, name_word("exp_avg"), 5)
    seeds = {stream_seed(*base)}
    for i in range(len(base)):
        w = list(base)
        w[i] += 1
        seeds.add(stream_seed(*w))
    seeds.add(stream_seed(11, 3, name_word("exp_avg_sq"), 5))
    assert len(seeds) == len(base) + 2
    assert all(0 <= s < 2 ** 63 for s in seeds)
    assert name_word("exp_avg") == name_word("exp_avg")  # stable within and across processes
    assert name_word("exp_avg") == 0xb11aef18d3eadd21  # the same in every process


def test_default_seed_follows_torch_manual_seed():
    torch.manual_seed(123)
    a, b = default_rounding_seed(), default_rounding_seed()
    torch.manual_seed(123)
    assert default_rounding_seed() == a and a != b


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="dtype"):
        stochastic_round(torch.ones(3, dtype=torch.bfloat16), torch.bfloat16, 0)
    with pytest.raises(ValueError, match="dtype"):
        stochastic_round(torch.ones(3), torch.float64, 0)
    with pytest.raises(ValueError, match="dtype"):
        stochastic_round(torch.ones(3, dtype=torch.int32), torch.bfloat16, 0)
