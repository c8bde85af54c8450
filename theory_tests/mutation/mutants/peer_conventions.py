"""Mutants of the peers' convention maps (``theory_tests/support/peer_conventions.py``), keyed by
the ``paper_notes/claims.md`` row whose tests must kill them
(``theory_tests/mutation/mutant.py`` says what a mutant is)."""
from ..mutant import Mutant

__all__ = ["MUTANTS"]

S_PEER_CONVENTIONS = "theory_tests/support/peer_conventions.py"


MUTANTS = {
    "PEER-TIMM": [
        # the map: step 1's gamma = 0 never restored / never set
        Mutant(S_PEER_CONVENTIONS, '            opt.param_groups[i]["gamma"] = gamma',
               '            opt.param_groups[i]["gamma"] = 0.0'),
        Mutant(S_PEER_CONVENTIONS, '                group["gamma"] = 0.0', '                group["gamma"] = group["gamma"]'),
        # the map: the fallback takes weight_decay_1d (timm has none)
        Mutant(S_PEER_CONVENTIONS, 'weight_decay_1d_source="group", clip_scope="tensor")',
               'weight_decay_1d_source="constructor", clip_scope="tensor")'),
        # the map: timm's ndim > 2 tensors left to our fallback
        Mutant(S_PEER_CONVENTIONS, "            groups.append(dict(common, params=[p for _, p in mars], optimize_1d=True))",
               "            groups.append(dict(common, params=[p for _, p in mars], optimize_1d=False))"),
    ],
    "PEER-PYTORCH-OPTIMIZER": [
        # the map: eps without the bias correction, one step late, the fallback's beta2 wrong
        Mutant(S_PEER_CONVENTIONS, '            group["eps"] = e["eps"] / math.sqrt(1.0 - e["beta2"] ** t)',
               '            group["eps"] = e["eps"]'),
        Mutant(S_PEER_CONVENTIONS, '            group["eps"] = e["eps"] / math.sqrt(1.0 - e["beta2"] ** t)',
               '            group["eps"] = e["eps"] / math.sqrt(1.0 - e["beta2"] ** (t + 1))'),
        Mutant(S_PEER_CONVENTIONS, '                                beta2=float(h["betas_1d"][1])))',
               '                                beta2=float(h["betas"][1])))'),
    ],
}
