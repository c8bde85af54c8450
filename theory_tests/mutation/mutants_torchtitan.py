"""Mutants of the torchtitan container (``torch_impl/integrations/torchtitan.py``) and of
MKOR's / K-FAC's state laid out on the parameters (``torch_impl/kronecker/state_layout.py``, the
checkpoint methods in ``torch_impl/kronecker/optimizer.py``, ``init_state`` of both); keyed by the
``paper_notes/claims.md`` rows TITAN-CONTAINER and PRECOND-STATE-LAYOUT."""
from .mutant import Mutant

__all__ = ["TORCHTITAN_MUTANTS"]

T_TT = "torch_impl/integrations/torchtitan.py"
T_LAYOUT, T_WRAP = "torch_impl/kronecker/state_layout.py", "torch_impl/kronecker/optimizer.py"
T_K = "torch_impl/baselines/kfac.py"

TORCHTITAN_MUTANTS = {
    "TITAN-CONTAINER": [
        # torchtitan's "foreach" / "for-loop" read backwards
        Mutant(T_TT, '        impl_kwargs = {"fused": impl in _FUSED, "foreach": impl == "foreach"}',
               '        impl_kwargs = {"fused": impl in _FUSED, "foreach": impl == "for-loop"}'),
        # "fused" (torchtitan's default) reaches an optimizer without a fused kernel
        Mutant(T_TT, '                if group.get("fused"):', '                if False:'),
        # the state never created at construction: torchtitan's init step counts a step
        Mutant(T_TT, "        for optimizer in self.optimizers:  # before any init_optim_state",
               "        for optimizer in []:  # before any init_optim_state"),
        # a preconditioner without a backbone named falls through to an unrelated error
        Mutant(T_TT, "            if backbone is None or backbone in PRECONDITIONERS:",
               "            if backbone in PRECONDITIONERS:"),
        # two preconditioners hooking one model part
        Mutant(T_TT, "            if len(preconditioners) > 1:", "            if False:"),
        # the preconditioner's own options (inv_freq, ...) dropped
        Mutant(T_TT, "            pre = PRECONDITIONERS[name](model, inner, **kwargs)",
               "            pre = PRECONDITIONERS[name](model, inner, grad_scale=kwargs['grad_scale'])"),
    ],
    "PRECOND-STATE-LAYOUT": [
        # the preconditioner's entries never added to the state dict
        Mutant(T_WRAP, "            packed[i] = dict(packed.get(i, {}), **entry)",
               "            packed[i] = dict(packed.get(i, {}))"),
        # the run's counters (step count, switch) not laid on the first parameter
        Mutant(T_LAYOUT, "    if first is not None:\n        entries.setdefault(first, {})",
               "    if False:\n        entries.setdefault(first, {})"),
        # a layer's saved state not taken back
        Mutant(T_LAYOUT, "            layers[name] = found", "            pass"),
        # the checkpoint's parameters matched to the live ones in the wrong order
        Mutant(T_LAYOUT, "    return {id(p): k for p, k in zip(live, saved)}",
               "    return {id(p): k for p, k in zip(live, reversed(saved))}"),
        # MKOR's init_state leaves the backbone's state to DCP's counted init step
        Mutant(T_WRAP, "        init_backbone_state(self.optimizer)\n", "        pass\n"),
        # K-FAC's init_state without the decompositions: a template made before step 0
        # does not ask a checkpoint for them
        Mutant(T_K, "        self._decompose_all(missing_only=True)\n", "        pass\n"),
    ],
}
