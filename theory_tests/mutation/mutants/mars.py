"""Mutants of MARS and MARS-M (``torch_impl/mars/``) and their oracle (``reference/mars/``), keyed
by the ``paper_notes/claims.md`` row whose tests must kill them
(``theory_tests/mutation/mutant.py`` says what a mutant is)."""
from ..mutant import Mutant

__all__ = ["MUTANTS"]

R_MARS = "reference/mars/mars.py"
R_MARS_EQUATIONS = "reference/mars/mars_equations.py"
R_MARS_M = "reference/mars/mars_m.py"
R_MARS_M_EQUATIONS = "reference/mars/mars_m_equations.py"
R_VARIANCE_REDUCTION = "reference/mars/variance_reduction.py"
T_EXACT_MODE = "torch_impl/mars/exact_mode.py"
T_FUNCTIONAL = "torch_impl/mars/functional.py"
T_FUNCTIONAL_CHECKS = "torch_impl/mars/functional_checks.py"
T_MARS = "torch_impl/mars/mars.py"
T_MARS_COMPILED = "torch_impl/mars/mars_compiled.py"
T_MARS_EQUATIONS = "torch_impl/mars/mars_equations.py"
T_MARS_M = "torch_impl/mars/mars_m.py"
T_MARS_M_COMPILED = "torch_impl/mars/mars_m_compiled.py"
T_MARS_M_EQUATIONS = "torch_impl/mars/mars_m_equations.py"
T_STATE_STORAGE = "torch_impl/common/state_storage.py"

COMPILED = ("theory_tests/mars/test_matrix_batch_dims.py::test_compiled_steps_a_stack_as_its_matrices",)
_CO = "theory_tests/mars/test_compiled_options.py::"
COMPILED_EXACT = (_CO + "test_compiled_exact_mode_equals_the_single_tensor_loop",)
COMPILED_MARS = (_CO + "test_compiled_mars_option_equals_the_single_tensor_loop",)
COMPILED_MARS_M = (_CO + "test_compiled_mars_m_equals_the_eager_loop",)
DIFF = "theory_tests/mars/test_differential.py::test_float64_matches_reference"
MT20 = "theory_tests/mars/test_optimizer_contract.py::test_mt20_foreach_matches_single_tensor"
TRACED = ("theory_tests/mars/test_matrix_batch_dims.py::test_a_traced_step_steps_a_stack_as_its_matrices",)
_MARS_FILTER = ('            fresh = [p for p in group["params"] if p.requires_grad and '
                'not self.state.get(p)]')
_MARS_LOOP = "            for _ in self._create_state(group, fresh):\n                pass"
_PLACEHOLDERS = "            exact_mode.init_previous_iterates(self, fresh)"


# PORT-ATOMIC: the step's check of every group, and the per-group loops it precedes
_CHECK_GROUPS = "        self._check_groups()  # every group's, before exact mode moves to x_{t-1}"
_NO_CHECK_GROUPS = "        pass  # every group's, before exact mode moves to x_{t-1}"
_CHECK_AS_IT_STEPS = "\n            _validate_group(group)"
_MARS_M_LOOP = "            params, grads, bufs, lasts, m1, m2, steps, kinds = [], [], [], [], [], [], [], []"
_MARS_STEP_LOOP = "        for group, w in zip(self.param_groups, work):"
_SHARED_AT_STEP = '            _validate_group(group)\n        check_shared("is_approx", self.param_groups, _ONE_MODE)'


def _mars_family(path, buffer):
    """The same bugs in MARS and MARSM (``buffer``: a state key every route has)."""
    return [
        # the counter starts at 1: the init step's t = 2 again
        Mutant(path, _MARS_LOOP,
               '            for p, _, st, *_ in self._create_state(group, fresh):\n'
               '                st["step"].fill_(1.0)'),
        # last_grad initialised to the parameter instead of 0 (g_prev of step 1)
        Mutant(path, _MARS_LOOP,
               '            for p, _, st, *_ in self._create_state(group, fresh):\n'
               '                if "last_grad" in st: st["last_grad"].copy_(p)'),
        # a state key missing (the next step creates it: the state dict is not the first's)
        Mutant(path, _MARS_LOOP,
               '            for p, _, st, *_ in self._create_state(group, fresh):\n'
               f'                st.pop("{buffer}", None)'),
        # frozen parameters (never a gradient, nor from the init step) given state
        Mutant(path, _MARS_FILTER,
               '            fresh = [p for p in group["params"] if not self.state.get(p)]'),
        # the state a parameter already has thrown away (not idempotent, a resumed run reset)
        Mutant(path, _MARS_FILTER,
               '            fresh = [p for p in group["params"] if p.requires_grad and '
               'not self.state.pop(p, None)]'),
        # only the first group
        Mutant(path, "        for group in self.param_groups:\n            fresh = [",
               "        for group in self.param_groups[:1]:\n            fresh = ["),
    ]


MUTANTS = {
    "PORT-INIT-STATE": [
        *_mars_family(T_MARS, "exp_avg"),
        *_mars_family(T_MARS_M, "momentum_buffer"),
        # exact mode's prev_param not named by init_state (MARS, MARSM): a DCP template
        # drops the checkpoint's x_{t-1} and the resumed closure loop skips its re-evaluation
        Mutant(T_MARS, _PLACEHOLDERS, "            pass"),
        Mutant(T_MARS_M, _PLACEHOLDERS, "            pass"),
        # the placeholder taken for x_{t-1} (presence alone): step 1 re-evaluates at zeros
        Mutant(T_EXACT_MODE, '    return "prev_param" in st and float(st.get("step", 0)) > 0',
               '    return "prev_param" in st'),
        # the placeholder never filled at the tensor's first step
        Mutant(T_EXACT_MODE, '                st["prev_param"].copy_(p.detach())', "                pass"),
        # approx mode given an x_{t-1} buffer it never reads (a parameter's worth of memory)
        Mutant(T_EXACT_MODE, '    if opt.param_groups[0]["is_approx"]:\n        return\n    for p in params:',
               '    if False:\n        return\n    for p in params:'),
        # MARS: existing state cast to a state_dtype the group took since (a step would;
        # init_state leaves existing state as it is)
        Mutant(T_MARS, _MARS_FILTER,
               '            fresh = [p for p in group["params"] if p.requires_grad]'),
    ],
    "PORT-FUNCTIONAL": [
        # zip's silent truncation back: lengths unchecked
        Mutant(T_FUNCTIONAL_CHECKS, "        if column is None or len(column) != n:", "        if column is None:"),
        # an unknown kind let through (it then fails, or takes another route's rule)
        Mutant(T_FUNCTIONAL_CHECKS, "        if kind not in needs:", "        if False:"),
        Mutant(T_FUNCTIONAL_CHECKS, "            if t.shape != shape:", "            if False:"),
        Mutant(T_FUNCTIONAL_CHECKS, "        if kind in matrices and len(shape) != matrix_batch_dims + 2:",
               "        if False:"),
        Mutant(T_FUNCTIONAL_CHECKS, "        if not (torch.is_tensor(k) and k.numel() == 1 and not k.is_cuda):",
               "        if not torch.is_tensor(k):"),
        # amsgrad's buffer not required
        Mutant(T_FUNCTIONAL, "(\"max_exp_avg_sqs\",) if amsgrad", "(\"max_exp_avg_sqs\",) if False"),
    ],
    "PORT-TENSOR-HYPER": [
        Mutant(T_MARS_EQUATIONS, "    beta1, beta2 = (_number(b) for b in betas)\n", "    beta1, beta2 = betas\n"),
        Mutant(T_MARS_M_EQUATIONS, "    momentum = mars_equations._number(momentum)", "    momentum = momentum"),
        Mutant(T_FUNCTIONAL, "    beta1 = mars_equations._number(beta1)  # a tensor beta1",
               "    beta1 = beta1  # a tensor beta1"),
    ],
    "PORT-STATE-DTYPE": [
        # a saved group without the key: torch casts the state to the parameter's dtype
        Mutant(T_STATE_STORAGE, "        dtype = group.get(\"state_dtype\", optimizer.defaults.get(\"state_dtype\"))",
               "        dtype = group.get(\"state_dtype\")"),
        Mutant(T_STATE_STORAGE, "        elif st[name].dtype != dtype:", "        elif False:"),
        Mutant(T_STATE_STORAGE, "    dtype = torch.promote_types(p.dtype, stored_dtype(p, group))",
               "    dtype = stored_dtype(p, group)"),
        Mutant(T_STATE_STORAGE, "    stored.copy_(working)\n    if comp", "    stored.copy_(stored)\n    if comp"),
        Mutant(T_STATE_STORAGE, "    pre = optimizer.register_load_state_dict_pre_hook(shield_state_dtype)  # after the caller's",
               "    pre = optimizer.register_load_state_dict_pre_hook(shield_state_dtype, prepend=True)  # after the caller's"),
        Mutant(T_STATE_STORAGE, "    post = optimizer.register_load_state_dict_post_hook(unshield_state_dtype, prepend=True)",
               "    post = optimizer.register_load_state_dict_post_hook(unshield_state_dtype, prepend=False)"),
    ],
    "PORT-MISSING-GRAD": [
        # approx mode keeps the g of the last step the tensor took part in
        Mutant(T_EXACT_MODE, "                opt.state[p][\"last_grad\"].zero_()",
               "                opt.state[p][\"last_grad\"].mul_(1.0)"),
        Mutant(T_MARS, "        exact_mode.forget_missing_gradients(self)  # (M2)",
               "        pass  # (M2)"),
        Mutant(T_MARS_M, "        exact_mode.forget_missing_gradients(self)  # (M2)",
               "        pass  # (M2)"),
        # the authors' loop keeps the older previous_grad / makes none
        Mutant(T_EXACT_MODE, "                    st[\"previous_grad\"].zero_()", "                    pass"),
        Mutant(T_EXACT_MODE, "                    st[\"previous_grad\"] = torch.zeros_like(st[\"last_grad\"])",
               "                    pass"),
        # exact mode: a tensor without a gradient at x_{t-1} keeps its buffer (c~ of the last step)
        Mutant(T_EXACT_MODE, "                if p.grad is None:  # p did not enter the loss at x_{t-1}\n                    buf.zero_()",
               "                if p.grad is None:  # p did not enter the loss at x_{t-1}\n                    pass"),
    ],
    "PORT-DOC-REFS": [
        Mutant("torch_impl/mars/__init__.py", "``torch_impl.mars.functional.mars(params, grads, ...)``",
               "``torch_impl.functional.mars(params, grads, ...)``"),
    ],
    "MT20": [
        # MARS-M's AdamW backup: foreach step sizes lr sqrt(bc2) / bc1 rounded to the dtype
        Mutant(T_MARS_M_EQUATIONS, "        step = [-h.lr * s / b for b, s in zip(h.bc1, h.sqrt_bc2)]",
               "        step = [float(mars_equations.torch.tensor(-h.lr * s / b, dtype=p[0].dtype)) "
               "for b, s in zip(h.bc1, h.sqrt_bc2)]"),
        Mutant(T_FUNCTIONAL, "        elif scope == \"global\":\n            SINGLE.divide_by_clamped_(c, total)",
               "        elif scope == \"global\":\n            SINGLE.divide_by_clamped_(c, SINGLE.norm(c))"),
        Mutant(T_FUNCTIONAL, '            hypers[kind], [steps[i].item() for i in idx], FOREACH)',
               '            hypers[kind], [steps[idx[0]].item() for i in idx], FOREACH)'),
    ],
    "M1": [
        Mutant(R_MARS_EQUATIONS, "    return g + correction_coefficient(gamma, beta1) * (g - g_prev)",
               "    return g + correction_coefficient(gamma, beta1) * (g - 2 * g_prev)"),
        # exact mode's g_prev taken at the new point: c = g
        Mutant(R_MARS, "        prev = grad(x_prev, xi) if (not opt.config.is_approx and x_prev",
               "        prev = grad(x, xi) if (not opt.config.is_approx and x_prev"),
        # x_{t-1} never advances: every correction is taken at x_1
        Mutant(T_EXACT_MODE, '            opt.state[p]["prev_param"] = x_t\n', "            pass\n"),
        Mutant(T_MARS_EQUATIONS, '    return ops.lerp_(g_prev, g, 1.0 + correction_coefficient(gamma, beta1))', '    return ops.lerp_(g_prev, g, 1.0 - correction_coefficient(gamma, beta1))'),
        Mutant(T_MARS_COMPILED, '    c = mars_equations.corrected_gradient_(last, g, h.gamma, h.beta1, COMPILED)',
               '    c = mars_equations.corrected_gradient_(last, g, h.beta1, h.gamma, COMPILED)',
               tests=COMPILED_EXACT),
    ],
    "M2": [
        Mutant(R_MARS_EQUATIONS, "    return gamma * beta1 / (1.0 - beta1)", "    return gamma * beta1 / (1.0 + beta1)"),
        # approx mode forgets g_{t-1}: every step is a first step
        Mutant(R_MARS, "            self.last_grad = [g.copy() for g in grads]  # the raw g",
               "            self.last_grad = self.last_grad  # the raw g"),
        Mutant(T_MARS_EQUATIONS, '    """a = gamma beta1 / (1 - beta1)."""\n    return gamma * beta1 / (1.0 - beta1)',
               '    """a = gamma beta1 / (1 - beta1)."""\n    return gamma / (1.0 - beta1)'),
    ],
    "M3": [
        Mutant(R_MARS_EQUATIONS, "    return c / norm if norm > 1.0 else c", "    return c / norm if norm > 2.0 else c"),
        # the paper's global norm as the sum of the tensors' norms
        Mutant(R_MARS_EQUATIONS, "    norm = np.sqrt(sum(np.sum(c * c) for c in cs))",
               "    norm = sum(np.sqrt(np.sum(c * c)) for c in cs)"),
        Mutant(R_MARS, "            clipped = iter(clip_global(live))", "            clipped = iter(live)"),
        Mutant(T_MARS_EQUATIONS, "    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))",
               "    return torch.stack([n.to(device) for n in norms]).sum()"),
        # the unused functional form of the global clip (clip_global_) clips per tensor
        Mutant(T_MARS_EQUATIONS, "            ops.divide_by_clamped_(cs, [total] * len(cs))",
               "            ops.divide_by_clamped_(cs, norms)"),
        # the optimizer's first pass of the global clip forgets that maximize negates g
        Mutant(T_FUNCTIONAL, '                last.clone(), -g if maximize else g, gamma, beta1))',
               '                last.clone(), g, gamma, beta1))'),
    ],
    "M4": [
        Mutant(R_MARS_EQUATIONS, "    return beta1 * m + (1.0 - beta1) * c", "    return beta1 * m + c"),
        Mutant(T_MARS_EQUATIONS, "    return ops.lerp_(m, c, 1.0 - beta1)", "    return ops.lerp_(m, c, beta1)"),
        # the compiled path's record, moved to the device, read in the wrong order (the
        # record's transport is positional inside packed/unpack only)
        Mutant(T_MARS_EQUATIONS, "        return cls(*packed.unbind())", "        return cls(*packed.flip(0).unbind())",
               tests=COMPILED_MARS),
        # Lion's step taken before the momentum update (sign of m_{t-1})
        Mutant(T_MARS_EQUATIONS, "    momentum_(m, c, h.beta1, ops)\n    lion_step_(p, m, h, ops)",
               "    lion_step_(p, m, h, ops)\n    momentum_(m, c, h.beta1, ops)"),
        # the foreach Shampoo bucket's momentum fed the raw g instead of c~
        Mutant(T_FUNCTIONAL, "            mars_equations.momentum_(ms, cs, h.beta1, FOREACH)",
               "            mars_equations.momentum_(ms, gs, h.beta1, FOREACH)"),
        # the compiled kernels read beta2 as beta1 (the packed hyperparameters out of order)
        Mutant(T_MARS_COMPILED, '    mars_equations.adamw_rule_(p, c, m, v, vmax, h, COMPILED)',
               '    mars_equations.adamw_rule_(p, c, m, v, vmax, h._replace(beta1=h.beta2, beta2=h.beta1), COMPILED)',
               tests=COMPILED_MARS),
    ],
    "M4-unclipped": [
        Mutant(R_MARS_EQUATIONS, "    return beta1 * m + (1.0 - beta1) * c", "    return (1.0 - beta1) * m + beta1 * c"),
        Mutant(R_MARS_EQUATIONS, "    return g + correction_coefficient(gamma, beta1) * (g - g_prev)",
               "    return g + correction_coefficient(gamma, beta1) * (g_prev - g)"),
    ],
    "M5": [
        Mutant(R_MARS, "        return adamw_step(p, m, v, self.k, self.lr, b1, b2, cfg.eps, cfg.weight_decay)",
               "        return adamw_step(p, m, v, self.k + 1, self.lr, b1, b2, cfg.eps, cfg.weight_decay)"),
        Mutant(R_MARS_EQUATIONS, "    return p - lr * (u + weight_decay * p)", "    return p + lr * (u + weight_decay * p)"),
        Mutant(T_FUNCTIONAL, "            mars_equations.adamw_rule_(p, c, m, v, v_max, h, SINGLE)",
               "            mars_equations.adamw_rule_(p, g, m, v, v_max, h, SINGLE)"),
        Mutant(T_FUNCTIONAL, "            mars_equations.lion_rule_(ps, cs, ms, h, FOREACH)",
               "            mars_equations.lion_rule_(ps, gs, ms, h, FOREACH)"),
        Mutant(T_MARS_COMPILED, "    mars_equations.adamw_rule_(p, c, m, v, vmax, h, COMPILED)",
               "    mars_equations.adamw_rule_(p, g, m, v, vmax, h, COMPILED)", tests=COMPILED_MARS),
    ],
    "M6": [
        Mutant(R_MARS_EQUATIONS, "    return beta2 * v + (1.0 - beta2) * c * c", "    return beta2 * v + (1.0 - beta2) * c * abs(c) ** 0.5"),
        Mutant(T_MARS_EQUATIONS, "    return ops.addcmul_(v, c, c, 1.0 - beta2)", "    return ops.addcmul_(v, c, c, beta2)"),
    ],
    "M7": [
        Mutant(R_MARS_EQUATIONS, "    return m / ((np.sqrt(v) / np.sqrt(bc2) + eps) * bc1)",
               "    return m / ((np.sqrt(v) + eps) * bc1)"),
        Mutant(T_MARS_EQUATIONS, "    ops.div_(denom, h.sqrt_bc2)", "    ops.mul_(denom, h.sqrt_bc2)"),
        Mutant(T_MARS_EQUATIONS, '                      sqrt_bc2=ops.each(lambda k: _sqrt(1.0 - h.beta2**k), ks))',
               '                      sqrt_bc2=ops.each(lambda k: 1.0 - h.beta2**k, ks))'),
        Mutant(T_MARS_COMPILED, '            h = mars_equations.with_bias_corrections(hypers[kind], key[2], COMPILED)',
               '            h = mars_equations.with_bias_corrections(hypers[kind], key[2], COMPILED)\n'
               '            h = h._replace(bc1=h.sqrt_bc2, sqrt_bc2=h.bc1)',
               tests=COMPILED_MARS),
    ],
    "M8": [
        Mutant(R_MARS_EQUATIONS, "    return p - lr * (u + weight_decay * p)", "    return p - lr * u - weight_decay * p"),
        # the decay applied to the updated p
        Mutant(T_MARS_EQUATIONS, '    ops.decay_(p, h.lr, h.weight_decay)\n    ops.addcdiv_(p, m, denom, ops.each(lambda b: -h.lr / b, h.bc1))',
               '    ops.addcdiv_(p, m, denom, ops.each(lambda b: -h.lr / b, h.bc1))\n    ops.decay_(p, h.lr, h.weight_decay)'),
    ],
    "M9": [
        Mutant(R_MARS_EQUATIONS, "    return np.maximum(v_max, v)", "    return np.minimum(v_max, v)"),
        # v-bar computed and then not used
        Mutant(T_MARS_EQUATIONS, "        v = amsgrad_max_(v_max, v, ops)", "        amsgrad_max_(v_max, v, ops)"),
        Mutant(T_FUNCTIONAL, "            mars_equations.adamw_rule_(ps, cs, ms, vs, None if vmaxs[0] is None else vmaxs, h,",
               "            mars_equations.adamw_rule_(ps, cs, ms, vs, None, h,"),
    ],
    "M10": [
        Mutant(R_MARS_EQUATIONS, "    return np.sign(m)", "    return np.sign(m) * 0.5"),
        Mutant(T_MARS_EQUATIONS, "    ops.add_scaled_(p, ops.sign(m), -h.lr)", "    ops.add_scaled_(p, m, -h.lr)"),
        Mutant(T_MARS_COMPILED, "    mars_equations.lion_rule_(p, c, m, h, COMPILED)",
               "    mars_equations.lion_rule_(p, g, m, h, COMPILED)", tests=COMPILED_MARS),
    ],
    "M11": [
        # the paper's box (orthogonalizer="svd") runs Newton-Schulz
        Mutant(R_MARS_EQUATIONS, '    if orthogonalizer == "svd":\n        direction = orthogonalize_svd(scaled)',
               '    if orthogonalizer == "svd":\n        direction = newton_schulz(scaled, steps=ns_steps, eps=eps)'),
    ],
    "M12": [
        # Not equivalent: NS divides by ||M|| + eps, so the prescale moves O by ~eps / ||m||.
        Mutant(R_MARS_EQUATIONS, "    scaled = m / (1.0 - beta1)", "    scaled = m"),
        Mutant(R_MARS_EQUATIONS, "    return max(1.0, rows / cols) ** 0.5 if cols else 1.0",
               "    return max(1.0, cols / rows) ** 0.5 if cols else 1.0"),
        Mutant(T_MARS_EQUATIONS, "    scaled = m * (1.0 / (1.0 - beta1))", "    scaled = m"),
        Mutant(T_MARS_EQUATIONS, "    return max(1.0, shape[0] / shape[1]) ** 0.5 if shape[1] else 1.0",
               "    return max(1.0, shape[1] / shape[0]) ** 0.5 if shape[1] else 1.0"),
        Mutant(T_MARS_EQUATIONS, '    SINGLE.decay_(p, h.lr, h.weight_decay)', '    SINGLE.decay_(p, h.lr, 0.0)'),
        # the foreach Shampoo bucket orthogonalizes c~ instead of m
        Mutant(T_FUNCTIONAL, "            for i, p, m in zip(idx, ps, ms):", "            for i, p, m in zip(idx, ps, cs):"),
    ],
    "M14": [
        Mutant(R_MARS_EQUATIONS, "    return len(shape) == 2 or optimize_1d", "    return len(shape) >= 2 or optimize_1d"),
        Mutant(R_MARS, "        return adamw_step(p, m, v, self.k, self.lr * self.lr_1d_factor, b1, b2, cfg.eps, wd)",
               "        return adamw_step(p, m, v, self.k, self.lr, b1, b2, cfg.eps, wd)"),
        Mutant(R_MARS, '        wd = cfg.weight_decay_1d if cfg.weight_decay_1d_source == "constructor" else',
               '        wd = cfg.weight_decay_1d if cfg.weight_decay_1d_source == "group" else'),
        Mutant(T_MARS_EQUATIONS, "    return len(shape) == 2 or optimize_1d", "    return len(shape) >= 2 or optimize_1d"),
        Mutant(T_MARS_EQUATIONS, '        if weight_decay_1d_source == "constructor":',
               '        if weight_decay_1d_source == "group":'),
        Mutant(T_FUNCTIONAL, "            mars_equations.adamw_rule_(ps, gs, ms, vs, None, h, FOREACH)",
               "            mars_equations.adamw_rule_(ps, gs, ms, vs, None, "
               "mars_equations.resolve_hyperparameters(hp, mars_equations.ADAMW), FOREACH)"),
        # the reported survivor: the compiled 1-D fallback ignores weight_decay_1d_source
        Mutant(T_MARS_COMPILED, '            h = mars_equations.with_bias_corrections(hypers[kind], key[2], COMPILED)',
               '            h = mars_equations.with_bias_corrections(hypers.get(mars_equations.ADAMW, '
               'hypers[kind]), key[2], COMPILED)', tests=COMPILED_MARS),
        # the compiled path's hyperparameter cache keyed without the route: the fallback gets
        # the matrices' lr, betas and weight decay (or the other way round)
        Mutant(T_MARS_COMPILED, "        key = (p.device, p.dtype, k.item(), kind)  # CPU counter: no sync",
               "        key = (p.device, p.dtype, k.item())  # CPU counter: no sync", tests=COMPILED_MARS),
    ],
    "M15": [
        Mutant(R_MARS_M_EQUATIONS, "    return momentum(m, clip_tensor(c) if clip else c, beta)", "    return momentum(m, c, beta)"),
        Mutant(R_MARS_M, "            m = buf = mars_m_momentum(buf, g, g_prev, cfg.gamma, cfg.momentum, cfg.clip_c)",
               "            m = buf = mars_m_momentum(buf, g, g_prev, cfg.gamma, cfg.momentum, True)"),
        Mutant(T_MARS_M_EQUATIONS, "        mars_equations.clip_matrices_(c, matrix_batch_dims, ops)",
               "        mars_equations.clip_tensor_(c, ops.norm(g), ops)"),
        Mutant(T_MARS_M_EQUATIONS, '                                gamma=gamma, beta1=momentum, beta2=0.0, eps=MARS_M_NS_EPS)',
               '                                gamma=gamma, beta1=1 - momentum, beta2=0.0, eps=MARS_M_NS_EPS)'),
        Mutant(T_FUNCTIONAL, "        args = mars_m_momentum_(bufs, gs, lasts, h, clip, FOREACH, matrix_batch_dims)",
               "        args = mars_m_momentum_(bufs, gs, lasts, h, False, FOREACH, matrix_batch_dims)"),
        Mutant(T_MARS_M_COMPILED, '        m = mars_m_equations.mars_m_momentum_(buf, g, last, h, clip, COMPILED)',
               '        m = mars_m_equations.mars_m_momentum_(buf, g, last, h._replace(gamma=h.beta1), clip, COMPILED)',
               tests=COMPILED_MARS_M),
    ],
    "M16": [
        Mutant(R_MARS_M_EQUATIONS, "    return newton_schulz(m, steps=ns_steps, eps=MARS_M_NS_EPS, coefficients=ns_coefficients)",
               "    return newton_schulz(m, steps=ns_steps, eps=1e-8, coefficients=ns_coefficients)"),
        Mutant(T_MARS_M_EQUATIONS, "              cast_first=True)",
               "              cast_first=False)"),
        # the compiled matrix kernel called with one Newton-Schulz step too few
        Mutant(T_MARS_M_COMPILED, '                key[0] == mars_m_equations.EFFICIENT, ns["ns_steps"], ns["ns_dtype"],',
               '                key[0] == mars_m_equations.EFFICIENT, ns["ns_steps"] - 1, ns["ns_dtype"],',
               tests=COMPILED_MARS_M),
    ],
    "M17": [
        Mutant(R_MARS_M_EQUATIONS, "    return p * (1.0 - lr * weight_decay) - lr * scale * o",
               "    return p * (1.0 - weight_decay) - lr * scale * o"),
        Mutant(R_MARS_M_EQUATIONS, "    return 0.2 * max(shape[0], shape[1]) ** 0.5", "    return 0.2 * min(shape[0], shape[1]) ** 0.5"),
        Mutant(T_MARS_M_EQUATIONS, '    ops.add_scaled_(p, o, -h.lr * h.scale)', '    ops.add_scaled_(p, o, -h.lr)'),
        Mutant(T_MARS_M_EQUATIONS, "    return 0.2 * max(shape[0], shape[1]) ** 0.5", "    return 0.2 * shape[0] ** 0.5"),
        Mutant(T_MARS_M_COMPILED, '            cache[key] = h._replace(scale=s).packed(p.device, dtype)',
               '            cache[key] = h.packed(p.device, dtype)',
               tests=COMPILED_MARS_M),
    ],
    "M18": [
        Mutant(R_MARS_M_EQUATIONS, "    return beta * buf + ((1.0 - gamma) * (1.0 - beta) / beta) * g",
               "    return beta * buf + ((1.0 - gamma) * (1.0 - beta)) * g"),
        Mutant(R_MARS_M_EQUATIONS, "    return gamma * g + beta * buf", "    return gamma * g + buf"),
        Mutant(T_MARS_M_EQUATIONS, "    return ops.add_scaled_(buf, g, (1.0 - gamma) * (1.0 - beta) / beta)",
               "    return ops.add_scaled_(buf, g, (1.0 - gamma) * (1.0 - beta))"),
        Mutant(T_MARS_M_EQUATIONS, "    return ops.add_scaled_(buf * beta, g, gamma)", "    return ops.add_scaled_(buf, g, gamma)"),
        Mutant(T_FUNCTIONAL, '            efficient_buffer_(bufs, gs, h.gamma, h.beta1, FOREACH)',
               '            efficient_buffer_(bufs, gs, h.beta1, h.gamma, FOREACH)'),
        Mutant(T_MARS_M, '    __init__ = functools.partialmethod(MARS_M.__init__, efficient=True)',
               '    __init__ = functools.partialmethod(MARS_M.__init__, efficient=False)'),
        # the compiled efficient kernel orthogonalizes the buffer instead of gamma g + beta buf
        Mutant(T_MARS_M_COMPILED, '        ms.append(m.to(ns_dtype))', '        ms.append(buf.to(ns_dtype))',
               tests=COMPILED_MARS_M),
    ],
    "M19": [
        Mutant(R_MARS_EQUATIONS, "    return g + correction_coefficient(gamma, beta1) * (g - g_prev)",
               "    return g + correction_coefficient(gamma, beta1) * g"),
    ],
    "M20": [
        Mutant(R_MARS_EQUATIONS, "    return beta1 * m + (1.0 - beta1) * c", "    return beta1 * m + (1.0 - beta1) * c * beta1"),
    ],
    "PORT-COMPILE-STEP": [
        Mutant(T_MARS_EQUATIONS, "    return k if torch.compiler.is_compiling() else k.item()", "    return k.item()"),
        Mutant(T_FUNCTIONAL, "        compiled, foreach = False, False  # loop itself; counters stay tensors (_step_count)",
               "        compiled, foreach = compiled, foreach  # loop itself; counters stay tensors (_step_count)"),
    ],
    "PORT-ATOMIC": [
        Mutant(T_MARS_M, "        self._check_gradients()  # every group's, before the first group changes",
               "        pass  # every group's, before the first group changes"),
        Mutant(T_EXACT_MODE, "    opt._check_gradients()  # noqa: SLF001  (a first step's prev_param is not kept either)",
               "    pass  # noqa: SLF001  (a first step's prev_param is not kept either)"),
        # issue 45: a group's hyperparameters checked as it steps, so a refusal in the last
        # group comes after the earlier ones stepped -- MARS-M ...
        Mutant(T_MARS_M, _CHECK_GROUPS, _NO_CHECK_GROUPS,
               also=((T_MARS_M, _MARS_M_LOOP, _MARS_M_LOOP + _CHECK_AS_IT_STEPS),)),
        # ... and MARS (after every group's state is gathered, as each one steps)
        Mutant(T_MARS, _CHECK_GROUPS, _NO_CHECK_GROUPS,
               also=((T_MARS, _MARS_STEP_LOOP, _MARS_STEP_LOOP + _CHECK_AS_IT_STEPS),)),
        # the mode every group shares not compared: one group turned exact steps as approx
        Mutant(T_MARS, _SHARED_AT_STEP, "            _validate_group(group)\n        pass"),
        Mutant(T_MARS_M, _SHARED_AT_STEP, "            _validate_group(group)\n        pass"),
    ],
    "PORT-EXACT-SCALER": [
        Mutant(T_EXACT_MODE, "    inv_scale = scale.double().reciprocal().float()", "    inv_scale = torch.ones_like(scale)"),
        Mutant(T_EXACT_MODE, "            t.masked_fill_(bad, 0.0)", "            pass"),
        Mutant(T_EXACT_MODE, "    opt._previous_grad_scaled = grad_scaler is None and bool(stored)  # noqa: SLF001",
               "    opt._previous_grad_scaled = False  # noqa: SLF001"),
    ],
    "PORT-TORCH-FLAGS": [
        Mutant(T_MARS, "    _check_torch_flags(\"MARS\", g)", "    pass"),
        Mutant(T_MARS_M, "    check_torch_flags(\"MARSM\", g)", "    pass"),
    ],
    "PORT-DCP": [
        # torch's keyword call load_state_dict(state_dict=...) (DCP's) refused
        Mutant(T_MARS, "    def load_state_dict(self, state_dict):", "    def load_state_dict(self, state_dict, /):"),
        Mutant(T_MARS_M, "    def load_state_dict(self, state_dict):", "    def load_state_dict(self, state_dict, /):"),
        # a loaded checkpoint's group values overwritten by the defaults
        Mutant(T_MARS, "                group.setdefault(key, value)", "                group[key] = value"),
        Mutant(T_MARS_M, "                group.setdefault(key, value)", "                group[key] = value"),
    ],
    "PORT-FSDP2-ORTHOGONALISE": [
        # MARS's owner mode silently every-rank; MARS-M's modes swapped
        Mutant(T_FUNCTIONAL, '    directions = (orthogonalize_on_owners(direction, ms) if orthogonalize_on == "owner"',
               '    directions = (orthogonalize_on_owners(direction, ms) if False'),
        Mutant(T_FUNCTIONAL, '    if orthogonalize_on == "owner":  # sharded matrices: each NS once, on its owner rank',
               '    if orthogonalize_on != "owner":  # sharded matrices: each NS once, on its owner rank'),
        # the precomputed direction ignored
        Mutant(T_MARS_EQUATIONS, "    if direction is None:", "    if True:"),
    ],
    "PORT-HYPERPARAMETERS": [
        # the record filled under the wrong names (the records are built by keyword)
        Mutant(T_MARS_EQUATIONS, '    return Hyper(lr=_number(lr), weight_decay=weight_decay, gamma=gamma, beta1=beta1,',
               '    return Hyper(lr=_number(lr), weight_decay=weight_decay, gamma=beta1, beta1=gamma,',
               tests=(DIFF,)),
    ],
    "MT1": [
        Mutant(R_MARS, "        v = self.exp_avg_sq[i] = second_moment(self.exp_avg_sq[i], c, b2)",
               "        v = self.exp_avg_sq[i] = second_moment(self.exp_avg_sq[i], c, b1)"),
        # eps inside the bias correction (MARS-M's backup placement) on MARS-AdamW
        Mutant(T_MARS_EQUATIONS, "    ops.div_(denom, h.sqrt_bc2)\n    ops.add_(denom, h.eps)",
               "    ops.add_(denom, h.eps)\n    ops.div_(denom, h.sqrt_bc2)"),
        Mutant(T_MARS_EQUATIONS, '    return h._replace(bc1=ops.each(lambda k: 1.0 - h.beta1**k, ks),', '    return h._replace(bc1=ops.each(lambda k: 1.0 - h.beta1**(k + 1), ks),'),
    ],
    "MT2": [
        Mutant(R_MARS, "        cfg, (b1, b2) = self.config, self.config.betas_1d",
               "        cfg, (b1, b2) = self.config, self.config.betas"),
        # the optimizer routes as if optimize_1d were always on
        Mutant(T_MARS, '    return mars_equations.route(p.shape, group["mars_type"], group["optimize_1d"],',
               '    return mars_equations.route(p.shape, group["mars_type"], True,'),
        Mutant(T_MARS_EQUATIONS, "        beta1, beta2 = (_number(b) for b in betas_1d)", "        beta1, beta2 = (_number(b) for b in betas)"),
        Mutant(T_MARS_EQUATIONS, '                     beta1=beta1, beta2=beta2, eps=eps)',
               '                     beta1=beta1, beta2=beta2, eps=1e-8)'),
        Mutant(T_MARS_EQUATIONS, '        return Hyper(lr=_number(lr) * lr_1d_factor, weight_decay=weight_decay, gamma=0.0,',
               '        return Hyper(lr=_number(lr) * lr_1d_factor, weight_decay=weight_decay, gamma=0.5,',
               equivalent="gamma is the correction's; the fallback takes the raw g and never reads it"),
    ],
    "MT3": [
        Mutant(R_MARS_EQUATIONS, "    return c / norm if norm > 1.0 else c", "    return c / norm"),
        Mutant(R_MARS_EQUATIONS, "    return [c / norm for c in cs] if norm > 1.0 else list(cs)",
               "    return [c / max(norm, 1.0) ** 2 for c in cs] if norm > 1.0 else list(cs)"),
        Mutant(T_MARS_EQUATIONS, "    return ops.divide_by_clamped_(c, norm)", "    return ops.divide_by_clamped_(c, norm * norm)"),
        Mutant(T_FUNCTIONAL, "        elif scope == \"global\":\n            FOREACH.divide_by_clamped_(cs, [total] * len(cs))",
               "        elif scope == \"global\":\n"
               "            mars_equations.clip_tensor_(cs, FOREACH.norm(cs), FOREACH)", tests=(MT20,)),
    ],
    "MT4": [
        Mutant(R_MARS_EQUATIONS, "    return g + correction_coefficient(gamma, beta1) * (g - g_prev)",
               "    return correction_coefficient(gamma, beta1) * g - correction_coefficient(gamma, beta1) * g_prev"),
        Mutant(T_MARS_EQUATIONS, '    return ops.lerp_(g_prev, g, 1.0 + correction_coefficient(gamma, beta1))', '    return ops.lerp_(g_prev, g, correction_coefficient(gamma, beta1))'),
    ],
    "MT5": [
        Mutant(R_MARS_EQUATIONS, "    return g + correction_coefficient(gamma, beta1) * (g - g_prev)",
               "    return g + correction_coefficient(gamma, beta1) * g - g_prev"),
        Mutant(T_MARS_EQUATIONS, '    return ops.lerp_(g_prev, g, 1.0 + correction_coefficient(gamma, beta1))', '    return ops.lerp_(g, g_prev, 1.0 + correction_coefficient(gamma, beta1))'),
    ],
    "MT6": [
        # spec B1: last_grad keeps c~ (or c) instead of the raw g
        Mutant(R_MARS, "            self.last_grad = [g.copy() for g in grads]  # the raw g",
               "            self.last_grad = [g.copy() if c is None else c.copy() for g, c in zip(grads, corrected)]  # the raw g"),
        Mutant(T_FUNCTIONAL, "for step t+1\n            last.copy_(g)", "for step t+1\n            last.copy_(c)"),
        Mutant(T_FUNCTIONAL, "        if write_last:\n            FOREACH.copy_(lasts, gs)",
               "        if write_last:\n            FOREACH.copy_(lasts, cs)"),
        Mutant(T_MARS_COMPILED, "    mars_equations.adamw_rule_(p, c, m, v, vmax, h, COMPILED)\n    if write_last:\n"
                    "        last.copy_(g)",
               "    mars_equations.adamw_rule_(p, c, m, v, vmax, h, COMPILED)\n    if write_last:\n"
               "        last.copy_(c)",
               tests=COMPILED_MARS),
    ],
    "MT7": [
        Mutant(R_MARS, "        x_prev = x\n        xs.append(opt.step(g, prev))", "        x_prev = xs[0]\n        xs.append(opt.step(g, prev))"),
        Mutant(R_VARIANCE_REDUCTION, "            g_prev = np.where(exact, problem.gradient(x_prev, xi), g_last)",
               "            g_prev = np.where(exact, problem.gradient(x, xi), g_last)"),
        # approx mode stops writing g_t into last_grad (the flag inverted): it keeps c~_t
        Mutant(T_MARS, '                compiled=group["compiled"], write_last_grad=not exact, global_clip_norm=total,',
               '                compiled=group["compiled"], write_last_grad=exact, global_clip_norm=total,'),
        # exact mode's compiled kernels write g_t into last_grad: invisible to the iterates (the
        # closure refills it with grad f(x_{t-1}, xi_t) before it is read), not to the state,
        # which must hold c~_t as on the eager path
        Mutant(T_MARS_COMPILED, "    flags = (scope == \"tensor\", write_last)", "    flags = (scope == \"tensor\", True)",
               tests=COMPILED_EXACT),
    ],
    "MT8": [
        Mutant(R_MARS, "            self.last_grad = [np.asarray(g, dtype=np.float64) for g in prev_grads]",
               "            self.last_grad = [np.asarray(g, dtype=np.float64) for g in grads]"),
        Mutant(R_MARS, "        if not cfg.is_approx and self.k > 1:", "        if not cfg.is_approx and self.k > 2:"),
        # the random-number state is not restored between the two evaluations
        Mutant(T_EXACT_MODE, "        _set_rng_state(rng)  # the same sample", "        pass  # the same sample"),
    ],
    "MT9": [
        Mutant(R_MARS_EQUATIONS, "    return np.sign(m)", "    return np.where(m >= 0, 1.0, -1.0)"),
        # AdamW's bias correction carried over to the Lion step
        Mutant(T_MARS_EQUATIONS, "    ops.add_scaled_(p, ops.sign(m), -h.lr)", "    ops.add_scaled_(p, ops.sign(m), -h.lr / h.bc1)"),
    ],
    "MT10": [
        Mutant(R_MARS_EQUATIONS, "    return beta1 * m + (1.0 - beta1) * c", "    return beta1 * m + (1.0 - beta1 ** 2) * c"),
    ],
    "MT11": [
        Mutant(R_MARS_EQUATIONS, "    return beta1 * m + (1.0 - beta1) * c", "    return m + (1.0 - beta1) * c"),
    ],
    "MT12": [
        Mutant(R_MARS_EQUATIONS, "    return beta1 * m + (1.0 - beta1) * c", "    return beta1 * m - (1.0 - beta1) * c"),
    ],
    "MT14": [
        Mutant(R_MARS_EQUATIONS, "    return shape_scale(m.shape) * direction", "    return direction"),
        Mutant(T_MARS_EQUATIONS, "    p.add_(direction, alpha=-h.lr * (shape_scale(p.shape) if scale is None else scale))",
               "    p.add_(direction, alpha=-h.lr * (1.0 if scale is None else scale))"),
    ],
    "MT15": [
        Mutant(R_MARS_EQUATIONS, "    return beta1 * m + (1.0 - beta1) * c", "    return beta1 * m + (1.0 - beta1) * (c + m)"),
        Mutant(T_MARS_EQUATIONS, "    return ops.lerp_(m, c, 1.0 - beta1)", "    return ops.lerp_(m, c, (1.0 - beta1) ** 2)"),
    ],
    "MT16": [
        Mutant(R_MARS_EQUATIONS, "    return p - lr * (u + weight_decay * p)", "    return p - lr * (u + weight_decay)"),
        Mutant(T_MARS, "                        lr_1d_factor=lr_1d / lr_value if lr_value > 0 else 0.0,",
               "                        lr_1d_factor=lr_1d if lr_value > 0 else 0.0,"),
    ],
    "MT17": [
        Mutant(R_MARS, "        return adamw_step(p, m, v, self.k, self.lr * self.lr_1d_factor, b1, b2, cfg.eps, wd)",
               "        return adamw_step(p, m, v, self.k, self.config.lr_1d, b1, b2, cfg.eps, wd)"),
        Mutant(T_MARS_EQUATIONS, '        return Hyper(lr=_number(lr) * lr_1d_factor, weight_decay=weight_decay, gamma=0.0,',
               '        return Hyper(lr=lr_1d_factor * 3e-3, weight_decay=weight_decay, gamma=0.0,'),
        Mutant(T_MARS, '            param_group["lr_1d_factor"] = lr_1d / lr if lr > 0 else 0.0',
               '            param_group["lr_1d_factor"] = lr_1d / self.defaults["lr"] if lr > 0 else 0.0',
               tests=("theory_tests/mars/test_options.py::test_group_lr_1d_and_weight_decay_1d_stay_per_group",)),
    ],
    "MT18": [
        Mutant(R_MARS_EQUATIONS, "    return np.maximum(v_max, v)", "    return np.maximum(v, v)"),
        Mutant(T_FUNCTIONAL, "            mars_equations.adamw_rule_(p, c, m, v, v_max, h, SINGLE)",
               "            mars_equations.adamw_rule_(p, c, m, v, None, h, SINGLE)"),
    ],
    "MT19": [
        Mutant(T_MARS, '            buffers += ["exp_avg_sq"] if kind in (mars_equations.ADAMW, '
                       'mars_equations.FALLBACK) else []',
               '            buffers += ["exp_avg_sq"] if kind in (mars_equations.ADAMW, '
               'mars_equations.FALLBACK, mars_equations.LION) else []'),
        Mutant(T_STATE_STORAGE, "                            dtype is not None and _keeps_state_dtype(key, value)) or (",
               "                            dtype is None and _keeps_state_dtype(key, value)) or ("),
        Mutant(T_MARS, '                st["step"] = torch.tensor(float(st["step"]))',
               '                st["step"] = st["step"]'),
    ],
    "VR2": [
        Mutant(R_VARIANCE_REDUCTION, "    return (1 - beta1) / (1 + beta1)\n", "    return (1 - beta1) / (1 + beta1) ** 2\n"),
        Mutant(R_VARIANCE_REDUCTION, "    bias = (beta1 * (1 - gamma) / (1 - beta1)) ** 2 * float(np.sum(np.square(drift)))",
               "    bias = (beta1 * (1 - gamma) / (1 - beta1)) * float(np.sum(np.square(drift)))"),
        # the simulator's approx mode keeps c instead of the raw g (spec B1)
        Mutant(R_VARIANCE_REDUCTION, "        g_last, x_prev = g, x", "        g_last, x_prev = c, x"),
    ],
    "VR3": [
        Mutant(R_VARIANCE_REDUCTION, "    return (1 - b) / (1 + b) + 2 * gamma * b * (1 - b + gamma * b) / (1 + b)",
               "    return (1 - b) / (1 + b) + 2 * gamma * b * (1 - b + gamma * b) / (1 - b)"),
    ],
    "VR4": [
        Mutant(R_VARIANCE_REDUCTION, "        return bias + ema_noise_factor(beta1) * (V + tau**2 * (d + 1) * a * (1 + a) * step**2)",
               "        return bias + ema_noise_factor(beta1) * (V + tau**2 * (d + 1) * a * step**2)"),
        Mutant(R_VARIANCE_REDUCTION, "    return tau**2 * (d + 1) * step**2 < 2 * (1 - beta1) * V",
               "    return tau**2 * (d + 1) * step**2 < (1 - beta1) * V"),
    ],
    "VR5": [
        Mutant(R_VARIANCE_REDUCTION, "        S = M @ S @ M.T + P @ Q @ P.T", "        S = M @ S @ M.T + P @ Q @ P"),
        Mutant(R_VARIANCE_REDUCTION, "    b2 = beta1 ** (2 * (t - 1))", "    b2 = beta1 ** (2 * t)"),
        Mutant(R_VARIANCE_REDUCTION, "    op = np.kron(M, M) + problem.tau**2 * (np.kron(PK, PK)",
               "    op = np.kron(M, M) + problem.tau * (np.kron(PK, PK)"),
    ],
    "P-MARS-exact-cost": [
        # approx mode also evaluates grad f(x_{t-1}, xi_t) (a wasted forward+backward)
        Mutant(R_MARS, "        prev = grad(x_prev, xi) if (not opt.config.is_approx and x_prev is not None) else None",
               "        prev = grad(x_prev, xi) if x_prev is not None else None"),
        # step 1 evaluates the closure twice (no x_0 exists)
        Mutant(T_EXACT_MODE, "    if returning:\n        current", "    if params:\n        current"),
    ],
    "P-MARS-exact-better": [
        Mutant(R_VARIANCE_REDUCTION, "    V = tau**2 * (d + 1) * radius**2 + sigma**2 * d\n    return tau**2",
               "    V = tau**2 * d * radius**2 + sigma**2 * d\n    return tau**2"),
    ],
    "MARS-M-backup": [
        Mutant(R_MARS_M_EQUATIONS, "    u = m / (eps + np.sqrt(v))", "    u = m / (eps + np.sqrt(v / bc2))"),
        Mutant(T_MARS_M_EQUATIONS, "        step = -h.lr * h.sqrt_bc2 / h.bc1", "        step = -h.lr / h.bc1"),
        Mutant(T_MARS_M_EQUATIONS, "        step = [-h.lr * s / b for b, s in zip(h.bc1, h.sqrt_bc2)]",
               "        step = [-h.lr * b / s for b, s in zip(h.bc1, h.sqrt_bc2)]"),
        Mutant(T_MARS_M_COMPILED, "            mars_compiled.compiled(backup_kernel)(*mars_compiled._flat(p, g, m1, m2), cache[key])",
               "            mars_compiled.compiled(backup_kernel)(*mars_compiled._flat(p, g, m2, m1), cache[key])",
               tests=COMPILED_MARS_M),
    ],
    "MARS-M-exact": [
        Mutant(R_MARS_M, "        prev = grad(x_prev, xi) if (not opt.config.is_approx and x_prev is not None) else None",
               "        prev = grad(x, xi) if (not opt.config.is_approx and x_prev is not None) else None"),
        Mutant(T_EXACT_MODE, "            p.copy_(x_t)\n", "            pass\n"),
        Mutant(T_EXACT_MODE, '                write_state(group, index, position, st["last_grad"], st["previous_grad"],',
               '                write_state(group, index, position, st["previous_grad"], st["last_grad"],'),
        Mutant(T_EXACT_MODE, '            g = -p.grad if group["maximize"] else p.grad\n            if "previous_grad"',
               '            g = p.grad\n            if "previous_grad"'),
    ],
    "MARS-authors-exact-API": [
        Mutant(R_MARS, "        if not cfg.is_approx and self.k > 1:", "        if not cfg.is_approx and self.k > 0:"),
        Mutant(T_MARS, "        keeps_last_grad = (lambda p, group: _route(p, group) != mars_equations.FALLBACK)",
               "        keeps_last_grad = (lambda p, group: _route(p, group) == mars_equations.FALLBACK)"),
        Mutant(T_EXACT_MODE, '    return any("previous_grad" in st for st in opt.state.values())',
               '    return all("previous_grad" in st for st in opt.state.values())'),
        Mutant(T_EXACT_MODE, "        if group[\"is_approx\"]:\n            continue\n        for p in group[\"params\"]:\n            if not keeps_last_grad(p, group):",
               "        for p in group[\"params\"]:\n            if not keeps_last_grad(p, group):"),
    ],
    "MOE-MARS-BATCH": [
        # a stack clipped as one tensor: the per-matrix norms replaced by the whole stack's
        # (the port's loop path of MARS and MARS-M, and every stack of the foreach paths)
        Mutant(T_MARS_EQUATIONS, "    return torch.linalg.vector_norm(c, dim=(-2, -1), keepdim=True)",
               "    return torch.linalg.vector_norm(c)"),
        # the foreach path alone clips a stack by its whole norm
        Mutant(T_MARS_EQUATIONS, "    norms = [_matrix_norms(x) if stack else SINGLE.norm(x) for x, stack in zip(c, stacks)]",
               "    norms = [SINGLE.norm(x) for x in c]"),
        # the oracle's MARS clips a stack as one tensor
        Mutant(R_MARS_EQUATIONS, "    return over_matrices(clip_tensor, batch_dims, c)", "    return clip_tensor(c)"),
        # the oracle's MARS-M steps a stack as one tensor (one clip norm, one NS of the stack)
        Mutant(R_MARS_M, "                self._matrix_step, cfg.matrix_batch_dims, p, g, self.buf[i], self.last_grad[i])",
               "                self._matrix_step, 0, p, g, self.buf[i], self.last_grad[i])"),
        # a stack scaled by the stack's shape: MARS-M's 0.2 sqrt(max(E, A)) (eager paths) ...
        Mutant(T_FUNCTIONAL, "        scale = match_rms_scale(p.shape[-2:]) if r[8] is None else r[8]",
               "        scale = match_rms_scale(p.shape) if r[8] is None else r[8]"),
        # ... the compiled MARS-M kernel's ...
        Mutant(T_MARS_M_COMPILED, "        s = mars_m_equations.match_rms_scale(p.shape[-2:]) if scale is None else scale",
               "        s = mars_m_equations.match_rms_scale(p.shape) if scale is None else scale",
               tests=COMPILED),
        # ... and MARS-Shampoo's s = sqrt(max(1, E / A))
        Mutant(T_MARS_EQUATIONS, "        scale = shape_scale(p.shape[-2:])", "        scale = shape_scale(p.shape)"),
        # the compiled MARS-AdamW / Lion kernels take a stack whole (one clip norm)
        Mutant(T_MARS_COMPILED, "        for row in each_matrix(matrix_batch_dims, p, g, m, v, vmax, last):",
               "        for row in each_matrix(0, p, g, m, v, vmax, last):",
               tests=COMPILED),
        # torch.compile(opt.step) on the CPU: the traced clip divides each matrix by the
        # stack's norm
        Mutant(T_MARS_EQUATIONS, "        clip_tensor_(c[i], ops.norm(c[i]), ops)",
               "        clip_tensor_(c[i], ops.norm(c), ops)", tests=TRACED),
    ],
    "MOE-MARS-ROUTING": [
        # auto guesses a 3-D tensor is a stack of matrices (of its last two dims): the port ...
        Mutant(T_MARS_EQUATIONS, "    if len(shape) == matrix_batch_dims + 2:\n        return matrix_batch_dims",
               "    if len(shape) >= 2:\n        return len(shape) - 2"),
        # ... and the oracle
        Mutant(R_MARS_EQUATIONS, "    if len(shape) == matrix_batch_dims + 2:\n        return matrix_batch_dims",
               "    if len(shape) >= 2:\n        return len(shape) - 2"),
        # MARS-M's auto rule takes every tensor of ndim >= 2 for a matrix (or stack)
        Mutant(T_MARS_M, '        rule = "mars_m" if p.ndim - stacked == 2 else "adamw"',
               '        rule = "mars_m" if p.ndim >= 2 else "adamw"'),
        # a shape that fits no reading of the option is routed anyway, not refused
        Mutant(T_MARS_EQUATIONS, "    if matrix_batch_dims == 0 or len(shape) < 2:\n        return 0",
               "    if True:\n        return 0"),
        # the functional MARS-M checks matrix routes for 2-D whatever the option says
        Mutant(T_FUNCTIONAL, "                matrices=(MATRIX, EFFICIENT), optional=(\"shape_scales\",),\n"
                     "                matrix_batch_dims=matrix_batch_dims)",
               "                matrices=(MATRIX, EFFICIENT), optional=(\"shape_scales\",),\n"
               "                matrix_batch_dims=0)"),
        # a group changed to a value its shapes do not fit is found only once earlier groups
        # have stepped (the step checks the first group alone)
        Mutant(T_MARS_M, "        for group in self.param_groups:\n            _validate_group(group)",
               "        for group in self.param_groups[:1]:\n            _validate_group(group)"),
        # MARS passes the group's option nowhere: stacks take the non-2-D fallback
        Mutant(T_MARS, '                matrix_batch_dims=group["matrix_batch_dims"])',
               '                matrix_batch_dims=0)'),
    ],
    "ORTH-BATCH": [
        # MARS-Shampoo's directions assigned to the wrong matrices
        Mutant(T_FUNCTIONAL, "    for i, d in zip(rest, orthogonalize_by_shape(direction, [ms[i] for i in rest])):",
               "    for i, d in zip(rest[::-1], orthogonalize_by_shape(direction, [ms[i] for i in rest])):"),
        # the compiled kernel steps every matrix of a group with the first one's direction
        Mutant(T_MARS_M_COMPILED, "        mars_m_equations.mars_m_step_(p, o[i], h, COMPILED)",
               "        mars_m_equations.mars_m_step_(p, o[0], h, COMPILED)"),
        # the compiled path drops the schedule
        Mutant(T_MARS_M_COMPILED, '                ns["ns_coefficients"], ns["orthogonalizer"])',
               '                "authors", ns["orthogonalizer"])'),
    ],
    "PEER-TIMM": [
        # the fallback's two weight-decay sources swapped (timm's is the group's weight_decay)
        Mutant(T_MARS_EQUATIONS, '        if weight_decay_1d_source == "constructor":',
               '        if weight_decay_1d_source == "group":'),
        # optimize_1d does not reach a tensor of ndim > 2 (timm's Conv1d kernel takes MARS)
        Mutant(T_MARS_EQUATIONS, "    return len(shape) == 2 or optimize_1d",
               "    return len(shape) == 2 or (optimize_1d and len(shape) < 3)"),
        # eps added before the bias correction (timm and ours: after it)
        Mutant(T_MARS_EQUATIONS, "    ops.div_(denom, h.sqrt_bc2)\n    ops.add_(denom, h.eps)",
               "    ops.add_(denom, h.eps)\n    ops.div_(denom, h.sqrt_bc2)"),
    ],
    "PEER-PYTORCH-OPTIMIZER": [
        # the fallback's lr without lr_1d_factor
        Mutant(T_MARS_EQUATIONS, "        return Hyper(lr=_number(lr) * lr_1d_factor, weight_decay=weight_decay, gamma=0.0,",
               "        return Hyper(lr=_number(lr), weight_decay=weight_decay, gamma=0.0,"),
        # the fallback with the MARS betas instead of betas_1d
        Mutant(T_MARS_EQUATIONS, "        beta1, beta2 = (_number(b) for b in betas_1d)",
               "        beta1, beta2 = (_number(b) for b in betas)"),
        Mutant(T_MARS_EQUATIONS, '        if weight_decay_1d_source == "constructor":',
               '        if weight_decay_1d_source == "group":'),
    ],
    "PEER-TORCH-MUON": [
        # clip_c ignored: MARS-M always clips (invisible with gradients below norm 1)
        Mutant(T_MARS_M_EQUATIONS, "    c = mars_equations.corrected_gradient_(last, g, h.gamma, h.beta1, ops)\n    if clip:",
               "    c = mars_equations.corrected_gradient_(last, g, h.gamma, h.beta1, ops)\n    if True:"),
    ],
}
