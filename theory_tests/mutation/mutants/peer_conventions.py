"""Mutants of the peers' convention maps (``theory_tests/support/peer_conventions.py``), keyed by
the ``paper_notes/claims.md`` row whose tests must kill them
(``theory_tests/mutation/mutant.py`` says what a mutant is)."""
from ..mutant import Mutant

__all__ = ["MUTANTS"]

S_PEER_CONVENTIONS = "theory_tests/support/peer_conventions.py"
S_HEAVYBALL = "theory_tests/support/heavyball_conventions.py"
T_MARS_EQUATIONS = "torch_impl/mars/mars_equations.py"
T_FUNCTIONAL = "torch_impl/mars/functional.py"
R_ROUNDING = "reference/common/rounding.py"
S_ROUNDING_LAW = "theory_tests/support/rounding_law.py"
S_OPTIMI = "theory_tests/support/optimi_conventions.py"
T_ROUNDING = "torch_impl/common/rounding.py"
T_STORAGE = "torch_impl/common/state_storage.py"


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
    "PEER-HEAVYBALL": [
        # the map: the paper's coefficient (our gamma = mars_gamma), the peer's formula
        # unswapped, the clip kept, the shape routing kept, the float32 lr, the warmup, the
        # eps dropped (0/0 where a gradient is always 0), the per-group step count
        Mutant(S_HEAVYBALL, "    return heavyball_coefficient(gamma, beta1) * (1.0 - beta1) / beta1",
               "    return gamma"),
        Mutant(S_HEAVYBALL, "    return gamma * beta1 / (1.0 - gamma)",
               "    return gamma * beta1 / (1.0 - beta1)"),
        Mutant(S_HEAVYBALL, 'mars_type="mars-adamw", optimize_1d=True, clip_scope="none",',
               'mars_type="mars-adamw", optimize_1d=True, clip_scope="tensor",'),
        Mutant(S_HEAVYBALL, 'mars_type="mars-adamw", optimize_1d=True, clip_scope="none",',
               'mars_type="mars-adamw", optimize_1d=False, clip_scope="none",'),
        Mutant(S_HEAVYBALL, "    t = torch.tensor(step, dtype=torch.int64)",
               "    t = torch.tensor(step, dtype=torch.float64)"),
        Mutant(S_HEAVYBALL, "    return (lr * t / t.clamp(min=warmup_steps + 1)).item()",
               "    return (lr * t / t.clamp(min=1)).item()"),
        Mutant(S_HEAVYBALL, '                           eps=h["eps"], weight_decay=h["weight_decay"], gamma=gamma,',
               '                           eps=0.0, weight_decay=h["weight_decay"], gamma=gamma,'),
        Mutant(S_HEAVYBALL, "(p.grad is not None and stepped != t - 1)",
               "(p.grad is not None and stepped != t)"),
        # ours: clip_scope="none" clipping all the same (loop path); HeavyBall's coefficient
        Mutant(T_FUNCTIONAL, '        if scope == "tensor":  # each matrix of a stack on its own\n'
               "            mars_equations.clip_matrices_(c, matrix_batch_dims, SINGLE)",
               '        if scope != "global":  # each matrix of a stack on its own\n'
               "            mars_equations.clip_matrices_(c, matrix_batch_dims, SINGLE)"),
        Mutant(T_MARS_EQUATIONS, "    return gamma * beta1 / (1.0 - beta1)",
               "    return gamma * beta1 / (1.0 - gamma)"),
    ],
    "PEER-TORCHAO": [
        # the oracle's upper neighbour one spacing too far; the verdict's band on any column
        # instead of every one; HeavyBall's bf16 storage mapped to our nearest
        Mutant(R_ROUNDING, "    hi = np.where(lo == x, x, lo + ulp)",
               "    hi = np.where(lo == x, x, lo + 2 * ulp)"),
        Mutant(S_ROUNDING_LAW, "    band = (dev <= Z * sigma + 1).all()",
               "    band = (dev <= Z * sigma + 1).any()"),
        Mutant(S_HEAVYBALL, '        return dict(state_dtype=torch.bfloat16, state_rounding="stochastic")',
               '        return dict(state_dtype=torch.bfloat16, state_rounding="nearest")'),
        # ours: the float32 -> bf16 path with 15 random bits (P(up) = max(0, bits - 2^15) /
        # 2^15); the 16-bit parameter written to nearest (as torchao writes its state)
        Mutant(T_STORAGE, "        if comp is not None or stored.dtype not in ROUNDING_DTYPES:",
               "        if comp is not None or stored.dtype not in ROUNDING_DTYPES or name == PARAM:"),
        Mutant(T_ROUNDING,
               "        r = torch.randint(0, 1 << 16, x.shape, generator=g, device=x.device, dtype=torch.int32)",
               "        r = torch.randint(0, 1 << 15, x.shape, generator=g, device=x.device, dtype=torch.int32)"),
    ],
    "PEER-OPTIMI": [
        # spacings of the wrong binade; the map without the compensation; ours with the
        # Kahan term dropped (c' = 0: each step loses what RN(x) lost)
        Mutant(S_OPTIMI, "    spacing = torch.exp2(torch.floor(torch.log2(reference.abs())) - 7)",
               "    spacing = torch.exp2(torch.floor(torch.log2(reference.abs())) - 6)"),
        Mutant(S_OPTIMI, '        kahan = sixteen if h["kahan_sum"] is None else bool(h["kahan_sum"]) and sixteen',
               '        kahan = False'),
        Mutant(T_STORAGE, "        comp.copy_(working.sub(stored))", "        comp.zero_()"),
    ],
}
