"""Mutants of the integrations (``torch_impl/integrations/``: torchtitan's container, the Trainer
factories), keyed by the ``paper_notes/claims.md`` row whose tests must kill them
(``theory_tests/mutation/mutant.py`` says what a mutant is)."""
from ..mutant import Mutant

__all__ = ["MUTANTS"]

T_HF_TRAINER = "torch_impl/integrations/hf_trainer.py"
T_TORCHTITAN = "torch_impl/integrations/torchtitan.py"


MUTANTS = {
    "PORT-HF-TRAINER": [
        # the preconditioner's own options dropped: its defaults instead
        Mutant(T_HF_TRAINER, "        return self.preconditioner(model, optimizer, **kwargs)",
               "        return self.preconditioner(model, optimizer)"),
        # the decay group loses its weight decay
        Mutant(T_HF_TRAINER, "             \"weight_decay\": backbone_kwargs[\"weight_decay\"]},",
               "             \"weight_decay\": 0.0},"),
        # every parameter decays (biases and norms included)
        Mutant(T_HF_TRAINER, "    decay = set(Trainer.get_decay_parameter_names(None, model))",
               "    decay = {n for n, _ in model.named_parameters()}"),
        # a missing lr silently takes the backbone's default
        Mutant(T_HF_TRAINER, "        if \"lr\" not in backbone_kwargs:", "        if False:"),
        # an unknown keyword reaches the constructor (a TypeError, not a named ValueError)
        Mutant(T_HF_TRAINER, "            if key not in known:", "            if False:"),
        # the backbone's keywords ignored
        Mutant(T_HF_TRAINER, "        optimizer = backbone(groups, **backbone_kwargs)",
               "        optimizer = backbone(groups, lr=backbone_kwargs[\"lr\"])"),
    ],
    "TITAN-CONTAINER": [
        # torchtitan's "foreach" / "for-loop" read backwards
        Mutant(T_TORCHTITAN, '        impl_kwargs = {"fused": impl in _FUSED, "foreach": impl == "foreach"}',
               '        impl_kwargs = {"fused": impl in _FUSED, "foreach": impl == "for-loop"}'),
        # "fused" (torchtitan's default) reaches an optimizer without a fused kernel
        Mutant(T_TORCHTITAN, '                if group.get("fused"):', '                if False:'),
        # the state never created at construction: torchtitan's init step counts a step
        Mutant(T_TORCHTITAN, "        for optimizer in self.optimizers:  # before any init_optim_state",
               "        for optimizer in []:  # before any init_optim_state"),
        # a preconditioner without a backbone named falls through to an unrelated error
        Mutant(T_TORCHTITAN, "            if backbone is None or backbone in PRECONDITIONERS:",
               "            if backbone in PRECONDITIONERS:"),
        # two preconditioners hooking one model part
        Mutant(T_TORCHTITAN, "            if len(preconditioners) > 1:", "            if False:"),
        # the preconditioner's own options (inv_freq, ...) dropped
        Mutant(T_TORCHTITAN, "            pre = PRECONDITIONERS[name](model, inner, **kwargs)",
               "            pre = PRECONDITIONERS[name](model, inner, grad_scale=kwargs['grad_scale'])"),
    ],
    "TITAN-SCALE": [
        # no scale at all: the statistics of torchtitan's 1/world gradients used as they are;
        # killed by the cheap test, and by the slow runs alone (the scale shows in training)
        Mutant(T_TORCHTITAN, "    return factors.pop() / worlds.pop()", "    return 1.0"),
        Mutant(T_TORCHTITAN, "    return factors.pop() / worlds.pop()", "    return 1.0", tests=(
            "theory_tests/distributed/test_torchtitan_statistics.py"
            "::test_runs_on_two_and_three_ranks_equal_one_process",)),
        # the ratio inverted: world / factor
        Mutant(T_TORCHTITAN, "    return factors.pop() / worlds.pop()",
               "    return worlds.pop() / factors.pop()"),
        # the world size taken for the group's divide factor (torchtitan's 1 ignored)
        Mutant(T_TORCHTITAN, "                factors.add(float(world if factor is None else factor))",
               "                factors.add(float(world))"),
        # a group without a divide factor (plain fully_shard: FSDP divides by the world)
        # read as factor 1
        Mutant(T_TORCHTITAN, "                factors.add(float(world if factor is None else factor))",
               "                factors.add(float(1 if factor is None else factor))"),
        # groups that disagree accepted (one of them picked)
        Mutant(T_TORCHTITAN, "    if len(factors) > 1 or len(worlds) > 1:", "    if False:"),
        Mutant(T_TORCHTITAN, "    if len(factors) > 1 or len(worlds) > 1:", "    if len(factors) > 1:"),
        # only the outermost module's groups read (the root's: mixed groups go unseen)
        Mutant(T_TORCHTITAN, "    for module in model.modules():\n        if isinstance(module, FSDPModule):",
               "    for module in list(model.modules())[:1]:\n        if isinstance(module, FSDPModule):"),
        # the container never derives it: the preconditioner keeps grad_scale 1.0
        Mutant(T_TORCHTITAN, '                kwargs["grad_scale"] = statistics_scale(model)',
               '                kwargs["grad_scale"] = 1.0'),
    ],
}
