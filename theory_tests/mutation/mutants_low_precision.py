"""Mutants of the foreach = loop equality in bf16 / fp16 (issue 30, item 4), keyed by the
``paper_notes/claims.md`` row whose tests must kill them (``mutant.Mutant``'s format).

Each is a one-line change that breaks the equality *only in low precision*: a number rounded
to the tensors' dtype, or an intermediate kept wider, in one path and not the other.  In
float64 (and float32 scalars) the two paths still agree bit for bit, so the float64 parity
tests (``test_mt20_foreach_matches_single_tensor``, ``test_lamb_foreach_equals_the_loop``)
let every one through; ``theory_tests/mars/test_low_precision_paths.py`` kills them.
"""
from .mutant import Mutant

__all__ = ["LOW_PRECISION_MUTANTS"]

T_OPS, T_MF = "torch_impl/common/tensor_ops.py", "torch_impl/mars/mars_m_equations.py"
T_LAMB = "torch_impl/baselines/lamb.py"

LOW_PRECISION_MUTANTS = {
    "MT20": [
        # the bug that was: torch's CPU _foreach_mul_ rounds the number to bf16 / fp16
        # (1 - lr wd, beta2, MARS-M's beta), the loop multiplies by the float32 number
        Mutant(T_OPS, "        torch._foreach_mul_(x, scalar_operand(s))",
               "        torch._foreach_mul_(x, s)"),
        # the loop's side of it: the loop rounds its number to the tensor's dtype
        Mutant(T_OPS, "        return x.mul_(s)",
               "        return x.mul_(torch.tensor(s, dtype=x.dtype))"),
        # the foreach AdamW step sizes -lr / bc1 as a tensor in the parameters' dtype
        # (torch's capturable form): rounded to bf16 / fp16, the loop's are not
        Mutant(T_OPS, "        torch._foreach_addcdiv_(x, a, b, s) if isinstance(s, list) \\",
               "        torch._foreach_addcdiv_(x, a, b, torch.tensor(s, dtype=x[0].dtype)) "
               "if isinstance(s, list) \\"),
        # the foreach clip's norms kept in float64, the loop's rounded to the tensor's dtype
        Mutant(T_OPS, "        return list(torch._foreach_norm(x))",
               "        return list(torch._foreach_norm(x, dtype=torch.float64))"),
        # MARS-M's AdamW backup: foreach step sizes lr sqrt(bc2) / bc1 rounded to the dtype
        Mutant(T_MF, "        step = [-h.lr * s / b for b, s in zip(h.bc1, h.sqrt_bc2)]",
               "        step = [float(mars_equations.torch.tensor(-h.lr * s / b, dtype=p[0].dtype)) "
               "for b, s in zip(h.bc1, h.sqrt_bc2)]"),
    ],
    "PORT-LAMB-SURFACE": [
        # LAMB's foreach m <- beta1 m with beta1 rounded to bf16 / fp16 (0.9 -> 0.8984375)
        Mutant(T_LAMB, "        torch._foreach_mul_(ms_, scalar_operand(beta1))  # as m.mul_(beta1) rounds",
               "        torch._foreach_mul_(ms_, beta1)"),
        # v <- beta2 v likewise (0.999: 1.0 in bf16, where the loop's product rounds back to
        # v too; 0.99902344 in fp16, where it does not)
        Mutant(T_LAMB, "        torch._foreach_mul_(vs_, scalar_operand(beta2))",
               "        torch._foreach_mul_(vs_, beta2)"),
        # the loop's side: m <- beta1 m with beta1 rounded to the tensor's dtype
        Mutant(T_LAMB, "        m.mul_(beta1).add_(g, alpha=1 - beta1)",
               "        m.mul_(torch.tensor(beta1, dtype=m.dtype)).add_(g, alpha=1 - beta1)"),
        # the foreach trust ratio lr phi kept in float64, the loop's rounded to the dtype
        Mutant(T_LAMB, "        torch._foreach_mul_(rs, (lr * trust).unbind(0))",
               "        torch._foreach_mul_(rs, (lr * trust.double()).unbind(0))"),
        # the foreach bias correction 1 - beta1^k rounded to the dtype
        Mutant(T_LAMB, "        m_hat = torch._foreach_div(ms_, [1 - beta1 ** steps[i] for i in idx])",
               "        m_hat = torch._foreach_div(ms_, [torch.tensor(1 - beta1 ** steps[i], "
               "dtype=ms_[0].dtype) for i in idx])"),
    ],
}
