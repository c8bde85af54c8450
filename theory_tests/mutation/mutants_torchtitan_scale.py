"""Mutants of ``statistics_scale`` (``torch_impl/integrations/torchtitan.py``), the scale of
MKOR's and K-FAC's statistics under torchtitan's FSDP (gradient_divide_factor / world, read
from the model's FSDP groups), and of the container passing it on; keyed by the
``paper_notes/claims.md`` row TITAN-SCALE (``mutant.Mutant``'s format). Its tests:
``theory_tests/distributed/test_torchtitan_statistics.py``."""
from .mutant import Mutant

__all__ = ["TORCHTITAN_SCALE_MUTANTS"]

T_TT = "torch_impl/integrations/torchtitan.py"

TORCHTITAN_SCALE_MUTANTS = {
    "TITAN-SCALE": [
        # no scale at all: the statistics of torchtitan's 1/world gradients used as they are;
        # killed by the cheap test, and by the slow runs alone (the scale shows in training)
        Mutant(T_TT, "    return factors.pop() / worlds.pop()", "    return 1.0"),
        Mutant(T_TT, "    return factors.pop() / worlds.pop()", "    return 1.0", tests=(
            "theory_tests/distributed/test_torchtitan_statistics.py"
            "::test_runs_on_two_and_three_ranks_equal_one_process",)),
        # the ratio inverted: world / factor
        Mutant(T_TT, "    return factors.pop() / worlds.pop()",
               "    return worlds.pop() / factors.pop()"),
        # the world size taken for the group's divide factor (torchtitan's 1 ignored)
        Mutant(T_TT, "                factors.add(float(world if factor is None else factor))",
               "                factors.add(float(world))"),
        # a group without a divide factor (plain fully_shard: FSDP divides by the world)
        # read as factor 1
        Mutant(T_TT, "                factors.add(float(world if factor is None else factor))",
               "                factors.add(float(1 if factor is None else factor))"),
        # groups that disagree accepted (one of them picked)
        Mutant(T_TT, "    if len(factors) > 1 or len(worlds) > 1:", "    if False:"),
        Mutant(T_TT, "    if len(factors) > 1 or len(worlds) > 1:", "    if len(factors) > 1:"),
        # only the outermost module's groups read (the root's: mixed groups go unseen)
        Mutant(T_TT, "    for module in model.modules():\n        if isinstance(module, FSDPModule):",
               "    for module in list(model.modules())[:1]:\n        if isinstance(module, FSDPModule):"),
        # the container never derives it: the preconditioner keeps grad_scale 1.0
        Mutant(T_TT, '                kwargs["grad_scale"] = statistics_scale(model)',
               '                kwargs["grad_scale"] = 1.0'),
    ],
}
