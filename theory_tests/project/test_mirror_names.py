"""``torch_impl`` mirrors ``reference`` (its package docstring's promise), one rule for every
family: a module of ``reference/<family>/`` has its torch twin at the same name in
``torch_impl/<family>/``, and twin modules define the same public functions (a trailing ``_``
marks the in-place form), up to the listed, documented exceptions."""
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("mars", "mkor", "baselines", "common")

# Oracle modules with no torch twin, and why.
ORACLE_ONLY_MODULES = {
    # the theory behind the variance-reduction figure: simulations, not an optimizer
    "mars.variance_reduction",
    # torch.optim itself is the port of SGD/Adam/AdamW; LAMB's is torch_impl/baselines/lamb.py
    # (the first-order rules are common: MKOR's backbones, K15, and MARS's reductions' oracles)
    "common.first_order",
    # the test problems the oracles and figures run on
    "common.problems",
    # the fused mixture-of-experts forward model and its rows: a problem, not an equation. The
    # port takes the gates from the module itself (its _apply_gate, act_fn, norm) and reads the
    # rows in the Kronecker engine (torch_impl/kronecker/experts/; ORACLE_ELSEWHERE below)
    "common.moe",
    # MKOR's per-expert equations: the port runs its 2-D functions (vectors, factors,
    # layer_state) batched over the expert axis
    "mkor.experts",
    # the float64 measure of 16-bit factors (LP5): the explicit factor L_t, the errors of a
    # kept inverse against it and their bound; the port's factors are what it measures
    "mkor.factor_precision",
}
ORACLE_ONLY = {
    # K-FAC's flavours (issue 46): the port writes the columns' pieces inside kfac_columns
    # (softmax, the square roots, the gradient, the draws), its expand statistics are K-FAC's
    # own (kfac_equations' input_stat / grad_stat, per expert batched) and its reduce ones the
    # additive reduce_input_stat / reduce_grad_stat; MKOR's rank-1 statistics are MKOR's port,
    # and the Van Loan rearrangement is analysis, not an optimizer
    "baselines.kfac_flavours": {"softmax", "ce_hessian_sqrt", "mse_hessian_sqrt",
                                "hessian_sqrt", "loss_output_gradient", "sample_targets",
                                "expand_factors", "reduce_factors", "expert_expand_factors",
                                "mkor_rank1_factors", "kronecker_rearrange", "best_kronecker"},
    # fused for memory on the torch side: adamw_step_ / lion_step_ compute direction and decay
    # in place (one temporary)
    "mars.mars_equations": {"adamw_direction", "decoupled_step", "lion_direction"},
    # whole runs over a list of iterates, the oracle's driver of the differential tests
    "mars.mars": {"mars_trajectory"},
    "mars.mars_m": {"mars_m_trajectory"},
    # K9 as printed (never run: not an inverse) and the O(d^3) norm the tests compare with
    "mkor.factors": {"printed_algorithm1_update", "spectral_norm"},
    # the oracle's step written out; the port's are methods of MKOR and its backbone
    "mkor.preconditioner": {"backbone_update", "is_factor_update_step"},
    # K-FAC's equations; the port runs them inside KFAC's methods (batched, in place), the
    # per-expert factors batched over the expert axis (kfac_equations' input_stat, grad_stat)
    "baselines.kfac": {"damped_inverse", "eigen_decompose", "eigen_precondition",
                       "eigen_precondition_from", "ema", "expert_kfac_factors",
                       "inverse_precondition", "kfac_factors", "kl_clip"},
    # the quintic's coefficients as a function; the port inlines them in its loop.  Polar
    # Express's offline stage (Remez, the greedy schedule): the port holds its output table
    "common.matrix_functions": {"quintic", "optimal_quintic", "polar_express_coefficients"},
    # the rule's parts, written out (the port computes them inside stochastic_round)
    "common.rounding": {"neighbours", "largest_finite"},
    # LP4's per-value bound: what the tests hold the quantizer to, not a step of the optimizer
    "common.blockwise": {"error_bound"},
}
TORCH_ONLY = {
    # the options' validation, the capture's additive reduce statistics (summed over calls and
    # ranks before dividing) and the stateless function over a model
    "baselines.kfac_flavours": {"check_flavour", "check_loss", "reduce_input_stat",
                                "reduce_grad_stat", "kfac_factors"},
    # per-route compositions (the oracle writes them inline in its class), the resolver, bias
    # corrections for lists, and the global-norm helper
    "mars.mars_equations": {"adamw_rule", "lion_rule", "resolve_hyperparameters",
                            "with_bias_corrections", "global_norm"},
    "mars.mars_m_equations": {"resolve_hyperparameters"},
    # the rows' sums the vectors are means of, kept apart so distributed capture can add them
    # over ranks before dividing
    "mkor.vectors": {"conv2d_grad_sum", "conv2d_input_sum", "grad_row_sum", "input_row_sum",
                     "linear_grad_sum", "linear_input_sum", "row_sum", "expert_row_sum"},
    # rank k's group sums and their means, kept apart for the same reason (KC7, additive)
    "mkor.rank_k": {"group_row_sums", "vectors_from_group_sums", "group_vectors"},
    # the random streams (LP2): the oracle takes its uniforms as given
    "common.rounding": {"stochastic_round_with_uniform", "stream_seed", "name_word",
                        "default_rounding_seed", "agreed_rounding_seed"},
}

# Port functions whose oracle has the same name in a module of reference/ that is not their
# twin, and which: the rows of fused experts are the MoE problem's (reference/common/moe.py),
# which the engine reads from transformers' experts modules
# (torch_impl/kronecker/experts/transformers.py)
ORACLE_ELSEWHERE = {("kronecker.experts.transformers", "expert_rows"): "common.moe"}


def _modules(package):
    return {m.name for m in pkgutil.iter_modules([str(ROOT / package)])
            if not m.name.startswith("_")}


def _functions(module):
    return {name.rstrip("_") for name, obj in vars(module).items()
            if inspect.isfunction(obj) and obj.__module__ == module.__name__
            and not name.startswith("_")}


TWINS = [f"{family}.{name}" for family in FAMILIES
         for name in sorted(_modules(f"reference/{family}") & _modules(f"torch_impl/{family}"))]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_oracle_module_has_a_torch_twin_of_the_same_name(family):
    oracle_only = {f"{family}.{m}" for m in _modules(f"reference/{family}")
                   - _modules(f"torch_impl/{family}")}
    assert oracle_only == {m for m in ORACLE_ONLY_MODULES if m.startswith(family + ".")}


@pytest.mark.parametrize("twin", TWINS)
def test_twin_modules_define_the_same_equations(twin):
    oracle = importlib.import_module(f"reference.{twin}")
    port = importlib.import_module(f"torch_impl.{twin}")
    ours = _functions(oracle) - ORACLE_ONLY.get(twin, set())
    theirs = (_functions(port) - TORCH_ONLY.get(twin, set())
              - {name for (where, name) in ORACLE_ELSEWHERE if where == twin})
    assert ours == theirs, (sorted(ours - theirs), sorted(theirs - ours))


@pytest.mark.parametrize("port, name", sorted(ORACLE_ELSEWHERE))
def test_a_port_function_with_its_oracle_elsewhere_has_it_there(port, name):
    """The port's function and its oracle of the same name in the module listed."""
    oracle = ORACLE_ELSEWHERE[port, name]
    assert name in _functions(importlib.import_module(f"torch_impl.{port}"))
    assert name in _functions(importlib.import_module(f"reference.{oracle}"))


def test_the_exceptions_are_not_stale():
    """An exception that names a module or function no longer there hides nothing: remove it."""
    for twin, names in ORACLE_ONLY.items():
        assert names <= _functions(importlib.import_module(f"reference.{twin}")), twin
    for twin, names in TORCH_ONLY.items():
        assert names <= _functions(importlib.import_module(f"torch_impl.{twin}")), twin
    assert set(ORACLE_ONLY) | set(TORCH_ONLY) <= set(TWINS)
    # a port module listed there is no twin (a twin compares its functions by name)
    assert not {port for port, _ in ORACLE_ELSEWHERE} & set(TWINS)
    assert len(TWINS) >= 10
    compared = sum(len(_functions(importlib.import_module(f"reference.{twin}"))
                       - ORACLE_ONLY.get(twin, set())) for twin in TWINS) + len(ORACLE_ELSEWHERE)
    assert compared >= 35, compared  # the rule compares the equations, not just module names
