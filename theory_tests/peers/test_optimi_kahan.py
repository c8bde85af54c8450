"""Kahan-compensated bf16 parameters: torch-optimi 0.3.3's ``AdamW(kahan_sum=True)`` and ours
(MARS, gamma = 0, ``kahan_sum=True``, LP3) against the float32 trajectory
(``theory_tests/support/optimi_conventions.py``: the conventions and the runs).

One 64 x 32 bf16 tensor with |p| in [1, 2) (spacing 2^-7), 300 steps of lr 1e-3 on a fixed
sequence of gradients: an Adam step moves p by about lr = 0.13 spacings, under the half
spacing that round-to-nearest keeps, so an uncompensated bf16 run stalls while the float32
one moves ~1.8 spacings on average.  Each run is measured against its own float32 run (same
class, float32 parameters and state), in bf16 spacings of the float32 value.
"""
import inspect

import pytest
import torch

from theory_tests.support.optimi_conventions import (OPTIMI_ADAMW_DEFAULTS, from_optimi_adamw,
                                                     gradients, in_ulps,
                                                     load_optimi, start, trajectory)

optimi = load_optimi()
SHAPE, STEPS, LR = (64, 32), 300, 1e-3


@pytest.fixture(scope="module")
def runs():
    p0, grads = start(SHAPE), gradients(SHAPE, STEPS)

    def peer(dtype, kahan, wd):
        return trajectory(lambda p: optimi.AdamW([p], lr=LR, weight_decay=wd, kahan_sum=kahan,
                                                 foreach=False, triton=False), p0, grads, dtype)
    out = {}
    for wd in (0.0, 0.1):
        out[wd] = dict(float32=peer(torch.float32, False, wd)[0],
                       kahan=peer(torch.bfloat16, True, wd),
                       plain=peer(torch.bfloat16, False, wd)[0])
    out["p0"] = p0
    return out


def test_the_installed_optimi_and_its_defaults_are_the_maps():
    signature = inspect.signature(optimi.AdamW.__init__)
    installed = {k: v.default for k, v in signature.parameters.items()
                 if k not in ("self", "params", "lr")}
    assert installed == OPTIMI_ADAMW_DEFAULTS


def test_optimis_kahan_run_follows_float32_and_the_plain_bf16_run_stalls(runs):
    ref = runs[0.0]["float32"]
    p, comp = runs[0.0]["kahan"]
    assert in_ulps(runs["p0"], ref).mean() > 1.5           # the float32 run moves
    assert in_ulps(runs[0.0]["plain"], ref).mean() > 1.5   # the plain bf16 run stays behind
    assert in_ulps(p, ref).max() <= 1.0                     # p: within a spacing everywhere
    compensated = p.float() + comp.float()
    assert in_ulps(compensated, ref).mean() < 0.1           # p + c: measured 0.029
    assert in_ulps(compensated, ref).max() < 0.5            # measured 0.18


def test_optimis_weight_decay_is_lost_below_half_a_spacing(runs):
    """Its decay multiplies the bf16 parameter outside the compensation: each step's
    lr wd |p| = 1e-4 |p| is under half a spacing (2^-8 |p|), so the Kahan run misses the
    whole decay: about 300 x 1e-4 |p| = 0.03 |p|, 4-8 spacings, which is its whole distance
    from the float32 run."""
    ref, p0 = runs[0.1]["float32"], runs["p0"].float()
    p, comp = runs[0.1]["kahan"]
    missed = in_ulps(p.float() + comp.float(), ref)
    decay = 0.03 * p0.abs() / torch.exp2(torch.floor(torch.log2(ref.abs())) - 7)
    assert missed.mean() > 4.0
    assert (missed - decay).abs().mean() < 0.5  # what it misses is the decay


@pytest.fixture(scope="module")
def our_runs():
    p0, grads = start(SHAPE), gradients(SHAPE, STEPS)

    def ours(dtype, kahan, wd, **extra):
        def make(p):
            mapping = from_optimi_adamw([("p", p)], LR, weight_decay=wd, kahan_sum=kahan)
            for group in mapping.param_groups:
                group.update(extra)
            return mapping.build()
        return trajectory(make, p0, grads, dtype)
    out = {}
    for wd in (0.0, 0.1):
        out[wd] = dict(float32=ours(torch.float32, False, wd)[0],
                       kahan=ours(torch.bfloat16, True, wd),
                       plain=ours(torch.bfloat16, False, wd)[0])
    out["f32_state"] = ours(torch.bfloat16, True, 0.0, state_dtype=torch.float32)
    out["p0"] = p0
    return out


def test_ours_with_kahan_follows_float32_and_without_it_stalls(our_runs):
    ref = our_runs[0.0]["float32"]
    p, comp = our_runs[0.0]["kahan"]
    assert in_ulps(our_runs[0.0]["plain"], ref).mean() > 1.5
    assert in_ulps(p, ref).max() <= 1.0
    compensated = p.float() + comp.float()
    assert in_ulps(compensated, ref).mean() < 0.1
    assert in_ulps(compensated, ref).max() < 0.5


def test_ours_keeps_the_weight_decay_that_optimi_loses(our_runs, runs):
    """Ours decays x = p + c in float32 (LP3): with wd 0.1 it stays as close to its float32
    run as without decay, where optimi's Kahan run misses the whole decay (4-8 spacings)."""
    ref = our_runs[0.1]["float32"]
    p, comp = our_runs[0.1]["kahan"]
    ours = in_ulps(p.float() + comp.float(), ref)
    peer_p, peer_c = runs[0.1]["kahan"]
    peer = in_ulps(peer_p.float() + peer_c.float(), runs[0.1]["float32"])
    assert ours.mean() < 0.1 and peer.mean() > 4.0


def test_with_float32_state_only_the_compensation_is_left(our_runs):
    """bf16 parameters with a float32 state: the moments are the float32 run's to rounding,
    so what separates p + c from the float32 trajectory is the compensation's own bf16
    roundings (2^-9 of |c| <= half a spacing per step)."""
    ref = our_runs[0.0]["float32"]
    p, comp = our_runs["f32_state"]
    assert in_ulps(p.float() + comp.float(), ref).max() < 0.05
