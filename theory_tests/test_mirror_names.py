"""``torch_impl`` mirrors ``reference`` function for function (its package docstring's promise):
every equation function of the oracle has a torch twin of the same name (a trailing ``_`` marks
the in-place form), and the other way round, up to the listed, documented exceptions."""
import inspect

import pytest

import reference.mars as RM
import reference.mars_m as RMM
import torch_impl.mars_functional as TM
import torch_impl.mars_m_functional as TMM

# Fused for memory on the torch side: adamw_step_ / lion_step_ compute direction and decay in
# place (one temporary), so the oracle's separate direction and decay have no torch twin.
ORACLE_ONLY = {"adamw_direction", "decoupled_step", "lion_direction", "mars_trajectory",
               "mars_m_trajectory"}
# Torch-only plumbing: the per-route rules (compositions the oracle writes inline in its
# class), the resolver, bias corrections for lists, and the global-norm helper.
TORCH_ONLY = {"adamw_rule_", "lion_rule_", "resolve_hyperparameters", "with_bias_corrections",
              "global_norm", "mars_m"}


def _functions(module):
    return {name.rstrip("_") for name, obj in vars(module).items()
            if inspect.isfunction(obj) and obj.__module__ == module.__name__
            and not name.startswith("_")}


@pytest.mark.parametrize("oracle,port", [(RM, TM), (RMM, TMM)], ids=["mars", "mars_m"])
def test_every_equation_has_a_twin_of_the_same_name(oracle, port):
    ours = _functions(oracle) - {n.rstrip("_") for n in ORACLE_ONLY}
    theirs = _functions(port) - {n.rstrip("_") for n in TORCH_ONLY}
    assert ours == theirs, (sorted(ours - theirs), sorted(theirs - ours))
