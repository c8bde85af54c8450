"""K-FAC baseline (K19) of the NumPy reference: factors, damping, eigen form, KL-clip."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from theory_tests.support.mkor_cases import EPS, seeds
from reference.baselines.kfac import (KFACConfig, KFACReference, damped_inverse, eigen_precondition,
                            ema, inverse_precondition, kfac_factors, kl_clip)


def random_psd(rng, d, rank=None):
    X = rng.normal(size=(d, rank or d))
    return X @ X.T / (rank or d)


def test_factors_are_row_second_moments():
    rng = np.random.default_rng(0)
    a, g = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 3, 5))  # N = 6 rows
    A, G = kfac_factors(a, g, has_bias=True)
    rows_a = np.column_stack([a.reshape(6, 4), np.ones(6)])
    rows_g = 6 * g.reshape(6, 5)  # K3: undo the mean-reduction
    A_loop = sum(np.outer(r, r) for r in rows_a) / 6
    G_loop = sum(np.outer(r, r) for r in rows_g) / 6
    np.testing.assert_allclose(A, A_loop, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(G, G_loop, rtol=1e-14, atol=1e-14)
    assert A[-1, -1] == 1.0


def test_ema_weights_the_old_factor_by_decay():
    assert ema(None, 3.0, 0.95) == 3.0
    assert ema(1.0, 3.0, 0.75) == 0.75 * 1.0 + 0.25 * 3.0


@given(seed=seeds, d=st.integers(1, 8), log_damping=st.floats(-4, 0))
def test_damped_inverse_inverts(seed, d, log_damping):
    rng = np.random.default_rng(seed)
    F, damping = random_psd(rng, d, rank=max(1, d // 2)), 10.0**log_damping
    M = F + damping * np.eye(d)
    # Backward-stable inverse: residual <= c d eps cond(M); cond <= (||F|| + damping)/damping.
    cond = (np.linalg.norm(F, 2) + damping) / damping
    np.testing.assert_allclose(M @ damped_inverse(F, damping), np.eye(d), atol=100 * d * EPS * cond)


@given(seed=seeds, d_out=st.integers(1, 5), d_in=st.integers(1, 5), log_damping=st.floats(-3, 0))
def test_eigen_form_is_the_damped_kronecker_solve(seed, d_out, d_in, log_damping):
    """V = (G (x) A + damping I)^{-1} vec(G_hat), with row-major vec (G X A <-> G (x) A)."""
    rng = np.random.default_rng(seed)
    A, G = random_psd(rng, d_in, rank=2), random_psd(rng, d_out, rank=2)
    G_hat, damping = rng.normal(size=(d_out, d_in)), 10.0**log_damping
    V = eigen_precondition(A, G, G_hat, damping)
    K = np.kron(G, A) + damping * np.eye(d_out * d_in)
    direct = np.linalg.solve(K, G_hat.ravel()).reshape(d_out, d_in)
    cond = (np.linalg.norm(G, 2) * np.linalg.norm(A, 2) + damping) / damping
    np.testing.assert_allclose(V, direct, rtol=0, atol=100 * EPS * cond * np.abs(direct).max() + 1e-300)


@given(seed=seeds, d_out=st.integers(1, 5), d_in=st.integers(1, 5), log_damping=st.floats(-3, 0))
def test_inverse_form_equals_eigen_form_of_shifted_factors(seed, d_out, d_in, log_damping):
    """(G + dI)^{-1} X (A + dI)^{-1} is the eigen form of the shifted factors, undamped:
    its eigenvalue products are (lam_G + d)(lam_A + d), not lam_G lam_A + d."""
    rng = np.random.default_rng(seed)
    A, G = random_psd(rng, d_in), random_psd(rng, d_out)
    G_hat, damping = rng.normal(size=(d_out, d_in)), 10.0**log_damping
    via_inverse = inverse_precondition(A, G, G_hat, damping)
    via_eigen = eigen_precondition(A + damping * np.eye(d_in), G + damping * np.eye(d_out), G_hat, 0.0)
    cond = (np.linalg.norm(G, 2) + damping) * (np.linalg.norm(A, 2) + damping) / damping**2
    np.testing.assert_allclose(via_inverse, via_eigen, rtol=0,
                               atol=100 * EPS * cond * np.abs(via_eigen).max())


def test_identity_factors_give_the_scaled_gradient():
    rng = np.random.default_rng(1)
    G_hat = rng.normal(size=(3, 4))
    np.testing.assert_allclose(eigen_precondition(np.eye(4), np.eye(3), G_hat, 0.1), G_hat / 1.1,
                               rtol=1e-15)
    ref = KFACReference(KFACConfig(kl_clip=None, damping=0.1))
    layer = {"A_new": np.eye(4), "G_new": np.eye(3), "grad_W": G_hat[:, :3], "grad_b": G_hat[:, 3]}
    (dW, db), = ref.step([layer])
    np.testing.assert_allclose(dW, G_hat[:, :3] / 1.1, rtol=1e-15)
    np.testing.assert_allclose(db, G_hat[:, 3] / 1.1, rtol=1e-15)


@given(seed=seeds, log_lr=st.floats(-4, 1), log_clip=st.floats(-6, 0), log_scale=st.floats(-3, 3))
def test_kl_clip_bounds_the_quadratic_kl(seed, log_lr, log_clip, log_scale):
    rng = np.random.default_rng(seed)
    grads = [rng.normal(size=(3, 2)), rng.normal(size=4)]
    updates = [g * 10.0**log_scale + 0.1 * rng.normal(size=g.shape) for g in grads]
    lr, clip = 10.0**log_lr, 10.0**log_clip
    nu = kl_clip(updates, grads, lr, clip)
    vg = abs(sum(np.sum(v * g) for v, g in zip(updates, grads))) * lr**2
    assert 0 < nu <= 1
    # nu^2 lr^2 |<V, G_hat>| is the scaled step's quadratic KL estimate (F V = G_hat);
    # a sqrt and a few products: relative slack 10 eps.
    assert nu**2 * vg <= clip * (1 + 10 * EPS)
    if vg <= clip:
        assert nu == 1.0
    else:
        assert nu**2 * vg == pytest.approx(clip, rel=10 * EPS)
    assert kl_clip([np.zeros(2)], [np.ones(2)], lr, clip) == 1.0


def test_reference_schedule_and_ema():
    """factor_freq = 1, inv_freq = 3: factors are EMA'd every step, decomposed on steps
    0 and 3 only; steps 1-2 use step 0's decomposition."""
    rng = np.random.default_rng(2)
    c = KFACConfig(inv_freq=3, kl_clip=None, damping=1e-2, factor_decay=0.9)
    ref = KFACReference(c)
    A = G = A_dec = G_dec = None
    for t in range(5):
        a, g = rng.normal(size=(8, 3)), rng.normal(size=(8, 2)) / 8
        A_new, G_new = kfac_factors(a, g, has_bias=True)
        grad_W, grad_b = rng.normal(size=(2, 3)), rng.normal(size=2)
        A, G = ema(A, A_new, 0.9), ema(G, G_new, 0.9)
        if t % 3 == 0:
            A_dec, G_dec = A.copy(), G.copy()
        (dW, db), = ref.step([{"A_new": A_new, "G_new": G_new, "grad_W": grad_W, "grad_b": grad_b}])
        V = eigen_precondition(A_dec, G_dec, np.column_stack([grad_W, grad_b]), 1e-2)
        np.testing.assert_allclose(dW, V[:, :-1], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(db, V[:, -1], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(ref.A[0], A, rtol=1e-15)


def test_reference_inverse_method_and_kl_clip_applied():
    rng = np.random.default_rng(3)
    A_new, G_new = random_psd(rng, 3), random_psd(rng, 2)
    layer = {"A_new": A_new, "G_new": G_new, "grad_W": rng.normal(size=(2, 3)), "grad_b": None}
    c = KFACConfig(method="inverse", kl_clip=1e-6, lr=1.0, damping=1e-2)
    (dW, db), = KFACReference(c).step([layer])
    V = inverse_precondition(A_new, G_new, layer["grad_W"], 1e-2)
    nu = kl_clip([V], [layer["grad_W"]], 1.0, 1e-6)
    assert nu < 1 and db is None
    np.testing.assert_allclose(dW, nu * V, rtol=1e-12)
    with pytest.raises(ValueError):
        KFACReference(KFACConfig(method="cholesky"))
