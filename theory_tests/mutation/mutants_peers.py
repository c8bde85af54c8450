"""Mutants the peer differential tests must kill (``theory_tests/peers``): one-line bugs in our
MARS code paths that a peer's steps expose, and bugs in the convention maps
(``theory_tests/support/peer_conventions.py``), keyed by the ``paper_notes/claims.md`` row
(``mutant.Mutant``'s format)."""
from .mutant import Mutant

__all__ = ["PEER_MUTANTS"]

T_EQ, T_MEQ = "torch_impl/mars/mars_equations.py", "torch_impl/mars/mars_m_equations.py"
MAP = "theory_tests/support/peer_conventions.py"

PEER_MUTANTS = {
    "PEER-TIMM": [
        # the fallback's two weight-decay sources swapped (timm's is the group's weight_decay)
        Mutant(T_EQ, '        if weight_decay_1d_source == "constructor":',
               '        if weight_decay_1d_source == "group":'),
        # optimize_1d does not reach a tensor of ndim > 2 (timm's Conv1d kernel takes MARS)
        Mutant(T_EQ, "    return len(shape) == 2 or optimize_1d",
               "    return len(shape) == 2 or (optimize_1d and len(shape) < 3)"),
        # eps added before the bias correction (timm and ours: after it)
        Mutant(T_EQ, "    ops.div_(denom, h.sqrt_bc2)\n    ops.add_(denom, h.eps)",
               "    ops.add_(denom, h.eps)\n    ops.div_(denom, h.sqrt_bc2)"),
        # the map: step 1's gamma = 0 never restored / never set
        Mutant(MAP, '            opt.param_groups[i]["gamma"] = gamma',
               '            opt.param_groups[i]["gamma"] = 0.0'),
        Mutant(MAP, '                group["gamma"] = 0.0', '                group["gamma"] = group["gamma"]'),
        # the map: the fallback takes weight_decay_1d (timm has none)
        Mutant(MAP, 'weight_decay_1d_source="group", clip_scope="tensor")',
               'weight_decay_1d_source="constructor", clip_scope="tensor")'),
        # the map: timm's ndim > 2 tensors left to our fallback
        Mutant(MAP, "            groups.append(dict(common, params=[p for _, p in mars], optimize_1d=True))",
               "            groups.append(dict(common, params=[p for _, p in mars], optimize_1d=False))"),
    ],
    "PEER-PYTORCH-OPTIMIZER": [
        # the fallback's lr without lr_1d_factor
        Mutant(T_EQ, "        return Hyper(lr=_number(lr) * lr_1d_factor, weight_decay=weight_decay, gamma=0.0,",
               "        return Hyper(lr=_number(lr), weight_decay=weight_decay, gamma=0.0,"),
        # the fallback with the MARS betas instead of betas_1d
        Mutant(T_EQ, "        beta1, beta2 = (_number(b) for b in betas_1d)",
               "        beta1, beta2 = (_number(b) for b in betas)"),
        Mutant(T_EQ, '        if weight_decay_1d_source == "constructor":',
               '        if weight_decay_1d_source == "group":'),
        # the map: eps without the bias correction, one step late, the fallback's beta2 wrong
        Mutant(MAP, '            group["eps"] = e["eps"] / math.sqrt(1.0 - e["beta2"] ** t)',
               '            group["eps"] = e["eps"]'),
        Mutant(MAP, '            group["eps"] = e["eps"] / math.sqrt(1.0 - e["beta2"] ** t)',
               '            group["eps"] = e["eps"] / math.sqrt(1.0 - e["beta2"] ** (t + 1))'),
        Mutant(MAP, '                                beta2=float(h["betas_1d"][1])))',
               '                                beta2=float(h["betas"][1])))'),
    ],
    "PEER-TORCH-MUON": [
        # clip_c ignored: MARS-M always clips (invisible with gradients below norm 1)
        Mutant(T_MEQ, "    c = mars_equations.corrected_gradient_(last, g, h.gamma, h.beta1, ops)\n    if clip:",
               "    c = mars_equations.corrected_gradient_(last, g, h.gamma, h.beta1, ops)\n    if True:"),
    ],
}
