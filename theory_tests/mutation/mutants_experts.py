"""Mutants of MKOR's fused experts (issue 31), keyed by the ``paper_notes/claims.md`` row whose
tests must kill them (``mutant.Mutant``'s format). Each breaks "every expert is its own layer"
in one line: statistics shared across the experts, the routing weight left out of the
down projection's gradient rows, a stack's matrices judged or rescaled as one, a mask that
does not follow each pair's token, the per-expert counts lost on the wire."""
from .mutant import Mutant

__all__ = ["EXPERTS_MUTANTS"]

T_F, T_L = "torch_impl/mkor/factors.py", "torch_impl/mkor/layer_state.py"
T_V, T_E = "torch_impl/mkor/vectors.py", "torch_impl/kronecker/experts/transformers.py"
T_P = "torch_impl/mkor/preconditioner.py"
T_DIST, T_SC = "torch_impl/kronecker/exchange.py", "torch_impl/kronecker/capture/self_check.py"
T_K, T_KE = "torch_impl/baselines/kfac.py", "torch_impl/baselines/kfac_equations.py"
T_RP = "torch_impl/kronecker/capture/row_provenance.py"
T_EC = "torch_impl/kronecker/capture/experts.py"
R_E, R_MOE = "reference/mkor/experts.py", "reference/common/moe.py"
R_K = "reference/baselines/kfac.py"

EXPERTS_MUTANTS = {
    "MOE-MKOR": [
        # the oracle: the routing weight left out of the gradient rows (the problem's rows);
        # an absent expert updated (MKOR's per-expert update)
        Mutant(R_MOE, "        g_z = weights[tokens, slots][:, None] * grad_out[tokens]",
               "        g_z = grad_out[tokens]"),
        Mutant(R_E, "        if not present[e]:\n", "        if False:\n"),
        # shared factors: every expert's rows summed into one statistic, given to all
        Mutant(T_V, "    total = rows.new_zeros(num_experts, rows.shape[-1]).index_add_(0, experts, kept)",
               "    total = kept.sum(0).expand(num_experts, -1).clone()"),
        # the routing weight left out of the gradient rows (down and, through it, up)
        Mutant(T_E, "        g_y = (w.to(grad_out.dtype) * grad_out.detach()[token]).to(y_dtype)",
               "        g_y = grad_out.detach()[token].to(y_dtype)"),
        # the down projection fed the gate's input instead of its output
        Mutant(T_E, "    return token, expert, [(x, g_h), (a2.detach(), g_y.detach())]",
               "    return token, expert, [(x, g_h), (h.detach()[:, :a2.shape[1]], g_y.detach())]"),
        # the rows recomputed outside the forward's autocast (float32 rows of a bf16 forward)
        Mutant(T_EC, "with torch.autocast(autocast[0], dtype=autocast[1], enabled=autocast[2]):",
               "with torch.autocast(autocast[0], dtype=autocast[1], enabled=False):"),
        # the up projection's gradient rows taken after its float32 bias, not of its product
        Mutant(T_E, "    g_h = g_h.detach().to(product_dtype(x, up.weight))\n",
               "    g_h = g_h.detach()\n"),
        # an expert routed nothing updated anyway (with zero vectors)
        Mutant(T_P, "                    out.append((layer, _row_mean(a_sum, rows), g, rows > 0))",
                "                    out.append((layer, _row_mean(a_sum, rows), g, rows >= 0))"),
        # the stabiliser's test taken over the whole stack: one expert over the threshold
        # resets them all
        Mutant(T_F, "    low, high = torch.aminmax(J) if J.dim() == 2 else (J.amin(dim=(-2, -1)), J.amax(dim=(-2, -1)))",
               "    low, high = torch.aminmax(J)"),
        # the rescale of a stack with the stack's norms, not each expert's
        Mutant(T_F, "    s = grad_norm / torch.where(usable_e, delta_norm, torch.ones_like(delta_norm))",
               "    s = grad_norm.norm() / torch.where(usable_e, delta_norm, "
               "torch.ones_like(delta_norm)).norm()"),
        # a non-finite vector refused for the whole stack, not for its expert
        Mutant(T_L, "        finite_v = torch.isfinite(v).all(dim=-1)  # per expert for a stack",
               "        finite_v = torch.isfinite(v).all()"),
        # a pair's mask read in slot-major order instead of its token's
        Mutant(T_EC, "            mask = None if found.mask is None else found.mask[token]",
               "            mask = None if found.mask is None else found.mask.repeat(token.numel() // found.mask.numel())"),
        # the per-expert counts lost on the wire: every expert divided by the stack's total
        Mutant("torch_impl/mkor/vector_exchange.py", "                rows = sums[2]\n",
               "                rows = sums[2].sum()\n"),
        # the row tracker's mask cache keyed without the rows' shape: flattened rows (a MoE
        # block's input, Qwen2-MoE's shared expert) get the (B, T) mask of earlier rows
        Mutant(T_RP, "    key = (src, tuple(flat), tuple(lead))", "    key = (src, tuple(flat))"),
        # the self-check's weight test summed over the stack (blind to a gradient moved
        # between experts)
        Mutant(T_SC, "                 torch.randn(layer.experts, generator=g, dtype=torch.float64).to(device, dtype))",
               "                 torch.ones(layer.experts, dtype=torch.float64).to(device, dtype))"),
    ],
    "MOE-KFAC": [
        # the oracle: G_e without its n_e (the mean-reduced loss's factor)
        Mutant(R_K, "    return [None if a.shape[0] == 0 else kfac_factors(a, g, has_bias=has_bias)",
               "    return [None if a.shape[0] == 0 else kfac_factors(a, g / a.shape[0] ** 0.5, "
               "has_bias=has_bias)"),
        # shared factors: every expert's rows summed into expert 0's statistic
        Mutant(T_KE, "        out.index_add_(0, owner[j:j + num_experts], block.mT @ block)",
               "        out.index_add_(0, torch.zeros_like(owner[j:j + num_experts]), block.mT @ block)"),
        # an expert routed nothing updated anyway (its factor EMA decays towards 0)
        Mutant(T_K, "                present = rows > 0 if isinstance(rows, torch.Tensor) else None",
               "                present = rows >= 0 if isinstance(rows, torch.Tensor) else None"),
        # every expert's factor divided by the stack's row count
        Mutant(T_K, "                    rows, samples = _per_matrix(rows), _per_matrix(samples)",
               "                    rows, samples = rows.sum(), samples.sum()"),
        # the per-expert counts lost on the wire
        Mutant(T_K, "                    rows = sums[-1]\n", "                    rows = sums[-1].sum()\n"),
    ],
    "MOE-DISCOVERY": [
        # a declared bias taken on trust
        Mutant(T_E, "        if module.has_bias and (b is None or tuple(b.shape) != (E, d_out)):",
               "        if False:"),
        # the router left with the generic reason
        Mutant("torch_impl/kronecker/discovery.py", "        if name in routers:\n",
               "        if False:\n"),
    ],
}
