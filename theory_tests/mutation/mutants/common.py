"""Mutants of what the families share (``torch_impl/common/``, ``reference/common/``: matrix
functions, sharding, ops tables, validation, the first-order rules), keyed by the
``paper_notes/claims.md`` row whose tests must kill them (``theory_tests/mutation/mutant.py``
says what a mutant is)."""
from ..mutant import Mutant

__all__ = ["MUTANTS"]

R_FIRST_ORDER = "reference/common/first_order.py"
R_MATRIX_FUNCTIONS = "reference/common/matrix_functions.py"
R_MOE = "reference/common/moe.py"
R_PROBLEMS = "reference/common/problems.py"
T_LAMB = "torch_impl/baselines/lamb.py"
T_MATRIX_FUNCTIONS = "torch_impl/common/matrix_functions.py"
T_SCALARS = "torch_impl/common/scalars.py"
T_SHARDING = "torch_impl/common/sharding.py"
T_TENSOR_OPS = "torch_impl/common/tensor_ops.py"
T_VALIDATION = "torch_impl/common/validation.py"

_CO = "theory_tests/mars/test_compiled_options.py::"
COMPILED_MARS = (_CO + "test_compiled_mars_option_equals_the_single_tensor_loop",)
OWNER = ("theory_tests/distributed/test_owner_orthogonalisation.py::"
         "test_an_owner_orthogonalises_its_same_shape_matrices_in_one_call",)
_FOREACH_DECAY = ("        torch._foreach_div_(x, torch._foreach_clamp_min(divisors, 1.0))\n"
                  "        return x\n\n    @classmethod\n    def decay_(cls, p, lr, wd):\n"
                  "        if wd != 0.0:\n            cls.mul_(p, 1.0 - lr * wd)")

MUTANTS = {
    "K15": [
        # LAMB's bias corrections, the same bug in the oracle and the port (a differential
        # test cannot see it; the closed forms and the Adam-built LAMB can, with weight decay).
        Mutant(R_FIRST_ORDER, "    r = (m / (1 - b1**k)) / (np.sqrt(v / (1 - b2**k)) + eps)",
               "    r = (m / (1 - b1**(k + 1))) / (np.sqrt(v / (1 - b2**k)) + eps)",
               also=((T_LAMB, "r = (m / (1 - beta1 ** k)) / ((v / (1 - beta2 ** k)).sqrt()",
                      "r = (m / (1 - beta1 ** (k + 1))) / ((v / (1 - beta2 ** k)).sqrt()"),)),
        Mutant(R_FIRST_ORDER, "    r = (m / (1 - b1**k)) / (np.sqrt(v / (1 - b2**k)) + eps)",
               "    r = m / (np.sqrt(v / (1 - b2**k)) + eps)",
               also=((T_LAMB, "r = (m / (1 - beta1 ** k)) / ((v / (1 - beta2 ** k)).sqrt()",
                      "r = m / ((v / (1 - beta2 ** k)).sqrt()"),)),
        Mutant(R_FIRST_ORDER, "    r = (m / (1 - b1**k)) / (np.sqrt(v / (1 - b2**k)) + eps)",
               "    r = (m / (1 - b1**k)) / (np.sqrt(v) + eps)",
               also=((T_LAMB, "r = (m / (1 - beta1 ** k)) / ((v / (1 - beta2 ** k)).sqrt()",
                      "r = (m / (1 - beta1 ** k)) / (v.sqrt()"),)),
        Mutant(R_FIRST_ORDER, "    r = (m / (1 - b1**k)) / (np.sqrt(v / (1 - b2**k)) + eps)",
               "    r = (m / (1 - b1**k)) / np.sqrt(v / (1 - b2**k) + eps)",
               also=((T_LAMB, "((v / (1 - beta2 ** k)).sqrt() + group[\"eps\"])",
                      "((v / (1 - beta2 ** k) + group[\"eps\"]).sqrt())"),)),
    ],
    "PORT-FSDP2": [
        # owner placement: every layer to rank 0; the wrong rows sent back; every rank keeping
        # every factor
        Mutant(T_SHARDING, "        rank = min(range(world_size), key=lambda r: (load[r], r))",
               "        rank = min(range(world_size), key=lambda r: (r, load[r]))"),
    ],
    "MOE-MKOR": [
        # the oracle: the routing weight left out of the gradient rows (the problem's rows);
        # an absent expert updated (MKOR's per-expert update)
        Mutant(R_MOE, "        g_z = weights[tokens, slots][:, None] * grad_out[tokens]",
               "        g_z = grad_out[tokens]"),
    ],
    "PORT-TENSOR-HYPER": [
        # a tensor read on the host while compiling: a graph break / a constant per value
        Mutant(T_SCALARS, "    return x.item() if torch.is_tensor(x) and not torch.compiler.is_compiling() else x",
               "    return x.item() if torch.is_tensor(x) else x"),
        Mutant(T_VALIDATION, "    if tensor and torch.is_tensor(value):\n        value = host_value(name, value)",
               "    if False:\n        value = host_value(name, value)"),
        # a traced step's check reads a tensor hyperparameter on the host: a graph break
        Mutant(T_VALIDATION, "    if torch.compiler.is_compiling():\n        _check_scalar_tensor(name, value)",
               "    if False:\n        _check_scalar_tensor(name, value)"),
        Mutant(T_VALIDATION, "    if value.numel() != 1 or not value.is_floating_point() or value.is_cuda \\",
               "    if value.numel() != 1 or value.is_cuda \\"),
    ],
    "MT20": [
        # the bug that was: torch's CPU _foreach_mul_ rounds the number to bf16 / fp16
        # (1 - lr wd, beta2, MARS-M's beta), the loop multiplies by the float32 number
        Mutant(T_TENSOR_OPS, "        torch._foreach_mul_(x, scalar_operand(s))",
               "        torch._foreach_mul_(x, s)"),
        # the loop's side of it: the loop rounds its number to the tensor's dtype
        Mutant(T_TENSOR_OPS, "        return x.mul_(s)",
               "        return x.mul_(torch.tensor(s, dtype=x.dtype))"),
        # the foreach AdamW step sizes -lr / bc1 as a tensor in the parameters' dtype
        # (torch's capturable form): rounded to bf16 / fp16, the loop's are not
        Mutant(T_TENSOR_OPS, "        torch._foreach_addcdiv_(x, a, b, s) if isinstance(s, list) \\",
               "        torch._foreach_addcdiv_(x, a, b, torch.tensor(s, dtype=x[0].dtype)) "
               "if isinstance(s, list) \\"),
        # the foreach clip's norms kept in float64, the loop's rounded to the tensor's dtype
        Mutant(T_TENSOR_OPS, "        return list(torch._foreach_norm(x))",
               "        return list(torch._foreach_norm(x, dtype=torch.float64))"),
        Mutant(T_TENSOR_OPS, "        for a, b in zip(x, y):  # DTensor", "        for a, b in zip(x, y[::-1]):  # DTensor"),
    ],
    "M2": [
        Mutant(T_TENSOR_OPS, "        torch._foreach_lerp_(x, y, w)", "        torch._foreach_lerp_(y, x, w)"),
        Mutant(T_TENSOR_OPS, "        return x.add_((y - x) * w)", "        return x.add_((x - y) * w)",
               tests=COMPILED_MARS),
    ],
    "M3": [
        Mutant(T_TENSOR_OPS, "        return x.div_(divisor.clamp(min=1.0))", "        return x.div_(divisor)"),
        Mutant(T_TENSOR_OPS, "        torch._foreach_div_(x, torch._foreach_clamp_min(divisors, 1.0))",
               "        torch._foreach_div_(x, torch._foreach_clamp_max(divisors, 1.0))"),
        Mutant(T_TENSOR_OPS, "        return x.div_(torch.clamp(divisor, min=1.0))",
               "        return x.div_(torch.clamp(divisor, max=1.0))", tests=COMPILED_MARS),
    ],
    "M6": [
        Mutant(T_TENSOR_OPS, "        torch._foreach_addcmul_(x, a, b, value=s) if not isinstance(s, list)",
               "        torch._foreach_addcmul_(x, a, b, value=1.0) if not isinstance(s, list)"),
        Mutant(T_TENSOR_OPS, "        return x.add_(a * b * s)", "        return x.add_(a * b)", tests=COMPILED_MARS),
    ],
    "M7": [
        Mutant(T_TENSOR_OPS, "        torch._foreach_addcdiv_(x, a, b, s) if isinstance(s, list)",
               "        torch._foreach_addcmul_(x, a, b, s) if isinstance(s, list)"),
        Mutant(T_TENSOR_OPS, "        return x.add_(a / b * s)", "        return x.add_(b / a * s)", tests=COMPILED_MARS),
    ],
    "M8": [
        Mutant(T_TENSOR_OPS, _FOREACH_DECAY, _FOREACH_DECAY.replace("1.0 - lr * wd", "1.0 - wd")),
        Mutant(T_TENSOR_OPS, "        p.mul_(1.0 - lr * wd)", "        p.mul_(1.0 - wd)", tests=COMPILED_MARS),
    ],
    "M9": [
        Mutant(T_TENSOR_OPS, "        torch._foreach_maximum_(x, y)", "        torch._foreach_minimum_(x, y)"),
        # the reported survivor: the compiled AMSGrad uses v instead of its running max
        Mutant(T_TENSOR_OPS, "        return x.copy_(torch.maximum(x, y))", "        return x.copy_(y)",
               tests=COMPILED_MARS),
    ],
    "M10": [
        Mutant(T_TENSOR_OPS, "            torch._foreach_add_(x, y, alpha=s)", "            torch._foreach_add_(x, y, alpha=-s)"),
        Mutant(T_TENSOR_OPS, "        return x.add_(y * s)", "        return x.sub_(y * s)", tests=COMPILED_MARS),
    ],
    "M11": [
        # the singular values kept: U diag(s) V^T = m itself
        Mutant(R_MATRIX_FUNCTIONS, "    return (U * keep) @ Vt", "    return (U * s) @ Vt"),
        Mutant(T_MATRIX_FUNCTIONS, "    return (U * (s > tol).unsqueeze(-2).to(U.dtype)) @ Vh",
               "    return (U * s.unsqueeze(-2)) @ Vh"),
    ],
    "M13": [
        Mutant(R_MATRIX_FUNCTIONS, "        X = a * X + (b * Q + c * (Q @ Q)) @ X", "        X = a * X + (b * Q + c * Q) @ X"),
        Mutant(T_MATRIX_FUNCTIONS, "        X = mm(X, mm(Q, Q, Q, beta=b, alpha=c), X, beta=a)",
               "        X = mm(X, mm(Q, Q, Q, beta=c, alpha=b), X, beta=a)"),
    ],
    "M16": [
        Mutant(T_MATRIX_FUNCTIONS, "        X = X / (torch.linalg.matrix_norm(X, keepdim=True) + eps)",
               "        X = X / torch.linalg.matrix_norm(X, keepdim=True)"),
    ],
    "M19": [
        Mutant(R_FIRST_ORDER, "    u = np.sign(b1 * m + (1 - b1) * g)", "    u = np.sign(b2 * m + (1 - b2) * g)"),
    ],
    "M20": [
        Mutant(R_FIRST_ORDER, "        g = g + momentum * buf if nesterov else buf", "        g = momentum * buf if nesterov else buf"),
        Mutant(R_FIRST_ORDER, "    d = (1 - momentum) * g + momentum * buf if nesterov else buf",
               "    d = g + momentum * buf if nesterov else buf"),
    ],
    "PORT-TORCH-FLAGS": [
        Mutant("torch_impl/common/validation.py", "    for flag, allowed in ((\"fused\", (None, False)), (\"capturable\", (False,)),",
               "    for flag, allowed in ((\"fused\", (None, False, True)), (\"capturable\", (False,)),"),
    ],
    "PORT-COMPILE-STEP": [
        # the step's group check traced with the capturable=True that dynamo's trace of an
        # optimizer shows every group: the trace raises, and the step runs eagerly
        Mutant(T_VALIDATION, '        if flag == "capturable" and torch.compiler.is_compiling():',
               '        if False:'),
    ],
    "PORT-FSDP2-ORTHOGONALISE": [
        # the owner map differs between ranks
        Mutant(T_SHARDING, "    owners = assign_owners([ns_flops(*lay.shape) for lay in layouts], world)",
               "    owners = [(o + rank) % world for o in assign_owners([ns_flops(*lay.shape) for lay in layouts], world)]"),
        # each rank sent another rank's rows back
        Mutant(T_SHARDING, "        [[layouts[j].piece(out, dst) for j, out in zip(mine, outs)] for dst in range(world)],",
               "        [[layouts[j].piece(out, (dst + 1) % world) for j, out in zip(mine, outs)] for dst in range(world)],"),
        # the uneven split off by one
        Mutant(T_SHARDING, "    chunk = -(-n // world_size)", "    chunk = n // world_size"),
        # the shards joined in the wrong order
        Mutant(T_SHARDING, "    fulls = [torch.cat([received[src][k] for src in range(world)], dim=layouts[j].dim)",
               "    fulls = [torch.cat([received[src][k] for src in reversed(range(world))], dim=layouts[j].dim)"),
    ],
    "PORT-HYPERPARAMETERS": [
        Mutant("torch_impl/common/validation.py", '        raise ValueError(f"{name}: expected a value {interval}, got {value!r}")',
               '        raise ValueError(f"{name} must be {interval}, got {value!r}")'),
    ],
    "MT1": [
        Mutant(R_FIRST_ORDER, "    bc1, bc2 = 1 - b1**k, 1 - b2**k\n    p = p * (1 - lr * weight_decay)",
               "    bc1, bc2 = 1 - b1**k, 1 - b2**(k + 1)\n    p = p * (1 - lr * weight_decay)"),
    ],
    "MT9": [
        Mutant(T_TENSOR_OPS, "        return torch.sign(x)", "        return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)"),
        Mutant(T_TENSOR_OPS, "        return torch._foreach_sign(x)",
               "        return [torch.where(v >= 0, 1.0, -1.0).to(v.dtype) for v in x]"),
    ],
    "MT10": [
        Mutant(R_FIRST_ORDER, "    state[\"m\"] = b2 * m + (1 - b2) * g", "    state[\"m\"] = b2 * m + (1 - b1) * g"),
    ],
    "MT11": [
        Mutant(R_FIRST_ORDER, "        buf = g.copy() if k == 1 else momentum * state[\"buf\"] + (1 - dampening) * g",
               "        buf = g.copy() if k == 1 else momentum * state[\"buf\"] + (1 - momentum) * g"),
    ],
    "MT13(a)": [
        Mutant(R_MATRIX_FUNCTIONS, "    X = M / (np.linalg.norm(M) + eps)\n    tall = M.shape[0] > M.shape[1]\n    if tall:\n        X = X.T\n    for a, b, c in ns_schedule", "    X = M / (1.0 + eps)\n    tall = M.shape[0] > M.shape[1]\n    if tall:\n        X = X.T\n    for a, b, c in ns_schedule"),
        Mutant(T_MATRIX_FUNCTIONS, "        X = (M / (torch.linalg.matrix_norm(M, keepdim=True) + eps)).to(dtype)",
               "        X = (M / (M.abs().amax() + eps)).to(dtype)"),
    ],
    "MT13(b)": [
        Mutant(R_MATRIX_FUNCTIONS, "    for a, b, c in ns_schedule(coefficients, steps):\n        Q = X @ X.T", "    for a, b, c in ns_schedule(coefficients, steps)[:-1]:\n        Q = X @ X.T"),
        Mutant(T_MATRIX_FUNCTIONS, "    for a, b, c in schedule:  # b Q X", "    for a, b, c in schedule + schedule[-1:]:  # b Q X"),
    ],
    "MT13(c)": [
        Mutant(R_MATRIX_FUNCTIONS, "NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)", "NS_COEFFICIENTS = (3.4445, -4.7750, 2.3015)"),
        Mutant(R_MATRIX_FUNCTIONS, "    return a * s + b * s**3 + c * s**5", "    return a * s + b * s**3 + c * s**4"),
        Mutant(T_MATRIX_FUNCTIONS, "NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)", "NS_COEFFICIENTS = (3.4445, -4.7705, 2.0315)"),
    ],
    "MT13(d)": [
        Mutant(R_MATRIX_FUNCTIONS, "    return a * s + b * s**3 + c * s**5", "    return a * s + b * s**2 + c * s**5"),
    ],
    "MT13(e)": [
        Mutant(R_MATRIX_FUNCTIONS, "        X = a * X + (b * Q + c * (Q @ Q)) @ X\n    return X.T if tall else X", "        X = a * X + (b * Q + c * (Q @ Q)) @ X\n    return X"),
        Mutant(T_MATRIX_FUNCTIONS, "    if tall:\n        X = X.mT\n    return X if cast_first", "    return X if cast_first"),
    ],
    "MT13(f)": [
        # the iteration left in M's dtype: no bf16 rounding at all
        Mutant(T_MATRIX_FUNCTIONS, "        X = (M / (torch.linalg.matrix_norm(M, keepdim=True) + eps)).to(dtype)",
               "        X = M / (torch.linalg.matrix_norm(M, keepdim=True) + eps)"),
    ],
    "MT18": [
        Mutant(T_TENSOR_OPS, "        return torch.maximum(x, y, out=x)", "        return x.copy_(y)"),
    ],
    "VR1": [
        Mutant(R_PROBLEMS, "            W = (Z + np.swapaxes(Z, -1, -2)) / np.sqrt(2.0)",
               "            W = (Z + np.swapaxes(Z, -1, -2)) / 2.0"),
        Mutant(R_PROBLEMS, "        return self.tau**2 * (d + 1) * np.sum(u * u, axis=-1) + self.sigma**2 * d",
               "        return self.tau**2 * d * np.sum(u * u, axis=-1) + self.sigma**2 * d"),
        Mutant(R_PROBLEMS, "        return self.x_star - np.linalg.solve(self.A, self.b_mean)",
               "        return self.x_star + np.linalg.solve(self.A, self.b_mean)"),
    ],
    "MOE-MARS-BATCH": [
        # Newton-Schulz normalised over the whole stack: MARS-M's order (cast first) ...
        Mutant(T_MATRIX_FUNCTIONS, "        X = X / (torch.linalg.matrix_norm(X, keepdim=True) + eps)",
               "        X = X / (torch.linalg.vector_norm(X) + eps)"),
        # ... and MARS-Shampoo's (normalise, then cast)
        Mutant(T_MATRIX_FUNCTIONS, "        X = (M / (torch.linalg.matrix_norm(M, keepdim=True) + eps)).to(dtype)",
               "        X = (M / (torch.linalg.vector_norm(M) + eps)).to(dtype)"),
    ],
    "MOE-MARS-ROUTING": [
        # a bad value let through to the routing (which then fails in its own words)
        Mutant(T_VALIDATION, '    matrix_batch_dims = group["matrix_batch_dims"]\n'
                      '    check_int("matrix_batch_dims", matrix_batch_dims, low=0)',
               '    matrix_batch_dims = group["matrix_batch_dims"]'),
    ],
    "MOE-MARS-FSDP2": [
        # a stack sharded on a matrix dim taken for whole matrices: orthogonalised in pieces
        Mutant(T_SHARDING, "                                      and pl.dim % M.ndim < M.ndim - 2)",
               "                                      and pl.dim % M.ndim < M.ndim)"),
        # whole matrices per rank all-gathered anyway (right numbers, needless communication)
        Mutant(T_SHARDING, "    if holds_whole_matrices(M):\n        return on_local_matrices(fn, M, *args, **kwargs)",
               "    if False:\n        return on_local_matrices(fn, M, *args, **kwargs)"),
    ],
    "ORTH-SCHEDULE": [
        # the oracle ignores the schedule: the authors' triple at every step
        Mutant(R_MATRIX_FUNCTIONS, "    for a, b, c in ns_schedule(coefficients, steps):",
               "    for a, b, c in (NS_COEFFICIENTS,) * steps:"),
        # the port runs the first triple at every step
        Mutant(T_MATRIX_FUNCTIONS, "    for a, b, c in schedule:  # b Q X",
               "    for a, b, c in schedule[:1] * len(schedule):  # b Q X"),
        # a sequence cycles instead of repeating its last triple (oracle, port)
        Mutant(R_MATRIX_FUNCTIONS, "    return tuple(triples[min(k, len(triples) - 1)] for k in range(steps))",
               "    return tuple(triples[k % len(triples)] for k in range(steps))"),
        Mutant(T_MATRIX_FUNCTIONS, "    return tuple(triples[min(k, len(triples) - 1)] for k in range(steps))",
               "    return tuple(triples[k % len(triples)] for k in range(steps))"),
        # the port's first Polar Express step without the folded 1.01 normalisation
        Mutant(T_MATRIX_FUNCTIONS, "    t = PE_SAFETY * (PE_SAFETY if k == 0 else 1.0)", "    t = PE_SAFETY"),
    ],
    "ORTH-POLAR-EXPRESS": [
        # Remez's alternation signs wrong: not the minimax quintic
        Mutant(R_MATRIX_FUNCTIONS, "        system = np.column_stack([nodes, nodes**3, nodes**5, [1.0, -1.0, 1.0, -1.0]])",
               "        system = np.column_stack([nodes, nodes**3, nodes**5, [1.0, 1.0, -1.0, -1.0]])"),
        # no recentring: the greedy image is not centred on 1
        Mutant(R_MATRIX_FUNCTIONS, "        t = 2 / (quintic(lo, (a, b, c)) + quintic(hi, (a, b, c)))",
               "        t = 1.0"),
        # no cushion: the early polynomials made on [l, u]
        Mutant(R_MATRIX_FUNCTIONS, "        a, b, c = optimal_quintic(max(lo, cushion * hi), hi)",
               "        a, b, c = optimal_quintic(lo, hi)"),
        # the port's table: one digit of the paper's first triple off
        Mutant(T_MATRIX_FUNCTIONS, "    (8.28721201814563, -23.595886519098837, 17.300387312530933),",
               "    (8.28721201814563, -23.595886519098837, 17.300387812530933),"),
    ],
    "ORTH-GRAM": [
        # the shift not relative to ||Y||_F (oracle)
        Mutant(R_MATRIX_FUNCTIONS, "    return Y + shift * lift * np.eye(len(Y))",
               "    return Y + shift * np.eye(len(Y))"),
        # a restart's Gram matrix lifted by the first block's worst case (oracle)
        Mutant(R_MATRIX_FUNCTIONS, "    lift = np.linalg.norm(Y) / (np.sqrt(len(Y)) if restart else 1.0)",
               "    lift = np.linalg.norm(Y)"),
        # a restart's Gram matrix not lifted (the port: Y_0 alone shifted)
        Mutant(T_MATRIX_FUNCTIONS, "    lift = torch.linalg.matrix_norm(Y) / (math.sqrt(Y.size(-1)) if restart else 1.0)",
               "    lift = torch.linalg.matrix_norm(Y) * (0.0 if restart else 1.0)"),
        # a restart that keeps the stale Gram matrix (oracle)
        Mutant(R_MATRIX_FUNCTIONS, "            Y, R = shifted_gram(X, shift, restart=True), eye", "            R = eye"),
        # the port drops its shift
        Mutant(T_MATRIX_FUNCTIONS, "    Y.diagonal(dim1=-2, dim2=-1).add_(shift * lift.unsqueeze(-1))",
               "    Y.diagonal(dim1=-2, dim2=-1).add_(0.0 * lift.unsqueeze(-1))"),
        # the port never restarts
        Mutant(T_MATRIX_FUNCTIONS, '    block of two steps, then blocks of three (2, 5, 8, ...)."""\n    return tuple(range(2, steps, 3))',
               '    block of two steps, then blocks of three (2, 5, 8, ...)."""\n    return ()'),
        # the port forgets the normalisation at the end of the last block
        Mutant(T_MATRIX_FUNCTIONS, "    X = (R * scale) @ X\n    if M.size(-2) > M.size(-1):",
               "    X = R @ X\n    if M.size(-2) > M.size(-1):"),
        # the Gram form taken where it costs as much (aspect 1.5)
        Mutant(R_MATRIX_FUNCTIONS, "    return min(rows, cols) > 0 and gram < standard",
               "    return min(rows, cols) > 0 and gram <= standard"),
        # a block's count off by one step's Y <- H Y H
        Mutant(T_MATRIX_FUNCTIONS, "    return steps * (2 * alpha + 1), sum(2 * alpha + 4 * r - 3 for r in blocks)",
               "    return steps * (2 * alpha + 1), sum(2 * alpha + 4 * r - 1 for r in blocks)"),
    ],
    "ORTH-BATCH": [
        # results split back in the wrong order
        Mutant(T_SHARDING, "            for i, r in zip(batch, results):",
               "            for i, r in zip(batch[::-1], results):"),
        # no bound on a batch's size
        Mutant(T_SHARDING, "            if batches[-1] and size + matrices[i].numel() > max_numel:",
               "            if False:"),
        # the owner rank back to one call per matrix
        Mutant(T_SHARDING, "    for j, out in zip(mine, orthogonalize_by_shape(fn, fulls)):",
               "    for j, out in zip(mine, [fn(f) for f in fulls]):", tests=OWNER),
    ],
}
