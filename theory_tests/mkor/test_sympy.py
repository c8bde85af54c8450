"""Symbolic proofs (sympy) of MKOR's rank-1 inverse identities (K7, K8, K9, K16).

The reference functions are dtype-agnostic, so they run here unchanged on NumPy object
arrays of sympy symbols: these are proofs about the code itself, not a retyped formula.
Every identity is checked by reducing each entry with ``sympy.cancel`` to exactly 0.
"""
import numpy as np
import pytest
import sympy as sp

from reference.mkor.preconditioner import (ema_inverse_update, printed_algorithm1_update, sherman_morrison,
                            symmetrise)

gamma = sp.Symbol("gamma", positive=True)


def symbolic_case(d):
    """A generic symmetric J (entries j_ik = j_ki) and a generic vector v, as sympy
    matrices and as the object arrays the reference functions take."""
    J = sp.Matrix(d, d, lambda i, k: sp.Symbol(f"j{min(i, k)}{max(i, k)}"))
    v = sp.Matrix(sp.symbols(f"v0:{d}"))
    return J, v, np.array(J.tolist(), dtype=object), np.array(list(v), dtype=object)


def to_matrix(array):
    return sp.Matrix(np.asarray(array, dtype=object).tolist())


def is_zero(M):
    return M.applyfunc(sp.cancel) == sp.zeros(*M.shape)


@pytest.mark.parametrize("d", [2, 3])
def test_sherman_morrison_inverts_rank1_sum(d):
    """K7: (J^{-1} + v v^T) SM(J, v) = I for a generic symmetric J."""
    J, v, J_arr, v_arr = symbolic_case(d)
    SM = to_matrix(sherman_morrison(J_arr, v_arr))
    assert is_zero((J.inv() + v * v.T) * SM - sp.eye(d))


# d = 3 is slow (~5 s of symbolic simplification each); the mutants run it
@pytest.mark.parametrize("d", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_paper_update_inverts_the_factor_ema(d):
    """K8: (gamma J^{-1} + (1-gamma) v v^T) ema_inverse_update(J, v, gamma) = I."""
    J, v, J_arr, v_arr = symbolic_case(d)
    F = to_matrix(ema_inverse_update(J_arr, v_arr, gamma))
    assert is_zero((gamma * J.inv() + (1 - gamma) * v * v.T) * F - sp.eye(d))


# d = 3 is slow (~5 s of symbolic simplification each); the mutants run it
@pytest.mark.parametrize("d", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_paper_equivalent_forms(d):
    """K8's equivalent forms:
    (a) gamma^{-1} J - (1-gamma) / (gamma^2 (1 + (1-gamma) gamma^{-1} v^T J v)) J v v^T J;
    (b) SM(J / gamma, sqrt(1 - gamma) v) (CLN's invert_factor)."""
    J, v, J_arr, v_arr = symbolic_case(d)
    boxed = to_matrix(ema_inverse_update(J_arr, v_arr, gamma))
    vJv = (v.T * J * v)[0, 0]
    form_a = J / gamma - (1 - gamma) / (gamma**2 * (1 + (1 - gamma) / gamma * vJv)) * J * v * v.T * J
    assert is_zero(boxed - form_a)
    scaled_v = np.array([sp.sqrt(1 - gamma) * x for x in v_arr], dtype=object)
    form_b = to_matrix(symmetrise(sherman_morrison(J_arr / gamma, scaled_v)))
    assert is_zero(boxed - form_b)


def test_paper_update_growth_off_v_is_gamma_to_minus_k():
    """K16 by induction on k (symbolic k and c): with v = c e_1 and
    J_k = diag(1 / (gamma^k + (1 - gamma^k) c^2), gamma^{-k}), one update gives J_{k+1};
    J_0 = I is the case k = 0. So off e_1 the entries are gamma^{-k}: > 2 first at
    k = ceil(ln 2 / ln(1/gamma)) (14 for gamma = 0.95)."""
    k, c = sp.symbols("k c", positive=True)

    def J_of(k):
        return np.array([[1 / (gamma**k + (1 - gamma**k) * c**2), 0], [0, gamma**-k]], dtype=object)

    assert to_matrix(J_of(0)).applyfunc(sp.simplify) == sp.eye(2)
    step = to_matrix(ema_inverse_update(J_of(k), np.array([c, 0], dtype=object), gamma))
    assert (step - to_matrix(J_of(k + 1))).applyfunc(sp.simplify) == sp.zeros(2, 2)
    assert sp.ceiling(sp.log(2) / sp.log(1 / sp.Rational(95, 100))) == 14


def rational_example():
    """An exact SPD counterexample: J = [[2, 1], [1, 2]], v = (1, 0), gamma = 1/2."""
    J = np.array([[sp.Integer(2), sp.Integer(1)], [sp.Integer(1), sp.Integer(2)]], dtype=object)
    v = np.array([sp.Integer(1), sp.Integer(0)], dtype=object)
    g = sp.Rational(1, 2)
    target = (g * to_matrix(J).inv() + (1 - g) * to_matrix(v) * to_matrix(v).T).inv()
    return J, v, g, target


def test_printed_algorithm1_line_is_not_the_inverse():
    """K9: exact arithmetic. The corrected update hits inv(gamma J^{-1} + (1-gamma) v v^T)
    exactly; Algorithm 1's printed line 7 does not.

    By hand: J v = (2, 1), v^T J v = 2, J v v^T J = [[4, 2], [2, 1]].
    Target: gamma J^{-1} + (1-gamma) v v^T = [[5/6, -1/6], [-1/6, 1/3]], det 1/4,
    inverse [[4/3, 2/3], [2/3, 10/3]].
    Printed: coefficient (1/2) / ((1/4)(1 + (1/4) 2)) = 4/3, so
    gamma J + (4/3) J v v^T J = [[19/3, 19/6], [19/6, 7/3]].
    """
    J, v, g, target = rational_example()
    third, sixth = sp.Rational(1, 3), sp.Rational(1, 6)
    assert target == sp.Matrix([[4 * third, 2 * third], [2 * third, 10 * third]])
    assert to_matrix(ema_inverse_update(J, v, g)) == target
    printed = to_matrix(printed_algorithm1_update(J, v, g))
    assert printed == sp.Matrix([[19 * third, 19 * sixth], [19 * sixth, 7 * third]])
    assert printed != target


def test_printed_line_has_misplaced_gammas():
    """With v = 0 the exact update is J / gamma (the inverse of gamma J^{-1}), but the
    printed line returns gamma J: its gammas sit on the wrong side."""
    J, v, J_arr, v_arr = symbolic_case(2)
    zero = np.zeros(2, dtype=object) * sp.Integer(0)
    assert to_matrix(ema_inverse_update(J_arr, zero, gamma)) == J / gamma
    assert to_matrix(printed_algorithm1_update(J_arr, zero, gamma)) == gamma * J
