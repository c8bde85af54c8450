"""Mutants of K-FAC on fused experts (issue 31), keyed by the ``paper_notes/claims.md`` row
whose tests must kill them (``mutant.Mutant``'s format); killed by
``theory_tests/baselines/test_kfac_experts.py``. Each breaks "every expert is its own layer"
in one line: factors shared across the experts, an expert without rows (or with padding
only) updated anyway, a stack decomposed or judged as one matrix, or with another expert's
eigenvalues, a failing expert's fallback taken for the whole stack, the KL clip's sum
averaged over the experts."""
from .mutant import Mutant

__all__ = ["KFAC_EXPERTS_MUTANTS"]

T_K, T_KE = "torch_impl/baselines/kfac.py", "torch_impl/baselines/kfac_equations.py"

KFAC_EXPERTS_MUTANTS = {
    "MOE-KFAC": [
        # factors shared across experts: every expert's A is the stack's total
        Mutant(T_KE, "        return _expert_outer_sums(flat, experts, layer.experts), n\n",
               "        return _expert_outer_sums(flat, experts, layer.experts).sum(0).expand("
               "layer.experts, -1, -1).clone(), n\n"),
        # ... and every expert's G
        Mutant(T_KE, "        return _expert_outer_sums(flat, experts, layer.experts), samples",
               "        return _expert_outer_sums(flat, experts, layer.experts).sum(0).expand("
               "layer.experts, -1, -1).clone(), samples"),
        # a segment of the batched product runs across a change of expert: rows of one
        # expert counted in another's factor
        Mutant(T_KE, "    starts[1:] = (e[1:] != e[:-1]) | (i[1:] // c != i[:-1] // c)",
               "    starts[1:] = i[1:] // c != i[:-1] // c"),
        # an expert with no rows updated anyway: each expert counted with the stack's rows
        Mutant(T_KE, "    return torch.zeros(num_experts, dtype=torch.long, device=experts.device)"
               ".index_add_(\n        0, experts, ones)",
               "    return ones.sum().expand(num_experts).clone()"),
        # an expert's padded rows counted (its N and its factor's mean)
        Mutant(T_KE, "    ones = torch.ones_like(experts) if mask is None else mask.reshape(-1).long()",
               "    ones = torch.ones_like(experts)"),
        # an expert with no rows takes the (zero) batch factor into its EMA
        Mutant(T_K, "                finite, overflow, ok = finite | ~present, overflow & present, "
               "ok & present",
               "                finite, overflow, ok = finite | ~present, overflow & present, ok"),
        # one expert's non-finite statistic refuses the whole stack's update
        Mutant(T_K, "    return torch.isfinite(F).flatten(-2).all(dim=-1)",
               "    return torch.isfinite(F).all()"),
        # the stack retried as one: a failing expert moves the others through float64 and
        # extra damping too (retries counted for the stack)
        Mutant(T_KE, "    out, ok = _attempt(F, damping, method, 0, 0.0)\n    if ok:\n"
               "        return out, 0, []",
               "    out, tries = decompose(F, damping, method)\n    if out is not None:\n"
               "        return out, tries, []"),
        # a failing expert reset to the identity instead of keeping its previous result
        Mutant(T_K, "        result, attempts, failed = decompose_stack(s[key], self.damping, "
               "self.method,\n                                                   s.get(entry))",
               "        result, attempts, failed = decompose_stack(s[key], self.damping, "
               "self.method,\n                                                   None)"),
        # failures counted once per stack, not per expert
        Mutant(T_K, "            self.decomposition_failures += len(failed)",
               "            self.decomposition_failures += 1"),
        # the wrong batch axis: expert e's V divided by another expert's eigenvalues of A
        Mutant(T_KE, "               lam_G.unsqueeze(-1) * lam_A.unsqueeze(-2))",
               "               lam_G.unsqueeze(-1) * lam_A.flip(0).unsqueeze(-2))"),
        # the stack symmetrised across experts (e with E-1-e) before its eigh
        Mutant(T_KE, "    M = (F + F.mT) / 2 if attempt == 0 else (F + F.mT).double() / 2",
               "    M = (F + F.mT.flip(tuple(range(F.dim() - 2)))) / 2 if attempt == 0 else "
               "(F + F.mT).double() / 2"),
        # the KL clip's sum over layers averaged over a stack's experts
        Mutant(T_K, "            term = (V * G_hat).sum().to(dev)",
               "            term = (V * G_hat).sum((-2, -1)).mean().to(dev)"),
    ],
}
