"""Closed-form tests of MKOR's pure tensor functions (torch_impl.mkor.factors).

Each test checks an identity of spec MKOR.md (KT1-KT7, KT9) in float64 against an
explicit dense computation (torch.linalg.inv is fine *here*: it is the oracle, not
the code under test). Tolerances are stated per test with the reason.
"""
import math

import pytest
import torch
from hypothesis import given, strategies as st

from torch_impl.mkor import factors

# "released" ignores stat_decay (K10) and resets to I (zeta unused); the threshold is its 2
RELEASED = dict(stat_decay=0.95, zeta=0.9, threshold=2.0)


f64 = torch.float64


def spd(d, seed, cond=10.0):
    """A random SPD matrix Q diag(lam) Q^T with eigenvalues in [1, cond]."""
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=f64))
    lam = torch.logspace(0, math.log10(cond), d, dtype=f64)
    return (Q * lam) @ Q.T


def vec(d, seed, scale):
    g = torch.Generator().manual_seed(seed + 1)
    return scale * torch.randn(d, generator=g, dtype=f64)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@given(d=st.integers(1, 24), seed=st.integers(0, 10**6),
       scale=st.sampled_from([1e-3, 1.0, 1e2]))
def test_sherman_morrison_is_the_inverse_of_the_rank1_update(d, seed, scale):
    """KT1: SM(J, v) = (J^{-1} + v v^T)^{-1}, at rtol 100 eps cond(L) (1 + v^T J v): the
    subtraction cancels along v when v^T J v >> 1 (d = 1: 1 - v^2/(1 + v^2)), the
    same amplification as the spec's KT1 tolerance with gamma -> 1/2."""
    L = spd(d, seed)
    v = vec(d, seed, scale)
    J = torch.linalg.inv(L)
    expected = torch.linalg.inv(L + torch.outer(v, v))
    tol = 100 * 2.2e-16 * torch.linalg.cond(L).item() * (1 + (v @ J @ v).item())
    assert rel(factors.sherman_morrison(J, v), expected) < tol


@given(d=st.integers(1, 24), seed=st.integers(0, 10**6),
       gamma=st.floats(0.05, 0.99), scale=st.sampled_from([1e-3, 1.0, 1e2]))
def test_ema_inverse_update_is_the_inverse_of_the_factor_ema(d, seed, gamma, scale):
    """KT1 (paper variant, K8): J_t = (gamma L + (1-gamma) v v^T)^{-1}, at the spec's
    rtol 100 eps cond(L) (1 + (1-gamma) v^T J v / gamma) (cancellation along v)."""
    L = spd(d, seed)
    v = vec(d, seed, scale)
    J = torch.linalg.inv(L)
    expected = torch.linalg.inv(gamma * L + (1 - gamma) * torch.outer(v, v))
    amplification = 1 + (1 - gamma) * (v @ J @ v).item() / gamma
    tol = 100 * 2.2e-16 * torch.linalg.cond(L).item() * amplification
    assert rel(factors.ema_inverse_update(J, v, gamma), expected) < tol


def test_ema_recursion_matches_an_explicitly_accumulated_factor():
    """KT1: ten recursive updates equal the inverse of the explicit EMA factor."""
    d, gamma = 6, 0.9
    L = torch.eye(d, dtype=f64)
    J = torch.eye(d, dtype=f64)
    for k in range(10):
        v = vec(d, k, 1.0)
        L = gamma * L + (1 - gamma) * torch.outer(v, v)
        J = factors.ema_inverse_update(J, v, gamma)
    assert torch.allclose(J, torch.linalg.inv(L), rtol=1e-11, atol=1e-12)


def test_released_update_is_sm_of_the_blended_inverse_and_stays_in_its_bounds():
    """K10 / KT4: J_t = ((0.95 J + 0.05 I)^{-1} + v v^T)^{-1}; from I the spectrum stays
    in [1/(20 + ||v||^2), 1] (K17), so max|J_ij| <= 1 and the stabiliser never fires."""
    d = 8
    J = torch.eye(d, dtype=f64)
    for k in range(200):
        v = vec(d, k, [1e-2, 1.0, 30.0][k % 3])
        blended = 0.95 * J + 0.05 * torch.eye(d, dtype=f64)
        expected = torch.linalg.inv(torch.linalg.inv(blended) + torch.outer(v, v))
        J = factors.released_inverse_update(J, v)
        assert torch.allclose(J, expected, rtol=1e-9, atol=1e-12)
        lam = torch.linalg.eigvalsh(J)
        # 1e-12 slack: eigvalsh and the update both round at ~1e-16 relative.
        assert lam.max() <= 1 + 1e-12
        assert lam.min() >= 1 / (20 + (v @ v).item()) - 1e-12
        assert not factors.needs_stabilising(J, 2.0)


def test_paper_variant_first_trigger_at_update_14():
    """KT4 / K16: v fixed along e1, gamma = 0.95, from I: the perpendicular eigenvalues
    grow like gamma^-k, so max|J_ij| first exceeds 2 after ceil(ln2 / ln(1/0.95)) = 14."""
    d = 4
    J = torch.eye(d, dtype=f64)
    v = torch.zeros(d, dtype=f64)
    v[0] = 1.0
    first = None
    for k in range(1, 30):
        J = factors.ema_inverse_update(J, v, 0.95)
        if first is None and factors.needs_stabilising(J, 2.0):
            first = k
    assert first == math.ceil(math.log(2) / math.log(1 / 0.95)) == 14


@given(seed=st.integers(0, 10**6), zeta=st.floats(0.0, 1.0))
def test_stabiliser_blend_bound_and_spd(seed, zeta):
    """KT5 / KT3: after the blend max|J_ij| <= zeta max|J_ij| + (1 - zeta), and the
    blend of SPD matrices is SPD (convex combination). Exact up to one rounding."""
    J = torch.linalg.inv(spd(5, seed, cond=100.0))
    out = factors.stabilise(J, zeta)
    bound = zeta * factors.max_entry_norm(J) + (1 - zeta)
    assert factors.max_entry_norm(out) <= bound + 1e-15
    assert torch.linalg.eigvalsh(out).min() > 0


def test_needs_stabilising_treats_nan_as_exceeding():
    """Section 5: the code's `NaN > 2` is False; ours must flag a NaN factor."""
    J = torch.eye(3, dtype=f64)
    assert not factors.needs_stabilising(J, 2.0)
    J[0, 1] = float("nan")
    assert factors.needs_stabilising(J, 2.0)


def test_factor_update_before_sm_blends_then_updates():
    """ALG lines 5-8: with max|J| > threshold, the result is the SM step of the blend."""
    J = 3.0 * torch.eye(4, dtype=f64)
    v = vec(4, 0, 1.0)
    out, fired = factors.factor_update(J, v, variant="paper", stat_decay=0.9, zeta=0.9, threshold=2.0)
    assert fired
    # factor_update applies the same map as one affine update (A J + B I - a a^T), so the two
    # differ by float64 rounding of O(1) entries only: 1e-13 relative
    expected = factors.ema_inverse_update(factors.stabilise(J, 0.9), v, 0.9)
    torch.testing.assert_close(out, expected, rtol=1e-13, atol=1e-15)
    out, fired = factors.factor_update(torch.eye(4, dtype=f64), v, variant="paper", stat_decay=0.9,
                                 zeta=0.9, threshold=2.0)
    assert not fired
    torch.testing.assert_close(out, factors.ema_inverse_update(torch.eye(4, dtype=f64), v, 0.9),
                               rtol=1e-13, atol=1e-15)


def test_factor_update_deferred_and_first_identity():
    """K12 (released): a flagged factor is reset to I *instead of* SM-updated; the first
    update returns I and drops v; the flag reports the post-update test."""
    J = vec(9, 3, 1.0).reshape(3, 3)
    J = J @ J.T + torch.eye(3, dtype=f64)
    v = vec(3, 4, 1.0)
    out, fired = factors.factor_update(J, v, variant="released", first=True, **RELEASED)
    assert torch.equal(out, torch.eye(3, dtype=f64)) and not fired
    out, fired = factors.factor_update(J, v, variant="released", reset_flag=torch.tensor(True),
                                 **RELEASED)
    assert torch.equal(out, torch.eye(3, dtype=f64))
    out, fired = factors.factor_update(J, v, variant="released", **RELEASED)  # rounding only, as above
    torch.testing.assert_close(out, factors.released_inverse_update(J, v), rtol=1e-13, atol=1e-15)
    assert bool(fired) == bool(out.abs().max() > 2)


def test_precondition_splits_bias_and_round_trips_conv_layout():
    """KT9: Delta = L^{-1} [W | b] R^{-1}; the conv weight's (out, in*kh*kw) view."""
    g = torch.Generator().manual_seed(0)
    gW = torch.randn(3, 2, 2, 2, generator=g, dtype=f64)
    gb = torch.randn(3, generator=g, dtype=f64)
    L = spd(3, 1)
    R = spd(9, 2)
    dW, db = factors.precondition(L, R, gW, gb)
    full = L @ torch.cat([gW.reshape(3, -1), gb[:, None]], 1) @ R
    assert dW.shape == gW.shape
    tol = 1e-13 * max(1.0, full.abs().max().item())  # relative to the largest entry
    assert torch.allclose(dW.reshape(3, -1), full[:, :-1], rtol=0, atol=tol)
    assert torch.allclose(db, full[:, -1], rtol=0, atol=tol)
    eye3, eye9 = torch.eye(3, dtype=f64), torch.eye(9, dtype=f64)
    dW, db = factors.precondition(eye3, eye9, gW, gb)  # KT7: identity factors are exact
    assert torch.equal(dW, gW) and torch.equal(db, gb)


@pytest.mark.parametrize("mode", ["joint", "sum_of_norms"])
def test_rescale_preserves_the_norm_and_guards_zero(mode):
    """KT6: the output has the gradient's norm (joint: ||[W|b]||; code: the sum of
    norms); a zero gradient stays zero; a zero or NaN update returns the raw gradient."""
    g = torch.Generator().manual_seed(1)
    gW, gb = torch.randn(4, 5, generator=g, dtype=f64), torch.randn(4, generator=g, dtype=f64)
    dW, db = 7.0 * torch.randn(4, 5, generator=g, dtype=f64), torch.randn(4, generator=g, dtype=f64)
    oW, ob = factors.rescale(dW, db, gW, gb, mode)

    def norm(W, b):
        if mode == "joint":
            return torch.cat([W.flatten(), b]).norm()
        return W.norm() + b.norm()

    assert torch.isclose(norm(oW, ob), norm(gW, gb), rtol=1e-14)
    assert torch.allclose(oW / dW, (ob / db).mean().expand_as(oW), rtol=1e-12)
    zW, zb = torch.zeros_like(gW), torch.zeros_like(gb)
    oW, ob = factors.rescale(dW, db, zW, zb, mode)
    assert torch.equal(oW, zW) and torch.equal(ob, zb)
    oW, ob = factors.rescale(zW, zb, gW, gb, mode)
    assert torch.equal(oW, gW) and torch.equal(ob, gb)
    oW, ob = factors.rescale(torch.full_like(dW, float("nan")), db, gW, gb, mode)
    assert torch.equal(oW, gW) and torch.equal(ob, gb)
    oW, ob = factors.rescale(torch.full_like(dW, float("inf")), db, gW, gb, mode)  # inf norm
    assert torch.equal(oW, gW) and torch.equal(ob, gb)
    oW, _ = factors.rescale(dW, None, gW, None, mode)  # no bias
    assert torch.isclose(oW.norm(), gW.norm(), rtol=1e-14)


def test_factor_functions_make_no_host_sync(monkeypatch):
    """Spec: no .item() / bool(tensor) inside the factor path (torch.where only)."""
    J, v = spd(5, 0), vec(5, 0, 1.0)
    gW, gb = torch.randn(5, 4, dtype=f64), torch.randn(5, dtype=f64)

    def boom(*args, **kwargs):
        raise AssertionError("host synchronisation")

    for name in ("__bool__", "item", "__float__", "__int__", "tolist", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    for variant in ("paper", "released"):
        factors.factor_update(J, v, variant=variant, stat_decay=0.95, zeta=0.9, threshold=2.0,
                        first=torch.tensor(False), reset_flag=torch.tensor(True))
    dW, db = factors.precondition(J, torch.eye(5, dtype=f64), gW, gb)
    factors.rescale(dW, db, gW, gb, "joint")
    factors.rescale(dW, db, gW, gb, "sum_of_norms")
