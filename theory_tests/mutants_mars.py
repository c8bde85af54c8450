"""Curated mutants of the MARS family (MARS-AdamW, -Lion, -Shampoo, MARS-M): one-line bugs
in the math, keyed by the ``paper_notes/claims.md`` row whose tests must kill them. The
format is ``mutants.Mutant``'s; ``mutants.py`` merges this list into ``MUTANTS``.

Every row of the family that names code has a mutant of it in the oracle (``reference/``) and
in the port (``torch_impl/``) where each exists, and in the port's fast paths where they have
code of their own: the foreach path (``tensor_ops.FOREACH``, ``functional._multi_tensor_mars``,
``mars_m_functional``'s foreach branches) and the compiled paths (``tensor_ops.COMPILED``,
``mars_compiled``, ``mars_m_compiled``).  A mutant whose row's test column does not run its
path names its own ``tests``; the compiled ones are killed by the default run's
``test_mars_compiled_options.py``.
"""
from mutant import Mutant

R_MARS, R_NS = "reference/mars.py", "reference/matrix_functions.py"
R_MM, R_FO = "reference/mars_m.py", "reference/first_order.py"
R_VR, R_PB = "reference/variance_reduction.py", "reference/problems.py"
T_F, T_FN, T_OPS = "torch_impl/mars_functional.py", "torch_impl/functional.py", "torch_impl/tensor_ops.py"
T_MARS, T_EX, T_NS = "torch_impl/mars.py", "torch_impl/exact_mode.py", "torch_impl/matrix_functions.py"
T_MF, T_MM = "torch_impl/mars_m_functional.py", "torch_impl/mars_m.py"
T_C, T_MC = "torch_impl/mars_compiled.py", "torch_impl/mars_m_compiled.py"

_CO = "theory_tests/test_mars_compiled_options.py::"
COMPILED_MARS = (_CO + "test_compiled_mars_option_equals_the_single_tensor_loop",)
COMPILED_EXACT = (_CO + "test_compiled_exact_mode_equals_the_single_tensor_loop",)
COMPILED_MARS_M = (_CO + "test_compiled_mars_m_equals_the_eager_loop",)
DIFF = "theory_tests/test_mars_differential.py::test_float64_matches_reference"
DIFF_M = "theory_tests/test_mars_m_differential.py::test_float64_matches_reference"
MT20 = "theory_tests/test_mars_optimizer_contract.py::test_mt20_foreach_matches_single_tensor"

# a line of the foreach table's decay_ (the single table's reads the same: anchor on the line
# before it)
_FOREACH_DECAY = ("        torch._foreach_div_(x, torch._foreach_clamp_min(divisors, 1.0))\n"
                  "        return x\n\n    @classmethod\n    def decay_(cls, p, lr, wd):\n"
                  "        if wd != 0.0:\n            cls.mul_(p, 1.0 - lr * wd)")
_FIELDS = '_FIELDS = ("lr", "wd", "a", "beta1", "beta2", "eps", "bc1", "sqrt_bc2")'

MARS_MUTANTS = {
    # ---------------------------------------------------------------- (M1)-(M4): the recursion
    "M1": [
        Mutant(R_MARS, "    return g + correction_coefficient(gamma, beta1) * (g - g_prev)",
               "    return g + correction_coefficient(gamma, beta1) * (g - 2 * g_prev)"),
        # exact mode's g_prev taken at the new point: c = g
        Mutant(R_MARS, "        prev = grad(x_prev, xi) if (not opt.config.is_approx and x_prev",
               "        prev = grad(x, xi) if (not opt.config.is_approx and x_prev"),
        # x_{t-1} never advances: every correction is taken at x_1
        Mutant(T_EX, '            opt.state[p]["prev_param"] = x_t\n', "            pass\n"),
        Mutant(T_F, "    return ops.lerp_(g_prev, g, 1.0 + a)", "    return ops.lerp_(g_prev, g, 1.0 - a)"),
        Mutant(T_C, "    c = F.corrected_gradient_(last, g, h.a, COMPILED)",
               "    c = F.corrected_gradient_(last, g, h.beta1, COMPILED)", tests=COMPILED_EXACT),
    ],
    "M2": [
        Mutant(R_MARS, "    return gamma * beta1 / (1.0 - beta1)", "    return gamma * beta1 / (1.0 + beta1)"),
        # approx mode forgets g_{t-1}: every step is a first step
        Mutant(R_MARS, "            self.last_grad = [g.copy() for g in grads]  # the raw g",
               "            self.last_grad = self.last_grad  # the raw g"),
        Mutant(T_F, '    """a = gamma beta1 / (1 - beta1)."""\n    return gamma * beta1 / (1.0 - beta1)',
               '    """a = gamma beta1 / (1 - beta1)."""\n    return gamma / (1.0 - beta1)'),
        Mutant(T_OPS, "        torch._foreach_lerp_(x, y, w)", "        torch._foreach_lerp_(y, x, w)"),
        Mutant(T_OPS, "        return x.add_((y - x) * w)", "        return x.add_((x - y) * w)",
               tests=COMPILED_MARS),
    ],
    "M3": [
        Mutant(R_MARS, "    return c / norm if norm > 1.0 else c", "    return c / norm if norm > 2.0 else c"),
        # the paper's global norm as the sum of the tensors' norms
        Mutant(R_MARS, "    norm = np.sqrt(sum(np.sum(c * c) for c in cs))",
               "    norm = sum(np.sqrt(np.sum(c * c)) for c in cs)"),
        Mutant(R_MARS, "            clipped = iter(clip_global(live))", "            clipped = iter(live)"),
        Mutant(T_F, "    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))",
               "    return torch.stack([n.to(device) for n in norms]).sum()"),
        Mutant(T_OPS, "        return x.div_(divisor.clamp(min=1.0))", "        return x.div_(divisor)"),
        Mutant(T_OPS, "        torch._foreach_div_(x, torch._foreach_clamp_min(divisors, 1.0))",
               "        torch._foreach_div_(x, torch._foreach_clamp_max(divisors, 1.0))"),
        Mutant(T_OPS, "        return x.div_(torch.clamp(divisor, min=1.0))",
               "        return x.div_(torch.clamp(divisor, max=1.0))", tests=COMPILED_MARS),
        # the unused functional form of the global clip (clip_global_) clips per tensor
        Mutant(T_F, "            ops.divide_by_clamped_(cs, [total] * len(cs))",
               "            ops.divide_by_clamped_(cs, norms)"),
        # the optimizer's first pass of the global clip forgets that maximize negates g
        Mutant(T_FN, "F.corrected_gradient_(last.clone(), -g if maximize else g, a))",
               "F.corrected_gradient_(last.clone(), g, a))"),
    ],
    "M4": [
        Mutant(R_MARS, "    return beta1 * m + (1.0 - beta1) * c", "    return beta1 * m + c"),
        Mutant(T_F, "    return ops.lerp_(m, c, 1.0 - beta1)", "    return ops.lerp_(m, c, beta1)"),
        # Lion's step taken before the momentum update (sign of m_{t-1})
        Mutant(T_F, "    momentum_(m, c, h.beta1, ops)\n    lion_step_(p, m, h, ops)",
               "    lion_step_(p, m, h, ops)\n    momentum_(m, c, h.beta1, ops)"),
        # the foreach Shampoo bucket's momentum fed the raw g instead of c~
        Mutant(T_FN, "            F.momentum_(ms, cs, h.beta1, FOREACH)",
               "            F.momentum_(ms, gs, h.beta1, FOREACH)"),
        # the compiled kernels read beta2 as beta1 (the packed hyperparameters out of order)
        Mutant(T_C, _FIELDS, '_FIELDS = ("lr", "wd", "a", "beta2", "beta1", "eps", "bc1", "sqrt_bc2")',
               tests=COMPILED_MARS),
    ],
    "M4-unclipped": [
        Mutant(R_MARS, "    return beta1 * m + (1.0 - beta1) * c", "    return (1.0 - beta1) * m + beta1 * c"),
        Mutant(R_MARS, "    return g + correction_coefficient(gamma, beta1) * (g - g_prev)",
               "    return g + correction_coefficient(gamma, beta1) * (g_prev - g)"),
    ],
    "M5": [
        Mutant(R_MARS, "        return adamw_step(p, m, v, self.k, self.lr, b1, b2, cfg.eps, cfg.weight_decay)",
               "        return adamw_step(p, m, v, self.k + 1, self.lr, b1, b2, cfg.eps, cfg.weight_decay)"),
        Mutant(R_MARS, "    return p - lr * (u + weight_decay * p)", "    return p + lr * (u + weight_decay * p)"),
        Mutant(T_FN, "            F.adamw_rule_(p, c, m, v, v_max, h, SINGLE)",
               "            F.adamw_rule_(p, g, m, v, v_max, h, SINGLE)"),
        Mutant(T_FN, "            F.lion_rule_(ps, cs, ms, h, FOREACH)", "            F.lion_rule_(ps, gs, ms, h, FOREACH)"),
        Mutant(T_C, "    F.adamw_rule_(p, c, m, v, vmax, h, COMPILED)", "    F.adamw_rule_(p, g, m, v, vmax, h, COMPILED)",
               tests=COMPILED_MARS),
    ],
    # ---------------------------------------------------------------- (M6)-(M9): MARS-AdamW
    "M6": [
        Mutant(R_MARS, "    return beta2 * v + (1.0 - beta2) * c * c", "    return beta2 * v + (1.0 - beta2) * c * abs(c) ** 0.5"),
        Mutant(T_F, "    return ops.addcmul_(v, c, c, 1.0 - beta2)", "    return ops.addcmul_(v, c, c, beta2)"),
        Mutant(T_OPS, "        torch._foreach_addcmul_(x, a, b, value=s) if not isinstance(s, list)",
               "        torch._foreach_addcmul_(x, a, b, value=1.0) if not isinstance(s, list)"),
        Mutant(T_OPS, "        return x.add_(a * b * s)", "        return x.add_(a * b)", tests=COMPILED_MARS),
    ],
    "M7": [
        Mutant(R_MARS, "    return m / ((np.sqrt(v) / np.sqrt(bc2) + eps) * bc1)",
               "    return m / ((np.sqrt(v) + eps) * bc1)"),
        Mutant(T_F, "    ops.div_(denom, h.sqrt_bc2)", "    ops.mul_(denom, h.sqrt_bc2)"),
        Mutant(T_F, "    h.sqrt_bc2 = ops.each(lambda k: math.sqrt(1.0 - h.beta2**k), ks)",
               "    h.sqrt_bc2 = ops.each(lambda k: 1.0 - h.beta2**k, ks)"),
        Mutant(T_OPS, "        torch._foreach_addcdiv_(x, a, b, s) if isinstance(s, list)",
               "        torch._foreach_addcmul_(x, a, b, s) if isinstance(s, list)"),
        Mutant(T_OPS, "        return x.add_(a / b * s)", "        return x.add_(b / a * s)", tests=COMPILED_MARS),
        Mutant(T_C, _FIELDS, '_FIELDS = ("lr", "wd", "a", "beta1", "beta2", "eps", "sqrt_bc2", "bc1")',
               tests=COMPILED_MARS),
    ],
    "M8": [
        Mutant(R_MARS, "    return p - lr * (u + weight_decay * p)", "    return p - lr * u - weight_decay * p"),
        # the decay applied to the updated p
        Mutant(T_F, "    ops.decay_(p, h.lr, h.wd)\n    ops.addcdiv_(p, m, denom, ops.each(lambda b: -h.lr / b, h.bc1))",
               "    ops.addcdiv_(p, m, denom, ops.each(lambda b: -h.lr / b, h.bc1))\n    ops.decay_(p, h.lr, h.wd)"),
        Mutant(T_OPS, _FOREACH_DECAY, _FOREACH_DECAY.replace("1.0 - lr * wd", "1.0 - wd")),
        Mutant(T_OPS, "        p.mul_(1.0 - lr * wd)", "        p.mul_(1.0 - wd)", tests=COMPILED_MARS),
    ],
    "M9": [
        Mutant(R_MARS, "    return np.maximum(v_max, v)", "    return np.minimum(v_max, v)"),
        # v-bar computed and then not used
        Mutant(T_F, "        v = amsgrad_max_(v_max, v, ops)", "        amsgrad_max_(v_max, v, ops)"),
        Mutant(T_FN, "            F.adamw_rule_(ps, cs, ms, vs, None if vmaxs[0] is None else vmaxs, h, FOREACH)",
               "            F.adamw_rule_(ps, cs, ms, vs, None, h, FOREACH)"),
        Mutant(T_OPS, "        torch._foreach_maximum_(x, y)", "        torch._foreach_minimum_(x, y)"),
        # the reported survivor: the compiled AMSGrad uses v instead of its running max
        Mutant(T_OPS, "        return x.copy_(torch.maximum(x, y))", "        return x.copy_(y)",
               tests=COMPILED_MARS),
    ],
    # ---------------------------------------------------------------- (M10)-(M13): Lion, Shampoo
    "M10": [
        Mutant(R_MARS, "    return np.sign(m)", "    return np.sign(m) * 0.5"),
        Mutant(T_F, "    ops.add_scaled_(p, ops.sign(m), -h.lr)", "    ops.add_scaled_(p, m, -h.lr)"),
        Mutant(T_OPS, "            torch._foreach_add_(x, y, alpha=s)", "            torch._foreach_add_(x, y, alpha=-s)"),
        Mutant(T_OPS, "        return x.add_(y * s)", "        return x.sub_(y * s)", tests=COMPILED_MARS),
        Mutant(T_C, "    F.lion_rule_(p, c, m, h, COMPILED)", "    F.lion_rule_(p, g, m, h, COMPILED)",
               tests=COMPILED_MARS),
    ],
    "M11": [
        # the singular values kept: U diag(s) V^T = m itself
        Mutant(R_NS, "    return (U * keep) @ Vt", "    return (U * s) @ Vt"),
        Mutant(T_NS, "    return (U * (s > tol).unsqueeze(-2).to(U.dtype)) @ Vh",
               "    return (U * s.unsqueeze(-2)) @ Vh"),
        # the paper's box (orthogonalizer="svd") runs Newton-Schulz
        Mutant(R_MARS, '    if orthogonalizer == "svd":\n        direction = orthogonalize_svd(scaled)',
               '    if orthogonalizer == "svd":\n        direction = newton_schulz(scaled, steps=ns_steps, eps=eps)'),
    ],
    "M12": [
        # Not equivalent: NS divides by ||M|| + eps, so the prescale moves O by ~eps / ||m||.
        Mutant(R_MARS, "    scaled = m / (1.0 - beta1)", "    scaled = m"),
        Mutant(R_MARS, "    return max(1.0, rows / cols) ** 0.5 if cols else 1.0",
               "    return max(1.0, cols / rows) ** 0.5 if cols else 1.0"),
        Mutant(T_F, "    scaled = m * (1.0 / (1.0 - beta1))", "    scaled = m"),
        Mutant(T_F, "    return max(1.0, shape[0] / shape[1]) ** 0.5 if shape[1] else 1.0",
               "    return max(1.0, shape[1] / shape[0]) ** 0.5 if shape[1] else 1.0"),
        Mutant(T_F, "    SINGLE.decay_(p, h.lr, h.wd)", "    SINGLE.decay_(p, h.lr, 0.0)"),
        # the foreach Shampoo bucket orthogonalizes c~ instead of m
        Mutant(T_FN, "            for i, p, m in zip(idx, ps, ms):", "            for i, p, m in zip(idx, ps, cs):"),
    ],
    "M13": [
        Mutant(R_NS, "        X = a * X + (b * Q + c * (Q @ Q)) @ X", "        X = a * X + (b * Q + c * Q) @ X"),
        Mutant(T_NS, "        X = mm(X, mm(Q, Q, Q, beta=b, alpha=c), X, beta=a)",
               "        X = mm(X, mm(Q, Q, Q, beta=c, alpha=b), X, beta=a)"),
    ],
    # ---------------------------------------------------------------- (M14): the 1-D fallback
    "M14": [
        Mutant(R_MARS, "    return len(shape) == 2 or optimize_1d", "    return len(shape) >= 2 or optimize_1d"),
        Mutant(R_MARS, "        return adamw_step(p, m, v, self.k, self.lr * self.lr_1d_factor, b1, b2, cfg.eps, wd)",
               "        return adamw_step(p, m, v, self.k, self.lr, b1, b2, cfg.eps, wd)"),
        Mutant(R_MARS, '        wd = cfg.weight_decay_1d if cfg.weight_decay_1d_source == "constructor" else',
               '        wd = cfg.weight_decay_1d if cfg.weight_decay_1d_source == "group" else'),
        Mutant(T_F, "    return len(shape) == 2 or optimize_1d", "    return len(shape) >= 2 or optimize_1d"),
        Mutant(T_F, '        wd = hp["weight_decay_1d"] if hp["weight_decay_1d_source"] == "constructor" \\',
               '        wd = hp["weight_decay_1d"] if hp["weight_decay_1d_source"] == "group" \\'),
        Mutant(T_FN, "            F.adamw_rule_(ps, gs, ms, vs, None, h, FOREACH)",
               "            F.adamw_rule_(ps, gs, ms, vs, None, F.resolve_hyperparameters(hp, F.ADAMW), FOREACH)"),
        # the reported survivor: the compiled 1-D fallback ignores weight_decay_1d_source
        Mutant(T_C, "            h = F.with_bias_corrections(F.resolve_hyperparameters(hp, kind), key[2], COMPILED)",
               "            h = F.with_bias_corrections(F.resolve_hyperparameters(dict(hp, weight_decay_1d_source="
               "\"constructor\"), kind), key[2], COMPILED)", tests=COMPILED_MARS),
        # the compiled path's hyperparameter cache keyed without the route: the fallback gets
        # the matrices' lr, betas and weight decay (or the other way round)
        Mutant(T_C, "        key = (p.device, p.dtype, k.item(), kind)  # CPU counter: no sync",
               "        key = (p.device, p.dtype, k.item())  # CPU counter: no sync", tests=COMPILED_MARS),
    ],
    # ---------------------------------------------------------------- (M15)-(M18): MARS-M
    "M15": [
        Mutant(R_MM, "    return momentum(m, clip_tensor(c) if clip else c, beta)", "    return momentum(m, c, beta)"),
        Mutant(R_MM, "                                                  cfg.momentum, cfg.clip_c)",
               "                                                  cfg.momentum, True)"),
        Mutant(T_MF, "        F.clip_tensor_(c, ops.norm(c), ops)", "        F.clip_tensor_(c, ops.norm(g), ops)"),
        Mutant(T_MF, "    return F.Hyper(lr, hp[\"weight_decay\"], F.correction_coefficient(hp[\"gamma\"], beta), beta,",
               "    return F.Hyper(lr, hp[\"weight_decay\"], F.correction_coefficient(hp[\"gamma\"], beta), 1 - beta,"),
        Mutant(T_MF, "        args = mars_m_momentum_(bufs, gs, lasts, h, clip, FOREACH)",
               "        args = mars_m_momentum_(bufs, gs, lasts, h, False, FOREACH)"),
        Mutant(T_MC, "    h = M.F.Hyper(lr, wd, a, beta, 0.0, M.MARS_M_NS_EPS)",
               "    h = M.F.Hyper(lr, wd, gamma, beta, 0.0, M.MARS_M_NS_EPS)", tests=COMPILED_MARS_M),
    ],
    "M16": [
        Mutant(R_MM, "    return newton_schulz(m, steps=ns_steps, eps=MARS_M_NS_EPS)",
               "    return newton_schulz(m, steps=ns_steps, eps=1e-8)"),
        Mutant(T_NS, "        X = X / (torch.linalg.matrix_norm(X, keepdim=True) + eps)",
               "        X = X / torch.linalg.matrix_norm(X, keepdim=True)"),
        Mutant(T_MF, "    return newton_schulz(m, steps=ns_steps, eps=MARS_M_NS_EPS, dtype=ns_dtype, cast_first=True)",
               "    return newton_schulz(m, steps=ns_steps, eps=MARS_M_NS_EPS, dtype=ns_dtype, cast_first=False)"),
        # the compiled matrix kernel called with one Newton-Schulz step too few
        Mutant(T_MC, "                kind == M.EFFICIENT, ns_steps, ns_dtype)",
               "                kind == M.EFFICIENT, ns_steps - 1, ns_dtype)", tests=COMPILED_MARS_M),
    ],
    "M17": [
        Mutant(R_MM, "    return p * (1.0 - lr * weight_decay) - lr * scale * o",
               "    return p * (1.0 - weight_decay) - lr * scale * o"),
        Mutant(R_MM, "    return 0.2 * max(shape[0], shape[1]) ** 0.5", "    return 0.2 * min(shape[0], shape[1]) ** 0.5"),
        Mutant(T_MF, "    ops.add_scaled_(p, o, -h.lr * scale)", "    ops.add_scaled_(p, o, -h.lr)"),
        Mutant(T_MF, "    return 0.2 * max(shape[0], shape[1]) ** 0.5", "    return 0.2 * shape[0] ** 0.5"),
        Mutant(T_MC, "    hp = torch.tensor([h.lr, h.wd, h.a, h.beta1, gamma, scale], dtype=dtype)",
               "    hp = torch.tensor([h.lr, h.wd, h.a, h.beta1, gamma, 1.0], dtype=dtype)",
               tests=COMPILED_MARS_M),
    ],
    "M18": [
        Mutant(R_MM, "    return beta * buf + ((1.0 - gamma) * (1.0 - beta) / beta) * g",
               "    return beta * buf + ((1.0 - gamma) * (1.0 - beta)) * g"),
        Mutant(R_MM, "    return gamma * g + beta * buf", "    return gamma * g + buf"),
        Mutant(T_MF, "    return ops.add_scaled_(buf, g, (1.0 - gamma) * (1.0 - beta) / beta)",
               "    return ops.add_scaled_(buf, g, (1.0 - gamma) * (1.0 - beta))"),
        Mutant(T_MF, "    return ops.add_scaled_(buf * beta, g, gamma)", "    return ops.add_scaled_(buf, g, gamma)"),
        Mutant(T_MF, "            efficient_buffer_(bufs, gs, gamma, h.beta1, FOREACH)",
               "            efficient_buffer_(bufs, gs, h.beta1, gamma, FOREACH)"),
        Mutant(T_MM, "                         adamw_eps=adamw_eps, gamma=gamma, efficient=True, **options)",
               "                         adamw_eps=adamw_eps, gamma=gamma, efficient=False, **options)"),
        # the compiled efficient kernel orthogonalizes the buffer instead of gamma g + beta buf
        Mutant(T_MC, "    M.mars_m_step_(p, M.mars_m_direction(m, ns_steps, ns_dtype), h, scale, COMPILED)",
               "    M.mars_m_step_(p, M.mars_m_direction(buf, ns_steps, ns_dtype), h, scale, COMPILED)",
               tests=COMPILED_MARS_M),
    ],
    # ---------------------------------------------------------------- (M19), (M20): reductions
    "M19": [
        Mutant(R_FO, "    u = np.sign(b1 * m + (1 - b1) * g)", "    u = np.sign(b2 * m + (1 - b2) * g)"),
        Mutant(R_MARS, "    return g + correction_coefficient(gamma, beta1) * (g - g_prev)",
               "    return g + correction_coefficient(gamma, beta1) * g"),
    ],
    "M20": [
        Mutant(R_FO, "        g = g + momentum * buf if nesterov else buf", "        g = momentum * buf if nesterov else buf"),
        Mutant(R_FO, "    d = (1 - momentum) * g + momentum * buf if nesterov else buf",
               "    d = g + momentum * buf if nesterov else buf"),
        Mutant(R_MARS, "    return beta1 * m + (1.0 - beta1) * c", "    return beta1 * m + (1.0 - beta1) * c * beta1"),
    ],
    # ---------------------------------------------------------------- MT1-MT20: properties
    "MT1": [
        Mutant(R_FO, "    bc1, bc2 = 1 - b1**k, 1 - b2**k\n    p = p * (1 - lr * weight_decay)",
               "    bc1, bc2 = 1 - b1**k, 1 - b2**(k + 1)\n    p = p * (1 - lr * weight_decay)"),
        Mutant(R_MARS, "        v = self.exp_avg_sq[i] = second_moment(self.exp_avg_sq[i], c, b2)",
               "        v = self.exp_avg_sq[i] = second_moment(self.exp_avg_sq[i], c, b1)"),
        # eps inside the bias correction (MARS-M's backup placement) on MARS-AdamW
        Mutant(T_F, "    ops.div_(denom, h.sqrt_bc2)\n    ops.add_(denom, h.eps)",
               "    ops.add_(denom, h.eps)\n    ops.div_(denom, h.sqrt_bc2)"),
        Mutant(T_F, "    h.bc1 = ops.each(lambda k: 1.0 - h.beta1**k, ks)", "    h.bc1 = ops.each(lambda k: 1.0 - h.beta1**(k + 1), ks)"),
    ],
    "MT2": [
        Mutant(R_MARS, "        cfg, (b1, b2) = self.config, self.config.betas_1d",
               "        cfg, (b1, b2) = self.config, self.config.betas"),
        # the optimizer routes as if optimize_1d were always on
        Mutant(T_MARS, '            kind = F.route(p.shape, group["mars_type"], group["optimize_1d"])',
               '            kind = F.route(p.shape, group["mars_type"], True)'),
        Mutant(T_F, '        b1, b2 = hp["betas_1d"]', '        b1, b2 = hp["betas"]'),
        Mutant(T_F, '        return Hyper(_number(hp["lr"]) * hp["lr_1d_factor"], wd, 0.0, b1, b2, hp["eps"])',
               '        return Hyper(_number(hp["lr"]) * hp["lr_1d_factor"], wd, 0.0, b1, b2, 1e-8)'),
        Mutant(T_F, '        return Hyper(_number(hp["lr"]) * hp["lr_1d_factor"], wd, 0.0, b1, b2, hp["eps"])',
               '        return Hyper(_number(hp["lr"]) * hp["lr_1d_factor"], wd, 0.5, b1, b2, hp["eps"])',
               equivalent="a is the correction's weight; the fallback takes the raw g and never reads it"),
    ],
    "MT3": [
        Mutant(R_MARS, "    return c / norm if norm > 1.0 else c", "    return c / norm"),
        Mutant(R_MARS, "    return [c / norm for c in cs] if norm > 1.0 else list(cs)",
               "    return [c / max(norm, 1.0) ** 2 for c in cs] if norm > 1.0 else list(cs)"),
        Mutant(T_F, "    return ops.divide_by_clamped_(c, norm)", "    return ops.divide_by_clamped_(c, norm * norm)"),
        Mutant(T_FN, "        elif scope == \"global\":\n            FOREACH.divide_by_clamped_(cs, [total] * len(cs))",
               "        elif scope == \"global\":\n            F.clip_tensor_(cs, FOREACH.norm(cs), FOREACH)", tests=(MT20,)),
    ],
    "MT4": [
        Mutant(R_MARS, "    return g + correction_coefficient(gamma, beta1) * (g - g_prev)",
               "    return correction_coefficient(gamma, beta1) * g - correction_coefficient(gamma, beta1) * g_prev"),
        Mutant(T_F, "    return ops.lerp_(g_prev, g, 1.0 + a)", "    return ops.lerp_(g_prev, g, a)"),
    ],
    "MT5": [
        Mutant(R_MARS, "    return g + correction_coefficient(gamma, beta1) * (g - g_prev)",
               "    return g + correction_coefficient(gamma, beta1) * g - g_prev"),
        Mutant(T_F, "    return ops.lerp_(g_prev, g, 1.0 + a)", "    return ops.lerp_(g, g_prev, 1.0 + a)"),
    ],
    "MT6": [
        # spec B1: last_grad keeps c~ (or c) instead of the raw g
        Mutant(R_MARS, "            self.last_grad = [g.copy() for g in grads]  # the raw g",
               "            self.last_grad = [g.copy() if c is None else c.copy() for g, c in zip(grads, corrected)]  # the raw g"),
        Mutant(T_FN, "            last.copy_(g)", "            last.copy_(c)"),
        Mutant(T_FN, "            FOREACH.copy_(lasts, gs)", "            FOREACH.copy_(lasts, cs)"),
        Mutant(T_C, "    F.adamw_rule_(p, c, m, v, vmax, h, COMPILED)\n    if write_last:\n        last.copy_(g)",
               "    F.adamw_rule_(p, c, m, v, vmax, h, COMPILED)\n    if write_last:\n        last.copy_(c)",
               tests=COMPILED_MARS),
    ],
    "MT7": [
        Mutant(R_MARS, "        x_prev = x\n        xs.append(opt.step(g, prev))", "        x_prev = xs[0]\n        xs.append(opt.step(g, prev))"),
        Mutant(R_VR, "            g_prev = np.where(exact, problem.gradient(x_prev, xi), g_last)",
               "            g_prev = np.where(exact, problem.gradient(x, xi), g_last)"),
        # approx mode stops writing g_t into last_grad (the flag inverted): it keeps c~_t
        Mutant(T_MARS, "                            w.last_grads, w.steps, w.kinds, write_last_grad=not exact,",
               "                            w.last_grads, w.steps, w.kinds, write_last_grad=exact,"),
        # exact mode's compiled kernels write g_t into last_grad: invisible to the iterates (the
        # closure refills it with grad f(x_{t-1}, xi_t) before it is read), not to the state,
        # which must hold c~_t as on the eager path
        Mutant(T_C, "    flags = (scope == \"tensor\", write_last)", "    flags = (scope == \"tensor\", True)",
               tests=COMPILED_EXACT),
    ],
    "MT8": [
        Mutant(R_MARS, "            self.last_grad = [np.asarray(g, dtype=np.float64) for g in prev_grads]",
               "            self.last_grad = [np.asarray(g, dtype=np.float64) for g in grads]"),
        Mutant(R_MARS, "        if not cfg.is_approx and self.k > 1:", "        if not cfg.is_approx and self.k > 2:"),
        # the random-number state is not restored between the two evaluations
        Mutant(T_EX, "        _set_rng_state(rng)  # the same sample", "        pass  # the same sample"),
    ],
    "MT9": [
        Mutant(R_MARS, "    return np.sign(m)", "    return np.where(m >= 0, 1.0, -1.0)"),
        # AdamW's bias correction carried over to the Lion step
        Mutant(T_F, "    ops.add_scaled_(p, ops.sign(m), -h.lr)", "    ops.add_scaled_(p, ops.sign(m), -h.lr / h.bc1)"),
        Mutant(T_OPS, "        return torch.sign(x)", "        return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)"),
        Mutant(T_OPS, "        return torch._foreach_sign(x)",
               "        return [torch.where(v >= 0, 1.0, -1.0).to(v.dtype) for v in x]"),
    ],
    "MT10": [
        Mutant(R_FO, "    state[\"m\"] = b2 * m + (1 - b2) * g", "    state[\"m\"] = b2 * m + (1 - b1) * g"),
        Mutant(R_MARS, "    return beta1 * m + (1.0 - beta1) * c", "    return beta1 * m + (1.0 - beta1 ** 2) * c"),
    ],
    "MT11": [
        Mutant(R_FO, "        buf = g.copy() if k == 1 else momentum * state[\"buf\"] + (1 - dampening) * g",
               "        buf = g.copy() if k == 1 else momentum * state[\"buf\"] + (1 - momentum) * g"),
        Mutant(R_MARS, "    return beta1 * m + (1.0 - beta1) * c", "    return m + (1.0 - beta1) * c"),
    ],
    "MT12": [
        Mutant(R_MARS, "    return beta1 * m + (1.0 - beta1) * c", "    return beta1 * m - (1.0 - beta1) * c"),
    ],
    "MT13(a)": [
        Mutant(R_NS, "    X = M / (np.linalg.norm(M) + eps)", "    X = M / (1.0 + eps)"),
        Mutant(T_NS, "        X = (M / (torch.linalg.matrix_norm(M, keepdim=True) + eps)).to(dtype)",
               "        X = (M / (M.abs().amax() + eps)).to(dtype)"),
    ],
    "MT13(b)": [
        Mutant(R_NS, "    for _ in range(steps):\n        Q = X @ X.T", "    for _ in range(steps - 1):\n        Q = X @ X.T"),
        Mutant(T_NS, "    for _ in range(steps):  # b Q X", "    for _ in range(steps + 1):  # b Q X"),
    ],
    "MT13(c)": [
        Mutant(R_NS, "NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)", "NS_COEFFICIENTS = (3.4445, -4.7750, 2.3015)"),
        Mutant(R_NS, "    return a * s + b * s**3 + c * s**5", "    return a * s + b * s**3 + c * s**4"),
        Mutant(T_NS, "NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)", "NS_COEFFICIENTS = (3.4445, -4.7705, 2.0315)"),
    ],
    "MT13(d)": [
        Mutant(R_NS, "    return a * s + b * s**3 + c * s**5", "    return a * s + b * s**2 + c * s**5"),
    ],
    "MT13(e)": [
        Mutant(R_NS, "    return X.T if tall else X", "    return X"),
        Mutant(T_NS, "    if tall:\n        X = X.mT\n    return X if cast_first", "    return X if cast_first"),
    ],
    "MT13(f)": [
        # the iteration left in M's dtype: no bf16 rounding at all
        Mutant(T_NS, "        X = (M / (torch.linalg.matrix_norm(M, keepdim=True) + eps)).to(dtype)",
               "        X = M / (torch.linalg.matrix_norm(M, keepdim=True) + eps)"),
    ],
    "MT14": [
        Mutant(R_MARS, "    return shape_scale(m.shape) * direction", "    return direction"),
        Mutant(T_F, "    p.add_(direction, alpha=-h.lr * (shape_scale(p.shape) if scale is None else scale))",
               "    p.add_(direction, alpha=-h.lr * (1.0 if scale is None else scale))"),
    ],
    "MT15": [
        Mutant(R_MARS, "    return beta1 * m + (1.0 - beta1) * c", "    return beta1 * m + (1.0 - beta1) * (c + m)"),
        Mutant(T_F, "    return ops.lerp_(m, c, 1.0 - beta1)", "    return ops.lerp_(m, c, (1.0 - beta1) ** 2)"),
    ],
    "MT16": [
        Mutant(R_MARS, "    return p - lr * (u + weight_decay * p)", "    return p - lr * (u + weight_decay)"),
        Mutant(T_MARS, "                        lr_1d_factor=lr_1d / lr_value if lr_value > 0 else 0.0,",
               "                        lr_1d_factor=lr_1d if lr_value > 0 else 0.0,"),
    ],
    "MT17": [
        Mutant(R_MARS, "        return adamw_step(p, m, v, self.k, self.lr * self.lr_1d_factor, b1, b2, cfg.eps, wd)",
               "        return adamw_step(p, m, v, self.k, self.config.lr_1d, b1, b2, cfg.eps, wd)"),
        Mutant(T_F, '        return Hyper(_number(hp["lr"]) * hp["lr_1d_factor"], wd, 0.0, b1, b2, hp["eps"])',
               '        return Hyper(hp["lr_1d_factor"] * 3e-3, wd, 0.0, b1, b2, hp["eps"])'),
        Mutant(T_MARS, '            param_group["lr_1d_factor"] = lr_1d / lr if lr > 0 else 0.0',
               '            param_group["lr_1d_factor"] = lr_1d / self.defaults["lr"] if lr > 0 else 0.0',
               tests=("theory_tests/test_mars_options.py::test_group_lr_1d_and_weight_decay_1d_stay_per_group",)),
    ],
    "MT18": [
        Mutant(R_MARS, "    return np.maximum(v_max, v)", "    return np.maximum(v, v)"),
        Mutant(T_FN, "            F.adamw_rule_(p, c, m, v, v_max, h, SINGLE)",
               "            F.adamw_rule_(p, c, m, v, None, h, SINGLE)"),
        Mutant(T_OPS, "        return torch.maximum(x, y, out=x)", "        return x.copy_(y)"),
    ],
    "MT19": [
        Mutant(T_MARS, '            buffers += ["exp_avg_sq"] if kind in (F.ADAMW, F.FALLBACK) else []',
               '            buffers += ["exp_avg_sq"] if kind in (F.ADAMW, F.FALLBACK, F.LION) else []'),
        Mutant(T_MARS, '            if dtype is None or i not in state_dict["state"]:',
               '            if dtype is not None or i not in state_dict["state"]:'),
        Mutant(T_MARS, '                st["step"] = torch.tensor(float(st["step"]))',
               '                st["step"] = st["step"]'),
    ],
    "MT20": [
        Mutant(T_FN, "        elif scope == \"global\":\n            SINGLE.divide_by_clamped_(c, total)",
               "        elif scope == \"global\":\n            SINGLE.divide_by_clamped_(c, SINGLE.norm(c))"),
        Mutant(T_FN, "                                    [steps[i].item() for i in idx], FOREACH)",
               "                                    [steps[idx[0]].item() for i in idx], FOREACH)"),
        Mutant(T_OPS, "        for a, b in zip(x, y):  # DTensor", "        for a, b in zip(x, y[::-1]):  # DTensor"),
    ],
    # ---------------------------------------------------------------- variance reduction
    "VR1": [
        Mutant(R_PB, "            W = (Z + np.swapaxes(Z, -1, -2)) / np.sqrt(2.0)",
               "            W = (Z + np.swapaxes(Z, -1, -2)) / 2.0"),
        Mutant(R_PB, "        return self.tau**2 * (d + 1) * np.sum(u * u, axis=-1) + self.sigma**2 * d",
               "        return self.tau**2 * d * np.sum(u * u, axis=-1) + self.sigma**2 * d"),
        Mutant(R_PB, "        return self.x_star - np.linalg.solve(self.A, self.b_mean)",
               "        return self.x_star + np.linalg.solve(self.A, self.b_mean)"),
    ],
    "VR2": [
        Mutant(R_VR, "    return (1 - beta1) / (1 + beta1)\n", "    return (1 - beta1) / (1 + beta1) ** 2\n"),
        Mutant(R_VR, "    bias = (beta1 * (1 - gamma) / (1 - beta1)) ** 2 * float(np.sum(np.square(drift)))",
               "    bias = (beta1 * (1 - gamma) / (1 - beta1)) * float(np.sum(np.square(drift)))"),
        # the simulator's approx mode keeps c instead of the raw g (spec B1)
        Mutant(R_VR, "        g_last, x_prev = g, x", "        g_last, x_prev = c, x"),
    ],
    "VR3": [
        Mutant(R_VR, "    return (1 - b) / (1 + b) + 2 * gamma * b * (1 - b + gamma * b) / (1 + b)",
               "    return (1 - b) / (1 + b) + 2 * gamma * b * (1 - b + gamma * b) / (1 - b)"),
    ],
    "VR4": [
        Mutant(R_VR, "        return bias + ema_noise_factor(beta1) * (V + tau**2 * (d + 1) * a * (1 + a) * step**2)",
               "        return bias + ema_noise_factor(beta1) * (V + tau**2 * (d + 1) * a * step**2)"),
        Mutant(R_VR, "    return tau**2 * (d + 1) * step**2 < 2 * (1 - beta1) * V",
               "    return tau**2 * (d + 1) * step**2 < (1 - beta1) * V"),
    ],
    "VR5": [
        Mutant(R_VR, "        S = M @ S @ M.T + P @ Q @ P.T", "        S = M @ S @ M.T + P @ Q @ P"),
        Mutant(R_VR, "    b2 = beta1 ** (2 * (t - 1))", "    b2 = beta1 ** (2 * t)"),
        Mutant(R_VR, "    op = np.kron(M, M) + problem.tau**2 * (np.kron(PK, PK)",
               "    op = np.kron(M, M) + problem.tau * (np.kron(PK, PK)"),
    ],
    "P-MARS-exact-cost": [
        # approx mode also evaluates grad f(x_{t-1}, xi_t) (a wasted forward+backward)
        Mutant(R_MARS, "        prev = grad(x_prev, xi) if (not opt.config.is_approx and x_prev is not None) else None",
               "        prev = grad(x_prev, xi) if x_prev is not None else None"),
        # step 1 evaluates the closure twice (no x_0 exists)
        Mutant(T_EX, "    if returning:\n        current", "    if params:\n        current"),
    ],
    "P-MARS-exact-better": [
        Mutant(R_VR, "    V = tau**2 * (d + 1) * radius**2 + sigma**2 * d\n    return tau**2",
               "    V = tau**2 * d * radius**2 + sigma**2 * d\n    return tau**2"),
    ],
    # ---------------------------------------------------------------- MARS-M rows
    "MARS-M-backup": [
        Mutant(R_MM, "    u = m / (eps + np.sqrt(v))", "    u = m / (eps + np.sqrt(v / bc2))"),
        Mutant(T_MF, "        step = -h.lr * h.sqrt_bc2 / h.bc1", "        step = -h.lr / h.bc1"),
        Mutant(T_MF, "        step = [-h.lr * s / b for b, s in zip(h.bc1, h.sqrt_bc2)]",
               "        step = [-h.lr * b / s for b, s in zip(h.bc1, h.sqrt_bc2)]"),
        Mutant(T_MC, "            mars_compiled.compiled(backup_kernel)(*mars_compiled._flat(p, g, m1, m2), cache[key])",
               "            mars_compiled.compiled(backup_kernel)(*mars_compiled._flat(p, g, m2, m1), cache[key])",
               tests=COMPILED_MARS_M),
    ],
    "MARS-M-exact": [
        Mutant(R_MM, "        prev = grad(x_prev, xi) if (not opt.config.is_approx and x_prev is not None) else None",
               "        prev = grad(x, xi) if (not opt.config.is_approx and x_prev is not None) else None"),
        Mutant(T_EX, "            p.copy_(x_t)\n", "            pass\n"),
        Mutant(T_EX, '                st["last_grad"].copy_(st["previous_grad"])',
               '                st["previous_grad"].copy_(st["last_grad"])'),
        Mutant(T_EX, '            g = -p.grad if group["maximize"] else p.grad\n            if "previous_grad"',
               '            g = p.grad\n            if "previous_grad"'),
    ],
    "MARS-authors-exact-API": [
        Mutant(R_MARS, "        if not cfg.is_approx and self.k > 1:", "        if not cfg.is_approx and self.k > 0:"),
        Mutant(T_MARS, "            p.shape, group[\"mars_type\"], group[\"optimize_1d\"]) != F.FALLBACK)",
               "            p.shape, group[\"mars_type\"], group[\"optimize_1d\"]) == F.FALLBACK)"),
        Mutant(T_EX, '    return any("previous_grad" in st for st in opt.state.values())',
               '    return all("previous_grad" in st for st in opt.state.values())'),
        Mutant(T_EX, "        if group[\"is_approx\"]:\n            continue\n        for p in group[\"params\"]:\n            if p.grad is None",
               "        for p in group[\"params\"]:\n            if p.grad is None"),
    ],
}
