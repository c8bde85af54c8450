"""Mutants of the Hugging Face Trainer factory (``torch_impl/integrations/hf_trainer.py``)
and of following accelerate's FSDP2 parameter swap (``torch_impl/kronecker/placement.py``
``ParameterBinding``); keyed by ``paper_notes/claims.md`` rows."""
from .mutant import Mutant

__all__ = ["HF_MUTANTS"]

T_HF, T_FSDP = "torch_impl/integrations/hf_trainer.py", "torch_impl/kronecker/placement.py"
T_P, T_K = "torch_impl/mkor/preconditioner.py", "torch_impl/baselines/kfac.py"
T_C = "torch_impl/kronecker/capture/capture.py"

HF_MUTANTS = {
    "PORT-HF-TRAINER": [
        # the preconditioner's own options dropped: its defaults instead
        Mutant(T_HF, "        return self.preconditioner(model, optimizer, **kwargs)",
               "        return self.preconditioner(model, optimizer)"),
        # the decay group loses its weight decay
        Mutant(T_HF, "             \"weight_decay\": backbone_kwargs[\"weight_decay\"]},",
               "             \"weight_decay\": 0.0},"),
        # every parameter decays (biases and norms included)
        Mutant(T_HF, "    decay = set(Trainer.get_decay_parameter_names(None, model))",
               "    decay = {n for n, _ in model.named_parameters()}"),
        # a missing lr silently takes the backbone's default
        Mutant(T_HF, "        if \"lr\" not in backbone_kwargs:", "        if False:"),
        # an unknown keyword reaches the constructor (a TypeError, not a named ValueError)
        Mutant(T_HF, "            if key not in known:", "            if False:"),
        # the backbone's keywords ignored
        Mutant(T_HF, "        optimizer = backbone(groups, **backbone_kwargs)",
               "        optimizer = backbone(groups, lr=backbone_kwargs[\"lr\"])"),
    ],
    "PORT-ACCELERATE-FSDP2": [
        # the swap check inverted: the replaced parameters are never followed (MKOR)
        Mutant(T_P, "        if self._binding.moved():",
               "        if not self._binding.moved():"),
        Mutant(T_K, "        if self._binding.moved():",
               "        if not self._binding.moved():"),
        # identity test inverted inside moved()
        Mutant(T_FSDP, "any(r() is not p for r, p in zip(refs, now))",
               "any(r() is p and False for r, p in zip(refs, now))"),
        # an optimizer still holding the old tensors trains in silence
        Mutant(T_FSDP, "        if stale:\n            raise RuntimeError(",
               "        if False:\n            raise RuntimeError("),
        # owner placement not redone: every rank keeps every layer
        Mutant(T_FSDP, "                pre._state[name] = {}  # another rank keeps",
               "                pass  # another rank keeps"),
        # the capture's weight hooks left on the replaced parameters
        Mutant(T_FSDP, "        pre._capture.rehook_weights()\n", "\n"),
        # K-FAC's reduction routes not re-planned for the new owners
        Mutant(T_K, "            self._routes = self._plan_routes()\n        if self.factor_update_due():",
               "            pass\n        if self.factor_update_due():"),
        # re-hooking re-registers nothing
        Mutant(T_C, "        self._weight_handles = self._hook_weights()\n        self._handles.extend(self._weight_handles)\n\n    def remove",
               "        self._weight_handles = []\n\n    def remove"),
    ],
}
