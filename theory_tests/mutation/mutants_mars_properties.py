"""Curated mutants of the MARS family's testable properties and results (rows MT1-MT20,
VR1-VR5, P-MARS-*, MARS-M-backup, MARS-M-exact, MARS-authors-exact-API): the same format and
paths as ``mutants_mars.py`` (the equations M1-M20); ``mutants.py`` merges both lists.
"""
from .mutant import Mutant
from .mutants_mars import (COMPILED_EXACT, COMPILED_MARS, COMPILED_MARS_M, MT20, R_FO, R_MARS,
                           R_MARS_EQ, R_MM, R_MM_EQ, R_NS, R_PB, R_VR, T_C, T_EX, T_F, T_FN,
                           T_MARS, T_MC, T_MF, T_NS, T_OPS)

MARS_PROPERTY_MUTANTS = {
    "MT1": [
        Mutant(R_FO, "    bc1, bc2 = 1 - b1**k, 1 - b2**k\n    p = p * (1 - lr * weight_decay)",
               "    bc1, bc2 = 1 - b1**k, 1 - b2**(k + 1)\n    p = p * (1 - lr * weight_decay)"),
        Mutant(R_MARS, "        v = self.exp_avg_sq[i] = second_moment(self.exp_avg_sq[i], c, b2)",
               "        v = self.exp_avg_sq[i] = second_moment(self.exp_avg_sq[i], c, b1)"),
        # eps inside the bias correction (MARS-M's backup placement) on MARS-AdamW
        Mutant(T_F, "    ops.div_(denom, h.sqrt_bc2)\n    ops.add_(denom, h.eps)",
               "    ops.add_(denom, h.eps)\n    ops.div_(denom, h.sqrt_bc2)"),
        Mutant(T_F, '    return h._replace(bc1=ops.each(lambda k: 1.0 - h.beta1**k, ks),', '    return h._replace(bc1=ops.each(lambda k: 1.0 - h.beta1**(k + 1), ks),'),
    ],
    "MT2": [
        Mutant(R_MARS, "        cfg, (b1, b2) = self.config, self.config.betas_1d",
               "        cfg, (b1, b2) = self.config, self.config.betas"),
        # the optimizer routes as if optimize_1d were always on
        Mutant(T_MARS, '    return mars_equations.route(p.shape, group["mars_type"], group["optimize_1d"],',
               '    return mars_equations.route(p.shape, group["mars_type"], True,'),
        Mutant(T_F, "        beta1, beta2 = (_number(b) for b in betas_1d)", "        beta1, beta2 = (_number(b) for b in betas)"),
        Mutant(T_F, '                     beta1=beta1, beta2=beta2, eps=eps)',
               '                     beta1=beta1, beta2=beta2, eps=1e-8)'),
        Mutant(T_F, '        return Hyper(lr=_number(lr) * lr_1d_factor, weight_decay=weight_decay, gamma=0.0,',
               '        return Hyper(lr=_number(lr) * lr_1d_factor, weight_decay=weight_decay, gamma=0.5,',
               equivalent="gamma is the correction's; the fallback takes the raw g and never reads it"),
    ],
    "MT3": [
        Mutant(R_MARS_EQ, "    return c / norm if norm > 1.0 else c", "    return c / norm"),
        Mutant(R_MARS_EQ, "    return [c / norm for c in cs] if norm > 1.0 else list(cs)",
               "    return [c / max(norm, 1.0) ** 2 for c in cs] if norm > 1.0 else list(cs)"),
        Mutant(T_F, "    return ops.divide_by_clamped_(c, norm)", "    return ops.divide_by_clamped_(c, norm * norm)"),
        Mutant(T_FN, "        elif scope == \"global\":\n            FOREACH.divide_by_clamped_(cs, [total] * len(cs))",
               "        elif scope == \"global\":\n"
               "            mars_equations.clip_tensor_(cs, FOREACH.norm(cs), FOREACH)", tests=(MT20,)),
    ],
    "MT4": [
        Mutant(R_MARS_EQ, "    return g + correction_coefficient(gamma, beta1) * (g - g_prev)",
               "    return correction_coefficient(gamma, beta1) * g - correction_coefficient(gamma, beta1) * g_prev"),
        Mutant(T_F, '    return ops.lerp_(g_prev, g, 1.0 + correction_coefficient(gamma, beta1))', '    return ops.lerp_(g_prev, g, correction_coefficient(gamma, beta1))'),
    ],
    "MT5": [
        Mutant(R_MARS_EQ, "    return g + correction_coefficient(gamma, beta1) * (g - g_prev)",
               "    return g + correction_coefficient(gamma, beta1) * g - g_prev"),
        Mutant(T_F, '    return ops.lerp_(g_prev, g, 1.0 + correction_coefficient(gamma, beta1))', '    return ops.lerp_(g, g_prev, 1.0 + correction_coefficient(gamma, beta1))'),
    ],
    "MT6": [
        # spec B1: last_grad keeps c~ (or c) instead of the raw g
        Mutant(R_MARS, "            self.last_grad = [g.copy() for g in grads]  # the raw g",
               "            self.last_grad = [g.copy() if c is None else c.copy() for g, c in zip(grads, corrected)]  # the raw g"),
        Mutant(T_FN, "for step t+1\n            last.copy_(g)", "for step t+1\n            last.copy_(c)"),
        Mutant(T_FN, "        if write_last:\n            FOREACH.copy_(lasts, gs)",
               "        if write_last:\n            FOREACH.copy_(lasts, cs)"),
        Mutant(T_C, "    mars_equations.adamw_rule_(p, c, m, v, vmax, h, COMPILED)\n    if write_last:\n"
                    "        last.copy_(g)",
               "    mars_equations.adamw_rule_(p, c, m, v, vmax, h, COMPILED)\n    if write_last:\n"
               "        last.copy_(c)",
               tests=COMPILED_MARS),
    ],
    "MT7": [
        Mutant(R_MARS, "        x_prev = x\n        xs.append(opt.step(g, prev))", "        x_prev = xs[0]\n        xs.append(opt.step(g, prev))"),
        Mutant(R_VR, "            g_prev = np.where(exact, problem.gradient(x_prev, xi), g_last)",
               "            g_prev = np.where(exact, problem.gradient(x, xi), g_last)"),
        # approx mode stops writing g_t into last_grad (the flag inverted): it keeps c~_t
        Mutant(T_MARS, '                compiled=group["compiled"], write_last_grad=not exact, global_clip_norm=total,',
               '                compiled=group["compiled"], write_last_grad=exact, global_clip_norm=total,'),
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
        Mutant(R_MARS_EQ, "    return np.sign(m)", "    return np.where(m >= 0, 1.0, -1.0)"),
        # AdamW's bias correction carried over to the Lion step
        Mutant(T_F, "    ops.add_scaled_(p, ops.sign(m), -h.lr)", "    ops.add_scaled_(p, ops.sign(m), -h.lr / h.bc1)"),
        Mutant(T_OPS, "        return torch.sign(x)", "        return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)"),
        Mutant(T_OPS, "        return torch._foreach_sign(x)",
               "        return [torch.where(v >= 0, 1.0, -1.0).to(v.dtype) for v in x]"),
    ],
    "MT10": [
        Mutant(R_FO, "    state[\"m\"] = b2 * m + (1 - b2) * g", "    state[\"m\"] = b2 * m + (1 - b1) * g"),
        Mutant(R_MARS_EQ, "    return beta1 * m + (1.0 - beta1) * c", "    return beta1 * m + (1.0 - beta1 ** 2) * c"),
    ],
    "MT11": [
        Mutant(R_FO, "        buf = g.copy() if k == 1 else momentum * state[\"buf\"] + (1 - dampening) * g",
               "        buf = g.copy() if k == 1 else momentum * state[\"buf\"] + (1 - momentum) * g"),
        Mutant(R_MARS_EQ, "    return beta1 * m + (1.0 - beta1) * c", "    return m + (1.0 - beta1) * c"),
    ],
    "MT12": [
        Mutant(R_MARS_EQ, "    return beta1 * m + (1.0 - beta1) * c", "    return beta1 * m - (1.0 - beta1) * c"),
    ],
    "MT13(a)": [
        Mutant(R_NS, "    X = M / (np.linalg.norm(M) + eps)\n    tall = M.shape[0] > M.shape[1]\n    if tall:\n        X = X.T\n    for a, b, c in ns_schedule", "    X = M / (1.0 + eps)\n    tall = M.shape[0] > M.shape[1]\n    if tall:\n        X = X.T\n    for a, b, c in ns_schedule"),
        Mutant(T_NS, "        X = (M / (torch.linalg.matrix_norm(M, keepdim=True) + eps)).to(dtype)",
               "        X = (M / (M.abs().amax() + eps)).to(dtype)"),
    ],
    "MT13(b)": [
        Mutant(R_NS, "    for a, b, c in ns_schedule(coefficients, steps):\n        Q = X @ X.T", "    for a, b, c in ns_schedule(coefficients, steps)[:-1]:\n        Q = X @ X.T"),
        Mutant(T_NS, "    for a, b, c in schedule:  # b Q X", "    for a, b, c in schedule + schedule[-1:]:  # b Q X"),
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
        Mutant(R_NS, "        X = a * X + (b * Q + c * (Q @ Q)) @ X\n    return X.T if tall else X", "        X = a * X + (b * Q + c * (Q @ Q)) @ X\n    return X"),
        Mutant(T_NS, "    if tall:\n        X = X.mT\n    return X if cast_first", "    return X if cast_first"),
    ],
    "MT13(f)": [
        # the iteration left in M's dtype: no bf16 rounding at all
        Mutant(T_NS, "        X = (M / (torch.linalg.matrix_norm(M, keepdim=True) + eps)).to(dtype)",
               "        X = M / (torch.linalg.matrix_norm(M, keepdim=True) + eps)"),
    ],
    "MT14": [
        Mutant(R_MARS_EQ, "    return shape_scale(m.shape) * direction", "    return direction"),
        Mutant(T_F, "    p.add_(direction, alpha=-h.lr * (shape_scale(p.shape) if scale is None else scale))",
               "    p.add_(direction, alpha=-h.lr * (1.0 if scale is None else scale))"),
    ],
    "MT15": [
        Mutant(R_MARS_EQ, "    return beta1 * m + (1.0 - beta1) * c", "    return beta1 * m + (1.0 - beta1) * (c + m)"),
        Mutant(T_F, "    return ops.lerp_(m, c, 1.0 - beta1)", "    return ops.lerp_(m, c, (1.0 - beta1) ** 2)"),
    ],
    "MT16": [
        Mutant(R_MARS_EQ, "    return p - lr * (u + weight_decay * p)", "    return p - lr * (u + weight_decay)"),
        Mutant(T_MARS, "                        lr_1d_factor=lr_1d / lr_value if lr_value > 0 else 0.0,",
               "                        lr_1d_factor=lr_1d if lr_value > 0 else 0.0,"),
    ],
    "MT17": [
        Mutant(R_MARS, "        return adamw_step(p, m, v, self.k, self.lr * self.lr_1d_factor, b1, b2, cfg.eps, wd)",
               "        return adamw_step(p, m, v, self.k, self.config.lr_1d, b1, b2, cfg.eps, wd)"),
        Mutant(T_F, '        return Hyper(lr=_number(lr) * lr_1d_factor, weight_decay=weight_decay, gamma=0.0,',
               '        return Hyper(lr=lr_1d_factor * 3e-3, weight_decay=weight_decay, gamma=0.0,'),
        Mutant(T_MARS, '            param_group["lr_1d_factor"] = lr_1d / lr if lr > 0 else 0.0',
               '            param_group["lr_1d_factor"] = lr_1d / self.defaults["lr"] if lr > 0 else 0.0',
               tests=("theory_tests/mars/test_options.py::test_group_lr_1d_and_weight_decay_1d_stay_per_group",)),
    ],
    "MT18": [
        Mutant(R_MARS_EQ, "    return np.maximum(v_max, v)", "    return np.maximum(v, v)"),
        Mutant(T_FN, "            mars_equations.adamw_rule_(p, c, m, v, v_max, h, SINGLE)",
               "            mars_equations.adamw_rule_(p, c, m, v, None, h, SINGLE)"),
        Mutant(T_OPS, "        return torch.maximum(x, y, out=x)", "        return x.copy_(y)"),
    ],
    "MT19": [
        Mutant(T_MARS, '            buffers += ["exp_avg_sq"] if kind in (mars_equations.ADAMW, '
                       'mars_equations.FALLBACK) else []',
               '            buffers += ["exp_avg_sq"] if kind in (mars_equations.ADAMW, '
               'mars_equations.FALLBACK, mars_equations.LION) else []'),
        Mutant("torch_impl/mars/state_dtype.py", '            if dtype is None or i not in state_dict["state"]:',
               '            if dtype is not None or i not in state_dict["state"]:'),
        Mutant(T_MARS, '                st["step"] = torch.tensor(float(st["step"]))',
               '                st["step"] = st["step"]'),
    ],
    "MT20": [
        Mutant(T_FN, "        elif scope == \"global\":\n            SINGLE.divide_by_clamped_(c, total)",
               "        elif scope == \"global\":\n            SINGLE.divide_by_clamped_(c, SINGLE.norm(c))"),
        Mutant(T_FN, '            hypers[kind], [steps[i].item() for i in idx], FOREACH)',
               '            hypers[kind], [steps[idx[0]].item() for i in idx], FOREACH)'),
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
        Mutant(R_MM_EQ, "    u = m / (eps + np.sqrt(v))", "    u = m / (eps + np.sqrt(v / bc2))"),
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
        Mutant(T_MARS, "        keeps_last_grad = (lambda p, group: _route(p, group) != mars_equations.FALLBACK)",
               "        keeps_last_grad = (lambda p, group: _route(p, group) == mars_equations.FALLBACK)"),
        Mutant(T_EX, '    return any("previous_grad" in st for st in opt.state.values())',
               '    return all("previous_grad" in st for st in opt.state.values())'),
        Mutant(T_EX, "        if group[\"is_approx\"]:\n            continue\n        for p in group[\"params\"]:\n            if not keeps_last_grad(p, group):",
               "        for p in group[\"params\"]:\n            if not keeps_last_grad(p, group):"),
    ],
}
