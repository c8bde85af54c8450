"""Preconditioning, rescaling and the whole-model step of the NumPy MKOR reference
(KT6, KT7, KT9, KT10, KT11; K2, K12-K14)."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from theory_tests.support.mkor_cases import no_cubic_linalg, seeds  # noqa: F401  (fixture)
from reference.common import first_order
from reference.mkor.preconditioner import (MKORConfig, MKORReference, backbone_update, factor_update,
                            linear_rank1_vectors, precondition, rescale)


def joint_norm(W, b):
    return np.sqrt(np.sum(np.square(W)) + (0.0 if b is None else np.sum(np.square(b))))


def sum_norms(W, b):
    return np.linalg.norm(np.ravel(W)) + (0.0 if b is None else np.linalg.norm(b))


# ----------------------------------------------------------------- KT6: rescale

@given(seed=seeds, shape=st.sampled_from([(3,), (4, 5), (2, 3, 2, 2)]), with_bias=st.booleans(),
       log_ratio=st.floats(-8, 8))
def test_rescale_preserves_the_chosen_norm(seed, shape, with_bias, log_ratio):
    rng = np.random.default_rng(seed)
    grad_W = rng.normal(size=shape)
    grad_b = rng.normal(size=shape[0]) if with_bias else None
    delta_W = rng.normal(size=shape) * 10.0**log_ratio
    delta_b = rng.normal(size=shape[0]) * 10.0**log_ratio if with_bias else None
    # Norms of <= 30 entries and one division: relative error <= ~40 eps; allow 1e-13.
    for mode, norm in (("joint", joint_norm), ("sum_of_norms", sum_norms)):
        out_W, out_b = rescale(delta_W, delta_b, grad_W, grad_b, mode)
        assert out_W.shape == grad_W.shape
        assert norm(out_W, out_b) == pytest.approx(norm(grad_W, grad_b), rel=1e-13)
        # A positive rescale of Delta: the direction is kept.
        np.testing.assert_allclose(out_W * norm(delta_W, delta_b),
                                   delta_W * norm(grad_W, grad_b), rtol=1e-13)


def test_rescale_modes_differ_with_a_bias():
    grad_W, grad_b = np.array([[3.0]]), np.array([4.0])
    delta_W, delta_b = np.array([[1.0]]), np.array([0.0])
    joint, _ = rescale(delta_W, delta_b, grad_W, grad_b, "joint")
    code, _ = rescale(delta_W, delta_b, grad_W, grad_b, "sum_of_norms")
    assert joint[0, 0] == 5.0 and code[0, 0] == 7.0  # ||(3,4)|| = 5; 3 + 4 = 7


@pytest.mark.parametrize("mode", ["joint", "sum_of_norms"])
def test_rescale_degenerate_cases_never_nan(mode):
    zero_W, zero_b = np.zeros((2, 3)), np.zeros(2)
    delta_W, delta_b = np.ones((2, 3)), np.ones(2)
    out_W, out_b = rescale(delta_W, delta_b, zero_W, zero_b, mode)  # zero gradient
    assert out_W is zero_W and out_b is zero_b
    grad_W, grad_b = np.ones((2, 3)), np.ones(2)
    for bad_W, bad_b in ((np.zeros((2, 3)), np.zeros(2)),           # zero Delta
                         (np.full((2, 3), 5e-324), np.zeros(2)),   # s overflows to inf
                         (np.full((2, 3), np.nan), np.zeros(2)),   # NaN Delta
                         (np.full((2, 3), np.inf), np.zeros(2))):  # inf Delta
        out_W, out_b = rescale(bad_W, bad_b, grad_W, grad_b, mode)
        assert out_W is grad_W and out_b is grad_b
    with pytest.raises(ValueError):
        rescale(delta_W, delta_b, grad_W, grad_b, "frobenius")


# ------------------------------------------------------- KT9: preconditioning

@given(seed=seeds, shape=st.sampled_from([(3, 4), (2, 3, 2, 2), (1, 1)]), with_bias=st.booleans())
def test_precondition_is_kronecker_and_splits_bias(seed, shape, with_bias):
    rng = np.random.default_rng(seed)
    d_out, d_in = shape[0], int(np.prod(shape[1:]))
    d_in_prime = d_in + with_bias
    L_inv, R_inv = rng.normal(size=(d_out, d_out)), rng.normal(size=(d_in_prime, d_in_prime))
    grad_W = rng.normal(size=shape)
    grad_b = rng.normal(size=d_out) if with_bias else None
    delta_W, delta_b = precondition(L_inv, R_inv, grad_W, grad_b)
    assert delta_W.shape == grad_W.shape
    G_hat = grad_W.reshape(d_out, d_in)
    if with_bias:
        G_hat = np.column_stack([G_hat, grad_b])
    # Independent oracle: vec(L G R) = (R^T kron L) vec(G) (column-major vec).
    vec = np.kron(R_inv.T, L_inv) @ G_hat.ravel(order="F")
    full = vec.reshape(d_out, d_in_prime, order="F")
    # Sums of <= 16 products of O(1) normals, twice: absolute error well below 1e-12.
    np.testing.assert_allclose(delta_W.reshape(d_out, d_in), full[:, :d_in], atol=1e-12)
    if with_bias:
        np.testing.assert_allclose(delta_b, full[:, -1], atol=1e-12)
    else:
        assert delta_b is None


def test_conv_shape_round_trip_with_identity():
    grad_W = np.arange(2 * 3 * 2 * 2, dtype=float).reshape(2, 3, 2, 2)
    delta_W, delta_b = precondition(np.eye(2), np.eye(13), grad_W, np.array([7.0, 8.0]))
    np.testing.assert_array_equal(delta_W, grad_W)
    np.testing.assert_array_equal(delta_b, [7.0, 8.0])


# ---------------------------------------------- whole-model step: helpers

def random_layers(rng, specs, with_vectors=True):
    """specs: list of (grad_W shape, has_bias, sgd)."""
    layers = []
    for shape, has_bias, sgd in specs:
        d_out, d_in = shape[0], int(np.prod(shape[1:]))
        layer = {"grad_W": rng.normal(size=shape),
                 "grad_b": rng.normal(size=d_out) if has_bias else None, "sgd": sgd,
                 "a_bar": None, "g_bar": None}
        if with_vectors:
            layer["a_bar"] = np.append(rng.normal(size=d_in), [1.0] if has_bias else [])
            layer["g_bar"] = rng.normal(size=d_out) * 2
        layers.append(layer)
    return layers


SPECS = [((4, 3), True, False), ((2, 3, 2, 2), False, False), ((3, 4), True, True)]


# ------------------------------------------------- KT7: identity factors

@pytest.mark.parametrize("variant", ["paper", "released"])
def test_identity_factors_return_the_gradient_and_sgd_layers_pass(variant):
    rng = np.random.default_rng(0)
    # inv_freq = 3: step 0 updates the factors, steps 1 and 2 use them.
    ref = MKORReference(MKORConfig(variant=variant, inv_freq=3))
    ref.L_inv, ref.R_inv = [], []
    layers = random_layers(rng, SPECS, with_vectors=False)
    ref._init_factors(MKORReference.layer_dims(layers))
    ref.steps = 1  # not an update step: the factors stay I
    for (out_W, out_b), layer in zip(ref.step(layers), layers):
        np.testing.assert_array_equal(out_W, layer["grad_W"])  # I G I and s = 1 are exact
        if layer["grad_b"] is not None:
            np.testing.assert_array_equal(out_b, layer["grad_b"])
    # After real factor updates (two: "released" spends its first one on J = I), the
    # sgd layer is still passed through as is; the other layers leave "sgd" to its
    # default (False), so they are preconditioned.
    for ref.steps in (3, 6):
        layers = random_layers(rng, SPECS)
        for layer in layers[:2]:
            del layer["sgd"]
        out = ref.step(layers)
    assert out[2][0] is layers[2]["grad_W"] and out[2][1] is layers[2]["grad_b"]
    assert not np.array_equal(out[0][0], layers[0]["grad_W"])


# ---------------------------------------------------------- KT10: schedule

@pytest.mark.parametrize("variant", ["paper", "released"])
@pytest.mark.parametrize("inv_freq,warmup", [(4, 0), (4, 3), (1, 0), (5, 7)])
def test_factors_change_only_on_schedule(variant, inv_freq, warmup):
    rng = np.random.default_rng(1)
    ref = MKORReference(MKORConfig(variant=variant, inv_freq=inv_freq, warmup_steps=warmup))
    for t in range(14):
        layers = random_layers(rng, SPECS)
        before = [(L.copy(), R.copy()) for L, R in zip(ref.L_inv, ref.R_inv)]
        ref.step(layers)
        scheduled = t % inv_freq == 0 or t < warmup
        for m, (L_old, R_old) in enumerate(before):
            changed = not (np.array_equal(ref.L_inv[m], L_old) and np.array_equal(ref.R_inv[m], R_old))
            first_identity = variant == "released" and t == 0  # K12: J = I, vector dropped
            expect = scheduled and not first_identity and not layers[m]["sgd"]
            assert changed == expect, (t, m)
        assert ref.steps == t + 1
    # sgd layers keep identity factors forever.
    np.testing.assert_array_equal(ref.L_inv[2], np.eye(3))


def test_vectors_required_on_update_steps():
    ref = MKORReference(MKORConfig(inv_freq=2))
    with pytest.raises(ValueError, match="a_bar and g_bar"):
        ref.step(random_layers(np.random.default_rng(0), SPECS, with_vectors=False))


def test_non_finite_vectors_skip_that_factor_and_are_counted():
    rng = np.random.default_rng(2)
    ref = MKORReference(MKORConfig(inv_freq=1))
    layers = random_layers(rng, SPECS)
    layers[0]["a_bar"] = layers[0]["a_bar"].copy()
    layers[0]["a_bar"][1] = np.nan
    layers[1]["g_bar"] = np.full_like(layers[1]["g_bar"], np.inf)
    out = ref.step(layers)
    np.testing.assert_array_equal(ref.R_inv[0], np.eye(4))      # skipped
    np.testing.assert_array_equal(ref.L_inv[1], np.eye(2))      # skipped
    assert not np.array_equal(ref.L_inv[0], np.eye(4))          # updated
    assert not np.array_equal(ref.R_inv[1], np.eye(12))         # updated
    assert ref.skipped_updates == 2
    assert all(np.all(np.isfinite(W)) for W, _ in out)
    assert ref.updates_a[0] == 0 and ref.updates_g[0] == 1


# ---------------------------------------------------- K12: flag coupling

@pytest.mark.parametrize("coupling", ["coupled", "per_factor"])
def test_deferred_flags_couple_a_and_g(coupling):
    """Released column: a g-factor over 2 after its SM step flags the layer; at the next
    update, both factors (coupled) or only L^{-1} (per_factor) are reset to I."""
    rng = np.random.default_rng(4)
    ref = MKORReference(MKORConfig(variant="released", inv_freq=1, first_update="sm",
                                   stabilizer_coupling=coupling))
    layers = random_layers(rng, SPECS[:1])
    ref._init_factors(MKORReference.layer_dims(layers))
    ref.L_inv[0] = 3.0 * np.eye(4)   # 0.95*3 + 0.05 = 2.9, SM keeps entries > 2 off v
    layers[0]["g_bar"] = np.array([1e-3, 0, 0, 0])
    ref.step(layers)
    assert ref.reset_g[0] and ref.reset_a[0] == (coupling == "coupled")
    R_before = ref.R_inv[0].copy()
    ref.step(random_layers(rng, SPECS[:1]))
    np.testing.assert_array_equal(ref.L_inv[0], np.eye(4))
    if coupling == "coupled":
        np.testing.assert_array_equal(ref.R_inv[0], np.eye(4))
    else:
        assert not np.array_equal(ref.R_inv[0], np.eye(4))
        assert not np.array_equal(ref.R_inv[0], R_before)


def test_before_sm_coupling_blends_both_factors():
    rng = np.random.default_rng(5)
    config = MKORConfig(inv_freq=1, stabilizer_coupling="coupled", stat_decay=0.9, zeta=0.8)
    ref = MKORReference(config)
    layers = random_layers(rng, SPECS[:1])
    ref._init_factors(MKORReference.layer_dims(layers))
    ref.L_inv[0] = 3.0 * np.eye(4)
    R0 = ref.R_inv[0].copy()
    ref.step(layers)
    expected_R, fired = factor_update(R0, layers[0]["a_bar"], stat_decay=0.9, zeta=0.8, reset_flag=True)
    assert fired
    np.testing.assert_array_equal(ref.R_inv[0], expected_R)


# ---------------------------------------------- wiring and a training sanity check

def test_step_equals_composed_equations():
    """MKORReference.step == factor_update (R then L) + precondition + rescale by hand."""
    rng = np.random.default_rng(6)
    config = MKORConfig(inv_freq=3, stat_decay=0.9)
    ref = MKORReference(config)
    L, R = np.eye(4), np.eye(4)
    for t in range(9):
        layers = random_layers(rng, [((4, 3), True, False)])
        layer = layers[0]
        if t % 3 == 0:
            R, _ = factor_update(R, layer["a_bar"], stat_decay=0.9)
            L, _ = factor_update(L, layer["g_bar"], stat_decay=0.9)
        dW, db = precondition(L, R, layer["grad_W"], layer["grad_b"])
        expected = rescale(dW, db, layer["grad_W"], layer["grad_b"], "joint")
        got = ref.step(layers)[0]
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])


@pytest.mark.parametrize("variant", ["paper", "released"])
def test_mkor_with_sgd_backbone_fits_least_squares(variant):
    """Sanity: a Linear layer trained with MKOR + SGD on a consistent least-squares
    problem reaches < 1% of its initial loss in 60 steps."""
    rng = np.random.default_rng(8)
    X, W_true, b_true = rng.normal(size=(64, 5)), rng.normal(size=(3, 5)), rng.normal(size=3)
    Y = X @ W_true.T + b_true
    W, b = np.zeros((3, 5)), np.zeros(3)
    ref = MKORReference(MKORConfig(variant=variant, inv_freq=5))
    states = [{}, {}]

    def loss_and_grads(W, b):
        r = X @ W.T + b - Y
        g_out = r / X.shape[0]                        # mean-reduced: 0.5 mean ||r_i||^2
        return 0.5 * np.mean(np.sum(r**2, axis=1)), g_out.T @ X, g_out.sum(axis=0), g_out

    first = loss_and_grads(W, b)[0]
    for _ in range(60):
        _, gW, gb, g_out = loss_and_grads(W, b)
        a_bar, g_bar = linear_rank1_vectors(X, g_out, has_bias=True)
        params = [W, b]

        def backbone(m, dW, db):
            params[0] = backbone_update("sgd", params[0], dW, states[0], lr=0.1, momentum=0.9)
            params[1] = first_order.sgd(params[1], db, states[1], lr=0.1, momentum=0.9)

        ref.step([{"grad_W": gW, "grad_b": gb, "a_bar": a_bar, "g_bar": g_bar}], backbone)
        W, b = params
    assert loss_and_grads(W, b)[0] < 0.01 * first


# ------------------------------------------------------- config

def test_config_fills_variant_columns():
    paper, released = MKORConfig(), MKORConfig(variant="released")
    assert (paper.stabilizer_timing, paper.stabilizer_reset, paper.stabilizer_coupling,
            paper.first_update, paper.rescale) == ("before_sm", "blend", "per_factor", "sm", "joint")
    assert (released.stabilizer_timing, released.stabilizer_reset, released.stabilizer_coupling,
            released.first_update, released.rescale) == (
        "deferred", "identity", "coupled", "identity", "sum_of_norms")
    assert MKORConfig(variant="released", rescale="joint").rescale == "joint"
    for bad in ({"variant": "fp16"}, {"stabilizer_reset": "zero"}, {"inv_freq": 0},
                {"stabilizer_coupling": "both"}):
        with pytest.raises(ValueError):
            MKORConfig(**bad)


# ---------------------------------------------- KT11: the step is O(d^2) too

@pytest.mark.parametrize("variant", ["paper", "released"])
def test_step_uses_no_cubic_routine(no_cubic_linalg, variant):
    rng = np.random.default_rng(9)
    ref = MKORReference(MKORConfig(variant=variant, inv_freq=2, stabilizer_coupling="coupled"))
    for _ in range(12):
        ref.step(random_layers(rng, SPECS))
    assert ref.steps == 12
