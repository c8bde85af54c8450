"""Curated mutants of the MARS family's equations (rows M1-M20: MARS-AdamW, -Lion, -Shampoo,
MARS-M): one-line bugs in the math, keyed by the ``paper_notes/claims.md`` row whose tests
must kill them (the properties' rows: ``mutants_mars_properties.py``). The format is
``mutant.Mutant``'s; ``mutants.py`` merges both lists into ``MUTANTS``.

Every row of the family that names code has a mutant of it in the oracle (``reference/``) and
in the port (``torch_impl/``) where each exists, and in the port's fast paths where they have
code of their own: the foreach path (``tensor_ops.FOREACH``, ``functional._multi_tensor_mars``,
``mars_m_equations``'s foreach branches) and the compiled paths (``tensor_ops.COMPILED``,
``mars_compiled``, ``mars_m_compiled``).  A mutant whose row's test column does not run its
path names its own ``tests``; the compiled ones are killed by the default run's
``mars/test_compiled_options.py``.
"""
from .mutant import Mutant

R_MARS, R_NS = "reference/mars/mars.py", "reference/common/matrix_functions.py"
R_MARS_EQ, R_MM_EQ = "reference/mars/mars_equations.py", "reference/mars/mars_m_equations.py"
R_MM, R_FO = "reference/mars/mars_m.py", "reference/common/first_order.py"
R_VR, R_PB = "reference/mars/variance_reduction.py", "reference/common/problems.py"
T_F, T_FN, T_OPS = "torch_impl/mars/mars_equations.py", "torch_impl/mars/functional.py", "torch_impl/common/tensor_ops.py"
T_MARS, T_EX, T_NS = "torch_impl/mars/mars.py", "torch_impl/mars/exact_mode.py", "torch_impl/common/matrix_functions.py"
T_MF, T_MM = "torch_impl/mars/mars_m_equations.py", "torch_impl/mars/mars_m.py"
T_C, T_MC = "torch_impl/mars/mars_compiled.py", "torch_impl/mars/mars_m_compiled.py"
T_SH = "torch_impl/common/sharding.py"

_CO = "theory_tests/mars/test_compiled_options.py::"
COMPILED_MARS = (_CO + "test_compiled_mars_option_equals_the_single_tensor_loop",)
COMPILED_EXACT = (_CO + "test_compiled_exact_mode_equals_the_single_tensor_loop",)
COMPILED_MARS_M = (_CO + "test_compiled_mars_m_equals_the_eager_loop",)
DIFF = "theory_tests/mars/test_differential.py::test_float64_matches_reference"
DIFF_M = "theory_tests/mars/test_mars_m_differential.py::test_float64_matches_reference"
MT20 = "theory_tests/mars/test_optimizer_contract.py::test_mt20_foreach_matches_single_tensor"

# a line of the foreach table's decay_ (the single table's reads the same: anchor on the line
# before it)
_FOREACH_DECAY = ("        torch._foreach_div_(x, torch._foreach_clamp_min(divisors, 1.0))\n"
                  "        return x\n\n    @classmethod\n    def decay_(cls, p, lr, wd):\n"
                  "        if wd != 0.0:\n            cls.mul_(p, 1.0 - lr * wd)")

MARS_MUTANTS = {
    # ---------------------------------------------------------------- (M1)-(M4): the recursion
    "M1": [
        Mutant(R_MARS_EQ, "    return g + correction_coefficient(gamma, beta1) * (g - g_prev)",
               "    return g + correction_coefficient(gamma, beta1) * (g - 2 * g_prev)"),
        # exact mode's g_prev taken at the new point: c = g
        Mutant(R_MARS, "        prev = grad(x_prev, xi) if (not opt.config.is_approx and x_prev",
               "        prev = grad(x, xi) if (not opt.config.is_approx and x_prev"),
        # x_{t-1} never advances: every correction is taken at x_1
        Mutant(T_EX, '            opt.state[p]["prev_param"] = x_t\n', "            pass\n"),
        Mutant(T_F, '    return ops.lerp_(g_prev, g, 1.0 + correction_coefficient(gamma, beta1))', '    return ops.lerp_(g_prev, g, 1.0 - correction_coefficient(gamma, beta1))'),
        Mutant(T_C, '    c = mars_equations.corrected_gradient_(last, g, h.gamma, h.beta1, COMPILED)',
               '    c = mars_equations.corrected_gradient_(last, g, h.beta1, h.gamma, COMPILED)',
               tests=COMPILED_EXACT),
    ],
    "M2": [
        Mutant(R_MARS_EQ, "    return gamma * beta1 / (1.0 - beta1)", "    return gamma * beta1 / (1.0 + beta1)"),
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
        Mutant(R_MARS_EQ, "    return c / norm if norm > 1.0 else c", "    return c / norm if norm > 2.0 else c"),
        # the paper's global norm as the sum of the tensors' norms
        Mutant(R_MARS_EQ, "    norm = np.sqrt(sum(np.sum(c * c) for c in cs))",
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
        Mutant(T_FN, '                last.clone(), -g if maximize else g, gamma, beta1))',
               '                last.clone(), g, gamma, beta1))'),
    ],
    "M4": [
        Mutant(R_MARS_EQ, "    return beta1 * m + (1.0 - beta1) * c", "    return beta1 * m + c"),
        Mutant(T_F, "    return ops.lerp_(m, c, 1.0 - beta1)", "    return ops.lerp_(m, c, beta1)"),
        # the compiled path's record, moved to the device, read in the wrong order (the
        # record's transport is positional inside packed/unpack only)
        Mutant(T_F, "        return cls(*packed.unbind())", "        return cls(*packed.flip(0).unbind())",
               tests=COMPILED_MARS),
        # Lion's step taken before the momentum update (sign of m_{t-1})
        Mutant(T_F, "    momentum_(m, c, h.beta1, ops)\n    lion_step_(p, m, h, ops)",
               "    lion_step_(p, m, h, ops)\n    momentum_(m, c, h.beta1, ops)"),
        # the foreach Shampoo bucket's momentum fed the raw g instead of c~
        Mutant(T_FN, "            mars_equations.momentum_(ms, cs, h.beta1, FOREACH)",
               "            mars_equations.momentum_(ms, gs, h.beta1, FOREACH)"),
        # the compiled kernels read beta2 as beta1 (the packed hyperparameters out of order)
        Mutant(T_C, '    mars_equations.adamw_rule_(p, c, m, v, vmax, h, COMPILED)',
               '    mars_equations.adamw_rule_(p, c, m, v, vmax, h._replace(beta1=h.beta2, beta2=h.beta1), COMPILED)',
               tests=COMPILED_MARS),
    ],
    "M4-unclipped": [
        Mutant(R_MARS_EQ, "    return beta1 * m + (1.0 - beta1) * c", "    return (1.0 - beta1) * m + beta1 * c"),
        Mutant(R_MARS_EQ, "    return g + correction_coefficient(gamma, beta1) * (g - g_prev)",
               "    return g + correction_coefficient(gamma, beta1) * (g_prev - g)"),
    ],
    "M5": [
        Mutant(R_MARS, "        return adamw_step(p, m, v, self.k, self.lr, b1, b2, cfg.eps, cfg.weight_decay)",
               "        return adamw_step(p, m, v, self.k + 1, self.lr, b1, b2, cfg.eps, cfg.weight_decay)"),
        Mutant(R_MARS_EQ, "    return p - lr * (u + weight_decay * p)", "    return p + lr * (u + weight_decay * p)"),
        Mutant(T_FN, "            mars_equations.adamw_rule_(p, c, m, v, v_max, h, SINGLE)",
               "            mars_equations.adamw_rule_(p, g, m, v, v_max, h, SINGLE)"),
        Mutant(T_FN, "            mars_equations.lion_rule_(ps, cs, ms, h, FOREACH)",
               "            mars_equations.lion_rule_(ps, gs, ms, h, FOREACH)"),
        Mutant(T_C, "    mars_equations.adamw_rule_(p, c, m, v, vmax, h, COMPILED)",
               "    mars_equations.adamw_rule_(p, g, m, v, vmax, h, COMPILED)", tests=COMPILED_MARS),
    ],
    # ---------------------------------------------------------------- (M6)-(M9): MARS-AdamW
    "M6": [
        Mutant(R_MARS_EQ, "    return beta2 * v + (1.0 - beta2) * c * c", "    return beta2 * v + (1.0 - beta2) * c * abs(c) ** 0.5"),
        Mutant(T_F, "    return ops.addcmul_(v, c, c, 1.0 - beta2)", "    return ops.addcmul_(v, c, c, beta2)"),
        Mutant(T_OPS, "        torch._foreach_addcmul_(x, a, b, value=s) if not isinstance(s, list)",
               "        torch._foreach_addcmul_(x, a, b, value=1.0) if not isinstance(s, list)"),
        Mutant(T_OPS, "        return x.add_(a * b * s)", "        return x.add_(a * b)", tests=COMPILED_MARS),
    ],
    "M7": [
        Mutant(R_MARS_EQ, "    return m / ((np.sqrt(v) / np.sqrt(bc2) + eps) * bc1)",
               "    return m / ((np.sqrt(v) + eps) * bc1)"),
        Mutant(T_F, "    ops.div_(denom, h.sqrt_bc2)", "    ops.mul_(denom, h.sqrt_bc2)"),
        Mutant(T_F, '                      sqrt_bc2=ops.each(lambda k: _sqrt(1.0 - h.beta2**k), ks))',
               '                      sqrt_bc2=ops.each(lambda k: 1.0 - h.beta2**k, ks))'),
        Mutant(T_OPS, "        torch._foreach_addcdiv_(x, a, b, s) if isinstance(s, list)",
               "        torch._foreach_addcmul_(x, a, b, s) if isinstance(s, list)"),
        Mutant(T_OPS, "        return x.add_(a / b * s)", "        return x.add_(b / a * s)", tests=COMPILED_MARS),
        Mutant(T_C, '            h = mars_equations.with_bias_corrections(hypers[kind], key[2], COMPILED)',
               '            h = mars_equations.with_bias_corrections(hypers[kind], key[2], COMPILED)\n'
               '            h = h._replace(bc1=h.sqrt_bc2, sqrt_bc2=h.bc1)',
               tests=COMPILED_MARS),
    ],
    "M8": [
        Mutant(R_MARS_EQ, "    return p - lr * (u + weight_decay * p)", "    return p - lr * u - weight_decay * p"),
        # the decay applied to the updated p
        Mutant(T_F, '    ops.decay_(p, h.lr, h.weight_decay)\n    ops.addcdiv_(p, m, denom, ops.each(lambda b: -h.lr / b, h.bc1))',
               '    ops.addcdiv_(p, m, denom, ops.each(lambda b: -h.lr / b, h.bc1))\n    ops.decay_(p, h.lr, h.weight_decay)'),
        Mutant(T_OPS, _FOREACH_DECAY, _FOREACH_DECAY.replace("1.0 - lr * wd", "1.0 - wd")),
        Mutant(T_OPS, "        p.mul_(1.0 - lr * wd)", "        p.mul_(1.0 - wd)", tests=COMPILED_MARS),
    ],
    "M9": [
        Mutant(R_MARS_EQ, "    return np.maximum(v_max, v)", "    return np.minimum(v_max, v)"),
        # v-bar computed and then not used
        Mutant(T_F, "        v = amsgrad_max_(v_max, v, ops)", "        amsgrad_max_(v_max, v, ops)"),
        Mutant(T_FN, "            mars_equations.adamw_rule_(ps, cs, ms, vs, None if vmaxs[0] is None else vmaxs, h,",
               "            mars_equations.adamw_rule_(ps, cs, ms, vs, None, h,"),
        Mutant(T_OPS, "        torch._foreach_maximum_(x, y)", "        torch._foreach_minimum_(x, y)"),
        # the reported survivor: the compiled AMSGrad uses v instead of its running max
        Mutant(T_OPS, "        return x.copy_(torch.maximum(x, y))", "        return x.copy_(y)",
               tests=COMPILED_MARS),
    ],
    # ---------------------------------------------------------------- (M10)-(M13): Lion, Shampoo
    "M10": [
        Mutant(R_MARS_EQ, "    return np.sign(m)", "    return np.sign(m) * 0.5"),
        Mutant(T_F, "    ops.add_scaled_(p, ops.sign(m), -h.lr)", "    ops.add_scaled_(p, m, -h.lr)"),
        Mutant(T_OPS, "            torch._foreach_add_(x, y, alpha=s)", "            torch._foreach_add_(x, y, alpha=-s)"),
        Mutant(T_OPS, "        return x.add_(y * s)", "        return x.sub_(y * s)", tests=COMPILED_MARS),
        Mutant(T_C, "    mars_equations.lion_rule_(p, c, m, h, COMPILED)",
               "    mars_equations.lion_rule_(p, g, m, h, COMPILED)", tests=COMPILED_MARS),
    ],
    "M11": [
        # the singular values kept: U diag(s) V^T = m itself
        Mutant(R_NS, "    return (U * keep) @ Vt", "    return (U * s) @ Vt"),
        Mutant(T_NS, "    return (U * (s > tol).unsqueeze(-2).to(U.dtype)) @ Vh",
               "    return (U * s.unsqueeze(-2)) @ Vh"),
        # the paper's box (orthogonalizer="svd") runs Newton-Schulz
        Mutant(R_MARS_EQ, '    if orthogonalizer == "svd":\n        direction = orthogonalize_svd(scaled)',
               '    if orthogonalizer == "svd":\n        direction = newton_schulz(scaled, steps=ns_steps, eps=eps)'),
    ],
    "M12": [
        # Not equivalent: NS divides by ||M|| + eps, so the prescale moves O by ~eps / ||m||.
        Mutant(R_MARS_EQ, "    scaled = m / (1.0 - beta1)", "    scaled = m"),
        Mutant(R_MARS_EQ, "    return max(1.0, rows / cols) ** 0.5 if cols else 1.0",
               "    return max(1.0, cols / rows) ** 0.5 if cols else 1.0"),
        Mutant(T_F, "    scaled = m * (1.0 / (1.0 - beta1))", "    scaled = m"),
        Mutant(T_F, "    return max(1.0, shape[0] / shape[1]) ** 0.5 if shape[1] else 1.0",
               "    return max(1.0, shape[1] / shape[0]) ** 0.5 if shape[1] else 1.0"),
        Mutant(T_F, '    SINGLE.decay_(p, h.lr, h.weight_decay)', '    SINGLE.decay_(p, h.lr, 0.0)'),
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
        Mutant(R_MARS_EQ, "    return len(shape) == 2 or optimize_1d", "    return len(shape) >= 2 or optimize_1d"),
        Mutant(R_MARS, "        return adamw_step(p, m, v, self.k, self.lr * self.lr_1d_factor, b1, b2, cfg.eps, wd)",
               "        return adamw_step(p, m, v, self.k, self.lr, b1, b2, cfg.eps, wd)"),
        Mutant(R_MARS, '        wd = cfg.weight_decay_1d if cfg.weight_decay_1d_source == "constructor" else',
               '        wd = cfg.weight_decay_1d if cfg.weight_decay_1d_source == "group" else'),
        Mutant(T_F, "    return len(shape) == 2 or optimize_1d", "    return len(shape) >= 2 or optimize_1d"),
        Mutant(T_F, '        if weight_decay_1d_source == "constructor":',
               '        if weight_decay_1d_source == "group":'),
        Mutant(T_FN, "            mars_equations.adamw_rule_(ps, gs, ms, vs, None, h, FOREACH)",
               "            mars_equations.adamw_rule_(ps, gs, ms, vs, None, "
               "mars_equations.resolve_hyperparameters(hp, mars_equations.ADAMW), FOREACH)"),
        # the reported survivor: the compiled 1-D fallback ignores weight_decay_1d_source
        Mutant(T_C, '            h = mars_equations.with_bias_corrections(hypers[kind], key[2], COMPILED)',
               '            h = mars_equations.with_bias_corrections(hypers.get(mars_equations.ADAMW, '
               'hypers[kind]), key[2], COMPILED)', tests=COMPILED_MARS),
        # the compiled path's hyperparameter cache keyed without the route: the fallback gets
        # the matrices' lr, betas and weight decay (or the other way round)
        Mutant(T_C, "        key = (p.device, p.dtype, k.item(), kind)  # CPU counter: no sync",
               "        key = (p.device, p.dtype, k.item())  # CPU counter: no sync", tests=COMPILED_MARS),
    ],
    # ---------------------------------------------------------------- (M15)-(M18): MARS-M
    "M15": [
        Mutant(R_MM_EQ, "    return momentum(m, clip_tensor(c) if clip else c, beta)", "    return momentum(m, c, beta)"),
        Mutant(R_MM, "            m = buf = mars_m_momentum(buf, g, g_prev, cfg.gamma, cfg.momentum, cfg.clip_c)",
               "            m = buf = mars_m_momentum(buf, g, g_prev, cfg.gamma, cfg.momentum, True)"),
        Mutant(T_MF, "        mars_equations.clip_matrices_(c, matrix_batch_dims, ops)",
               "        mars_equations.clip_tensor_(c, ops.norm(g), ops)"),
        Mutant(T_MF, '                                gamma=gamma, beta1=momentum, beta2=0.0, eps=MARS_M_NS_EPS)',
               '                                gamma=gamma, beta1=1 - momentum, beta2=0.0, eps=MARS_M_NS_EPS)'),
        Mutant(T_FN, "        args = mars_m_momentum_(bufs, gs, lasts, h, clip, FOREACH, matrix_batch_dims)",
               "        args = mars_m_momentum_(bufs, gs, lasts, h, False, FOREACH, matrix_batch_dims)"),
        Mutant(T_MC, '        m = mars_m_equations.mars_m_momentum_(buf, g, last, h, clip, COMPILED)',
               '        m = mars_m_equations.mars_m_momentum_(buf, g, last, h._replace(gamma=h.beta1), clip, COMPILED)',
               tests=COMPILED_MARS_M),
    ],
    "M16": [
        Mutant(R_MM_EQ, "    return newton_schulz(m, steps=ns_steps, eps=MARS_M_NS_EPS, coefficients=ns_coefficients)",
               "    return newton_schulz(m, steps=ns_steps, eps=1e-8, coefficients=ns_coefficients)"),
        Mutant(T_NS, "        X = X / (torch.linalg.matrix_norm(X, keepdim=True) + eps)",
               "        X = X / torch.linalg.matrix_norm(X, keepdim=True)"),
        Mutant(T_MF, "              cast_first=True)",
               "              cast_first=False)"),
        # the compiled matrix kernel called with one Newton-Schulz step too few
        Mutant(T_MC, '                key[0] == mars_m_equations.EFFICIENT, ns["ns_steps"], ns["ns_dtype"],',
               '                key[0] == mars_m_equations.EFFICIENT, ns["ns_steps"] - 1, ns["ns_dtype"],',
               tests=COMPILED_MARS_M),
    ],
    "M17": [
        Mutant(R_MM_EQ, "    return p * (1.0 - lr * weight_decay) - lr * scale * o",
               "    return p * (1.0 - weight_decay) - lr * scale * o"),
        Mutant(R_MM_EQ, "    return 0.2 * max(shape[0], shape[1]) ** 0.5", "    return 0.2 * min(shape[0], shape[1]) ** 0.5"),
        Mutant(T_MF, '    ops.add_scaled_(p, o, -h.lr * h.scale)', '    ops.add_scaled_(p, o, -h.lr)'),
        Mutant(T_MF, "    return 0.2 * max(shape[0], shape[1]) ** 0.5", "    return 0.2 * shape[0] ** 0.5"),
        Mutant(T_MC, '            cache[key] = h._replace(scale=s).packed(p.device, dtype)',
               '            cache[key] = h.packed(p.device, dtype)',
               tests=COMPILED_MARS_M),
    ],
    "M18": [
        Mutant(R_MM_EQ, "    return beta * buf + ((1.0 - gamma) * (1.0 - beta) / beta) * g",
               "    return beta * buf + ((1.0 - gamma) * (1.0 - beta)) * g"),
        Mutant(R_MM_EQ, "    return gamma * g + beta * buf", "    return gamma * g + buf"),
        Mutant(T_MF, "    return ops.add_scaled_(buf, g, (1.0 - gamma) * (1.0 - beta) / beta)",
               "    return ops.add_scaled_(buf, g, (1.0 - gamma) * (1.0 - beta))"),
        Mutant(T_MF, "    return ops.add_scaled_(buf * beta, g, gamma)", "    return ops.add_scaled_(buf, g, gamma)"),
        Mutant(T_FN, '            efficient_buffer_(bufs, gs, h.gamma, h.beta1, FOREACH)',
               '            efficient_buffer_(bufs, gs, h.beta1, h.gamma, FOREACH)'),
        Mutant(T_MM, '    __init__ = functools.partialmethod(MARS_M.__init__, efficient=True)',
               '    __init__ = functools.partialmethod(MARS_M.__init__, efficient=False)'),
        # the compiled efficient kernel orthogonalizes the buffer instead of gamma g + beta buf
        Mutant(T_MC, '        ms.append(m.to(ns_dtype))', '        ms.append(buf.to(ns_dtype))',
               tests=COMPILED_MARS_M),
    ],
    # ---------------------------------------------------------------- (M19), (M20): reductions
    "M19": [
        Mutant(R_FO, "    u = np.sign(b1 * m + (1 - b1) * g)", "    u = np.sign(b2 * m + (1 - b2) * g)"),
        Mutant(R_MARS_EQ, "    return g + correction_coefficient(gamma, beta1) * (g - g_prev)",
               "    return g + correction_coefficient(gamma, beta1) * g"),
    ],
    "M20": [
        Mutant(R_FO, "        g = g + momentum * buf if nesterov else buf", "        g = momentum * buf if nesterov else buf"),
        Mutant(R_FO, "    d = (1 - momentum) * g + momentum * buf if nesterov else buf",
               "    d = g + momentum * buf if nesterov else buf"),
        Mutant(R_MARS_EQ, "    return beta1 * m + (1.0 - beta1) * c", "    return beta1 * m + (1.0 - beta1) * c * beta1"),
    ],
    # ---------------------------------------------------------------- MT1-MT20: properties
    # ---------------------------------------------------------------- torch.optim surface (issue 21)
    "PORT-COMPILE-STEP": [
        Mutant(T_F, "    return k if torch.compiler.is_compiling() else k.item()", "    return k.item()"),
        Mutant(T_FN, "        compiled, foreach = False, False  # loop itself; counters stay tensors (_step_count)",
               "        compiled, foreach = compiled, foreach  # loop itself; counters stay tensors (_step_count)"),
    ],
    "PORT-STATE-DTYPE": [
        Mutant(T_MARS, "    dtypes = [torch.promote_types(p.dtype, group[\"state_dtype\"] or p.dtype) for p in params]",
               "    dtypes = [group[\"state_dtype\"] or p.dtype for p in params]"),
        Mutant(T_MARS, "                stored.copy_(working)", "                stored.copy_(stored)"),
        Mutant(T_MARS, "        pre = self.register_load_state_dict_pre_hook(shield_state_dtype)  # after the caller's",
               "        pre = self.register_load_state_dict_pre_hook(shield_state_dtype, prepend=True)  # after the caller's"),
        Mutant(T_MARS, "        post = self.register_load_state_dict_post_hook(unshield_state_dtype, prepend=True)",
               "        post = self.register_load_state_dict_post_hook(unshield_state_dtype, prepend=False)"),
    ],
    "PORT-ATOMIC": [
        Mutant(T_MM, "        self._check_gradients()  # every group's, before the first group changes",
               "        pass  # every group's, before the first group changes"),
        Mutant(T_EX, "    opt._check_gradients()  # noqa: SLF001  (a first step's prev_param is not kept either)",
               "    pass  # noqa: SLF001  (a first step's prev_param is not kept either)"),
        Mutant("torch_impl/baselines/lamb.py", "                if p.grad is not None and p.grad.is_sparse:", "                if False:"),
    ],
    "PORT-EXACT-SCALER": [
        Mutant(T_EX, "    inv_scale = scale.double().reciprocal().float()", "    inv_scale = torch.ones_like(scale)"),
        Mutant(T_EX, "            t.masked_fill_(bad, 0.0)", "            pass"),
        Mutant(T_EX, "    opt._previous_grad_scaled = grad_scaler is None and bool(stored)  # noqa: SLF001",
               "    opt._previous_grad_scaled = False  # noqa: SLF001"),
    ],
    "PORT-TORCH-FLAGS": [
        Mutant("torch_impl/common/validation.py", "    for flag, allowed in ((\"fused\", (None, False)), (\"capturable\", (False,)),",
               "    for flag, allowed in ((\"fused\", (None, False, True)), (\"capturable\", (False,)),"),
        Mutant(T_MARS, "    _check_torch_flags(\"MARS\", g)", "    pass"),
        Mutant(T_MM, "    check_torch_flags(\"MARSM\", g)", "    pass"),
        Mutant("torch_impl/baselines/lamb.py", "    check_torch_flags(\"LAMB\", group)", "    pass"),
        Mutant("torch_impl/baselines/lamb.py", "            _check_group({**self.defaults, **param_group})", "            pass"),
    ],
    "PORT-DCP": [
        # torch's keyword call load_state_dict(state_dict=...) (DCP's) refused
        Mutant(T_MARS, "    def load_state_dict(self, state_dict):", "    def load_state_dict(self, state_dict, /):"),
        Mutant(T_MM, "    def load_state_dict(self, state_dict):", "    def load_state_dict(self, state_dict, /):"),
        # a loaded checkpoint's group values overwritten by the defaults
        Mutant(T_MARS, "                group.setdefault(key, value)", "                group[key] = value"),
        Mutant(T_MM, "                group.setdefault(key, value)", "                group[key] = value"),
        # LAMB's step no longer torch's
        Mutant("torch_impl/baselines/lamb.py", "    def step(self, closure=None):", "    def step(self, closure):"),
        # MKOR's / K-FAC's state not carried where DCP keeps it, or not taken back from there
        Mutant("torch_impl/kronecker/optimizer.py", "            packed[i] = dict(packed.get(i, {}), **entry)",
               "            packed[i] = dict(packed.get(i, {}))"),
        Mutant("torch_impl/kronecker/optimizer.py", "            own = placed if placed is not None else own", "            own = own"),
        # each layer's state loaded into the layer after it (the saved keys matched by order)
        Mutant("torch_impl/kronecker/state_layout.py", "    return {id(p): k for p, k in zip(live, saved)}",
               "    return {id(p): k for p, k in zip(live, saved[1:] + saved[:1])}"),
        # the run's counters not laid out
        Mutant("torch_impl/kronecker/state_layout.py", "    if first is not None:\n        entries.setdefault(first, {})[run_key(key)]",
               "    if first is None:\n        entries.setdefault(first, {})[run_key(key)]"),
        # a keyword of the wrapper's own beside torch's step signature
        Mutant("torch_impl/kronecker/optimizer.py", "    def step(self, closure=None):", "    def step(self, closure=None, *, loss=None):"),
    ],
    "PORT-FSDP2-ORTHOGONALISE": [
        # the owner map differs between ranks
        Mutant(T_SH, "    owners = assign_owners([ns_flops(*lay.shape) for lay in layouts], world)",
               "    owners = [(o + rank) % world for o in assign_owners([ns_flops(*lay.shape) for lay in layouts], world)]"),
        # each rank sent another rank's rows back
        Mutant(T_SH, "        [[layouts[j].piece(out, dst) for j, out in zip(mine, outs)] for dst in range(world)],",
               "        [[layouts[j].piece(out, (dst + 1) % world) for j, out in zip(mine, outs)] for dst in range(world)],"),
        # the uneven split off by one
        Mutant(T_SH, "    chunk = -(-n // world_size)", "    chunk = n // world_size"),
        # the shards joined in the wrong order
        Mutant(T_SH, "    fulls = [torch.cat([received[src][k] for src in range(world)], dim=layouts[j].dim)",
               "    fulls = [torch.cat([received[src][k] for src in reversed(range(world))], dim=layouts[j].dim)"),
        # MARS's owner mode silently every-rank; MARS-M's modes swapped
        Mutant(T_FN, '    directions = (orthogonalize_on_owners(direction, ms) if orthogonalize_on == "owner"',
               '    directions = (orthogonalize_on_owners(direction, ms) if False'),
        Mutant(T_FN, '    if orthogonalize_on == "owner":  # sharded matrices: each NS once, on its owner rank',
               '    if orthogonalize_on != "owner":  # sharded matrices: each NS once, on its owner rank'),
        # the precomputed direction ignored
        Mutant(T_F, "    if direction is None:", "    if True:"),
    ],
    "PORT-HYPERPARAMETERS": [
        # the constructor's threshold dropped on the way to MKOROptions
        Mutant("torch_impl/mkor/preconditioner.py", "            threshold=threshold, stabilizer_norm=stabilizer_norm,",
               "            threshold=RELEASED_THRESHOLD, stabilizer_norm=stabilizer_norm,"),
        # two options swapped in the hand-over
        Mutant("torch_impl/mkor/preconditioner.py",
               "            switch_window=switch_window, switch_check_every=switch_check_every,",
               "            switch_window=switch_check_every, switch_check_every=switch_window,"),
        # the factor update handed the wrong option
        Mutant("torch_impl/mkor/layer_state.py", "            threshold=rule.threshold, norm=rule.stabilizer_norm,",
               "            threshold=2.0, norm=rule.stabilizer_norm,"),
        # a check in another style (or none)
        Mutant("torch_impl/mkor/config.py", '        check_number("threshold", self.threshold, 0.0, low_open=True, finite=True)',
               '        check_number("threshold", self.threshold, 0.0, low_open=True)'),
        Mutant("torch_impl/common/validation.py", '        raise ValueError(f"{name}: expected a value {interval}, got {value!r}")',
               '        raise ValueError(f"{name} must be {interval}, got {value!r}")'),
        # the record filled under the wrong names (the records are built by keyword)
        Mutant(T_F, '    return Hyper(lr=_number(lr), weight_decay=weight_decay, gamma=gamma, beta1=beta1,',
               '    return Hyper(lr=_number(lr), weight_decay=weight_decay, gamma=beta1, beta1=gamma,',
               tests=(DIFF,)),
    ],
}
