"""Mutants of stacks of matrices (``matrix_batch_dims``, issue 31 item 2), keyed by the
``paper_notes/claims.md`` row whose tests must kill them (``mutant.Mutant``'s format).

Each breaks the rule "a stack is its matrices" (or "nothing is guessed") and nothing else: on
2-D parameters every one of them computes what it computed before, so the existing MARS and
MARS-M tests let them all through; ``theory_tests/mars/test_matrix_batch_dims.py`` and
``theory_tests/distributed/test_matrix_stacks.py`` kill them.
"""
from .mutant import Mutant

__all__ = ["MATRIX_BATCH_MUTANTS"]

R_MF, R_EQ = "reference/common/matrix_functions.py", "reference/mars/mars_equations.py"
R_MM = "reference/mars/mars_m.py"
T_MF, T_EQ = "torch_impl/common/matrix_functions.py", "torch_impl/mars/mars_equations.py"
T_FN, T_MM = "torch_impl/mars/functional.py", "torch_impl/mars/mars_m.py"
T_C, T_MC = "torch_impl/mars/mars_compiled.py", "torch_impl/mars/mars_m_compiled.py"
T_SH, T_VAL = "torch_impl/common/sharding.py", "torch_impl/common/validation.py"
T_MARS = "torch_impl/mars/mars.py"
COMPILED = ("theory_tests/mars/test_matrix_batch_dims.py::test_compiled_steps_a_stack_as_its_matrices",)
TRACED = ("theory_tests/mars/test_matrix_batch_dims.py::test_a_traced_step_steps_a_stack_as_its_matrices",)

MATRIX_BATCH_MUTANTS = {
    "MOE-MARS-BATCH": [
        # a stack clipped as one tensor: the per-matrix norms replaced by the whole stack's
        # (the port's loop path of MARS and MARS-M, and every stack of the foreach paths)
        Mutant(T_EQ, "    return torch.linalg.vector_norm(c, dim=(-2, -1), keepdim=True)",
               "    return torch.linalg.vector_norm(c)"),
        # the foreach path alone clips a stack by its whole norm
        Mutant(T_EQ, "    norms = [_matrix_norms(x) if stack else SINGLE.norm(x) for x, stack in zip(c, stacks)]",
               "    norms = [SINGLE.norm(x) for x in c]"),
        # the oracle's MARS clips a stack as one tensor
        Mutant(R_EQ, "    return over_matrices(clip_tensor, batch_dims, c)", "    return clip_tensor(c)"),
        # the oracle's MARS-M steps a stack as one tensor (one clip norm, one NS of the stack)
        Mutant(R_MM, "                self._matrix_step, cfg.matrix_batch_dims, p, g, self.buf[i], self.last_grad[i])",
               "                self._matrix_step, 0, p, g, self.buf[i], self.last_grad[i])"),
        # a stack scaled by the stack's shape: MARS-M's 0.2 sqrt(max(E, A)) (eager paths) ...
        Mutant(T_FN, "        scale = match_rms_scale(p.shape[-2:]) if r[8] is None else r[8]",
               "        scale = match_rms_scale(p.shape) if r[8] is None else r[8]"),
        # ... the compiled MARS-M kernel's ...
        Mutant(T_MC, "        s = mars_m_equations.match_rms_scale(p.shape[-2:]) if scale is None else scale",
               "        s = mars_m_equations.match_rms_scale(p.shape) if scale is None else scale",
               tests=COMPILED),
        # ... and MARS-Shampoo's s = sqrt(max(1, E / A))
        Mutant(T_EQ, "        scale = shape_scale(p.shape[-2:])", "        scale = shape_scale(p.shape)"),
        # Newton-Schulz normalised over the whole stack: MARS-M's order (cast first) ...
        Mutant(T_MF, "        X = X / (torch.linalg.matrix_norm(X, keepdim=True) + eps)",
               "        X = X / (torch.linalg.vector_norm(X) + eps)"),
        # ... and MARS-Shampoo's (normalise, then cast)
        Mutant(T_MF, "        X = (M / (torch.linalg.matrix_norm(M, keepdim=True) + eps)).to(dtype)",
               "        X = (M / (torch.linalg.vector_norm(M) + eps)).to(dtype)"),
        # the compiled MARS-AdamW / Lion kernels take a stack whole (one clip norm)
        Mutant(T_C, "        for row in each_matrix(matrix_batch_dims, p, g, m, v, vmax, last):",
               "        for row in each_matrix(0, p, g, m, v, vmax, last):",
               tests=COMPILED),
        # torch.compile(opt.step) on the CPU: the traced clip divides each matrix by the
        # stack's norm
        Mutant(T_EQ, "        clip_tensor_(c[i], ops.norm(c[i]), ops)",
               "        clip_tensor_(c[i], ops.norm(c), ops)", tests=TRACED),
    ],
    "MOE-MARS-ROUTING": [
        # auto guesses a 3-D tensor is a stack of matrices (of its last two dims): the port ...
        Mutant(T_EQ, "    if len(shape) == matrix_batch_dims + 2:\n        return matrix_batch_dims",
               "    if len(shape) >= 2:\n        return len(shape) - 2"),
        # ... and the oracle
        Mutant(R_EQ, "    if len(shape) == matrix_batch_dims + 2:\n        return matrix_batch_dims",
               "    if len(shape) >= 2:\n        return len(shape) - 2"),
        # MARS-M's auto rule takes every tensor of ndim >= 2 for a matrix (or stack)
        Mutant(T_MM, '        rule = "mars_m" if p.ndim - stacked == 2 else "adamw"',
               '        rule = "mars_m" if p.ndim >= 2 else "adamw"'),
        # a shape that fits no reading of the option is routed anyway, not refused
        Mutant(T_EQ, "    if matrix_batch_dims == 0 or len(shape) < 2:\n        return 0",
               "    if True:\n        return 0"),
        # a bad value let through to the routing (which then fails in its own words)
        Mutant(T_VAL, '    matrix_batch_dims = group["matrix_batch_dims"]\n'
                      '    check_int("matrix_batch_dims", matrix_batch_dims, low=0)',
               '    matrix_batch_dims = group["matrix_batch_dims"]'),
        # the functional MARS-M checks matrix routes for 2-D whatever the option says
        Mutant(T_FN, "                matrices=(MATRIX, EFFICIENT), optional=(\"shape_scales\",),\n"
                     "                matrix_batch_dims=matrix_batch_dims)",
               "                matrices=(MATRIX, EFFICIENT), optional=(\"shape_scales\",),\n"
               "                matrix_batch_dims=0)"),
        # a group changed to a value its shapes do not fit is found only once earlier groups
        # have stepped
        Mutant(T_MM, "                    _kind(p, group)  # raises for a shape",
               "                    pass  # raises for a shape"),
        # MARS passes the group's option nowhere: stacks take the non-2-D fallback
        Mutant(T_MARS, '                matrix_batch_dims=group["matrix_batch_dims"])',
               '                matrix_batch_dims=0)'),
    ],
    "MOE-MARS-FSDP2": [
        # a stack sharded on a matrix dim taken for whole matrices: orthogonalised in pieces
        Mutant(T_SH, "        isinstance(pl, Replicate) or (type(pl) is Shard and pl.dim % M.ndim < M.ndim - 2)",
               "        isinstance(pl, Replicate) or (type(pl) is Shard and pl.dim % M.ndim < M.ndim)"),
        # whole matrices per rank all-gathered anyway (right numbers, needless communication)
        Mutant(T_SH, "    if holds_whole_matrices(M):\n        return on_local_matrices(fn, M, *args, **kwargs)",
               "    if False:\n        return on_local_matrices(fn, M, *args, **kwargs)"),
    ],
}
