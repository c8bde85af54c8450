"""Mutants of the baselines, K-FAC and LAMB (``torch_impl/baselines/``, ``reference/baselines/``),
keyed by the ``paper_notes/claims.md`` row whose tests must kill them
(``theory_tests/mutation/mutant.py`` says what a mutant is)."""
from ..mutant import Mutant

__all__ = ["MUTANTS"]

R_KFAC = "reference/baselines/kfac.py"
T_KFAC = "torch_impl/baselines/kfac.py"
T_KFAC_CONVENTIONS = "torch_impl/baselines/kfac_conventions.py"
T_KFAC_EQUATIONS = "torch_impl/baselines/kfac_equations.py"
T_LAMB = "torch_impl/baselines/lamb.py"
T_FLAVOURS = "torch_impl/baselines/kfac_flavours.py"
T_CURVATURE = "torch_impl/baselines/kfac_curvature.py"
T_CAPTURE = "torch_impl/kronecker/capture/capture.py"
R_FLAVOURS = "reference/baselines/kfac_flavours.py"

_LAMB_FILTER = "                                         if p.requires_grad and not self.state.get(p)]):"
_LAMB_LOOP = ("                                         if p.requires_grad and "
              "not self.state.get(p)]):\n                pass")

MUTANTS = {
    "K5": [
        Mutant(T_KFAC, "s_sum * samples / scale / scale, present)", "s_sum * samples / scale, present)"),
        # The factor N / s^2 rounded to float32 (computed from GradScaler's float32 scale
        # alone, as the port once did): off by ~7e-8 unless s is a power of two.
        Mutant(T_KFAC, "s_sum * samples / scale / scale, present)", "s_sum * (samples / scale / scale), present)"),
    ],
    "K19": [
        # Conv2d's A averaged over samples instead of rows (L = 4 times too large): the MLP
        # differential test has no Conv2d; the per-sample definition has.
        Mutant(T_KFAC_EQUATIONS, "    return flat.T @ flat, n\n",
               "    return flat.T @ flat, n / layer.type.rows_per_sample(rows.shape[:-1])\n"),
        Mutant(T_KFAC_EQUATIONS, "    samples = n / layer.type.rows_per_sample(rows.shape[:-1])", "    samples = n"),
        # Shared by the oracle and the port: a Conv2d's G scaled by its B L rows instead of
        # its B samples (the survivor, before the oracle had a Conv2d path).
        Mutant(R_KFAC, "    samples = rows / rows_per_sample\n", "    samples = rows\n",
               also=((T_KFAC_EQUATIONS, "    samples = n / layer.type.rows_per_sample(rows.shape[:-1])",
                      "    samples = n"),)),
        Mutant(R_KFAC, "    return QG @ ((QG.T @ G_hat @ QA) / (np.outer(lamG, lamA) + damping)) @ QA.T",
               "    return QG @ ((QG.T @ G_hat @ QA) / (np.outer(lamG, lamA) + 2 * damping)) @ QA.T"),
        Mutant(T_KFAC_EQUATIONS, "        X = X / (lam + damping)", "        X = X / (lam + 2 * damping)"),
        Mutant(T_KFAC, "        return nu.clamp(max=1.0)", "        return nu.clamp(max=2.0)"),
    ],
    "KC4-PORT": [
        # reduce's and expand's scalings swapped: reduce's A divided by the rows (expand's
        # N S) instead of its N samples, and expand's by the samples instead of the rows
        Mutant(T_FLAVOURS, "    kept = (count > 0).sum() if mask is not None else r.shape[0]\n",
               "    kept = (count > 0).sum() if mask is not None else r.shape[0] * r.shape[1]\n"),
        Mutant(T_FLAVOURS, "            return total / n\n", "            return total / rows[0][0].shape[0]\n"),
        # the split of the scalars between A and G (a summed and g averaged per sample): the
        # same product whenever every sample has S rows, but not the oracle's stated split
        Mutant(T_FLAVOURS, "    a, n = _reduce(rows, mask, layer.has_bias, mean=True)",
               "    a, n = _reduce(rows, mask, layer.has_bias, mean=False)",
               also=((T_FLAVOURS, "    g, n = _reduce(rows, mask, False, mean=False)",
                      "    g, n = _reduce(rows, mask, False, mean=True)"),)),
        # MC drawing the targets (the empirical Fisher) instead of the model's prediction
        Mutant(T_FLAVOURS, "        cols.append((p - _one_hot(draw, p, cdim)) / math.sqrt(mc_samples))",
               "        cols.append((p - _one_hot(targets, p, cdim)) / math.sqrt(mc_samples))"),
        Mutant(T_FLAVOURS, "    return [-scale * torch.randn(f.shape, generator=generator, dtype=f.dtype, device=f.device)",
               "    return [-scale / 2 * (f - targets.to(f.dtype))"),
        # a dropped bias column: reduce's (kfac_flavours) and expand's (the K19 statistic)
        Mutant(T_FLAVOURS, "    if has_bias:\n        total = torch.cat", "    if False:\n        total = torch.cat"),
        Mutant(T_KFAC_EQUATIONS, "    if layer.has_bias:\n        ones = ", "    if False:\n        ones = "),
        # the wrong R for a mean: MSE's divided by the data points only, CE's not at all
        Mutant(T_FLAVOURS, "        return 1.0 if loss_func.reduction == \"sum\" else 1.0 / output.numel()",
               "        return 1.0 if loss_func.reduction == \"sum\" else 1.0 / output.shape[0]"),
        Mutant(T_FLAVOURS, "    return 1.0 / keep.sum().to(torch.promote_types(output.dtype, torch.float32))",
               "    return 1.0"),
        # the oracle's reduce A divided by the rows, not the samples (the port test sees it)
        Mutant(R_FLAVOURS, "    return a_bar.T @ a_bar / a.shape[0], R * g_hat.T @ g_hat",
               "    return a_bar.T @ a_bar / (a.shape[0] * a.shape[1]), R * g_hat.T @ g_hat"),
        # the transposed square root (S^T S = H, not S S^T)
        Mutant(T_FLAVOURS, "            col = -p * sq.narrow(cdim, c, 1)", "            col = -sq * p.narrow(cdim, c, 1)"),
        # MSE's Hessian taken as I instead of 2 I
        Mutant(T_FLAVOURS, "            col[..., c] = math.sqrt(2.0)", "            col[..., c] = 1.0"),
        # ignored positions kept as data points
        Mutant(T_FLAVOURS, "        cols = [c * keep for c in _ce_columns(", "        cols = [c for c in _ce_columns("),
        # a shared layer's calls reduced per call, not per sample over all calls
        Mutant(T_FLAVOURS, "            a = torch.cat([_per_sample(r[0].detach(), None)[0] for r in rows], dim=1)",
               "            a = torch.cat([_per_sample(r[0].detach(), None)[0] for r in rows], dim=0)"),
    ],
    "KFAC-FLAVOURS": [
        # the columns' rows also added to the layer's training pair (A counted C + 1 times)
        Mutant(T_CAPTURE, "            self.columns.add(layer, g_stat)\n            return\n",
               "            self.columns.add(layer, g_stat)\n"),
        # G from the training backward's rows although the columns were run
        Mutant(T_KFAC, "                    s_sum, samples = columns[0], 1.0 / columns[1]",
               "                    pass"),
        # the columns divided by the loss scale as the training rows are
        Mutant(T_KFAC, "        scale = scale if self._columns is None else 1.0", "        scale = scale"),
        # D of a mean: 1 per call instead of the counted positions
        Mutant(T_CURVATURE, "    den = (1.0 / R if loss_func.reduction == \"mean\" else 1.0)", "    den = 1.0"),
        # the self-check skipping the columns (their weight gradients then see no rows)
        Mutant(T_CAPTURE, "        if sketch is not None:\n            with torch.no_grad(), torch.autocast(g_rows",
               "        if sketch is not None and not self.in_columns:\n            with torch.no_grad(), torch.autocast(g_rows"),
        # the missing curvature_backward not noticed: the step falls back on nothing
        Mutant(T_CURVATURE, "    found = kfac._columns.get(layer.name)\n    if found is None:",
               "    found = kfac._columns.get(layer.name) or (torch.zeros(()), 1.0)\n    if found is None:"),
        # off-step calls not a no-op: columns run on a step without a factor update
        Mutant(T_CURVATURE, " or kfac._detached or not kfac._capture.capturing:", " or kfac._detached:"),
        # zero_grad dropping the pending columns too
        Mutant(T_CURVATURE, "        self.done = {}", "        self.done, self.pending = {}, {}"),
        # across ranks: the union's G divided by the ranks instead of the union's D
        Mutant(T_KFAC, "                    G = S_sum / sums[2 + per_sample(layer)][0]",
               "                    G = S_sum / world"),
        # reduce ignoring a token mask (padding rows averaged in)
        Mutant(T_FLAVOURS, "    w = r.new_ones(r.shape[:2]) if w is None else w.to(r.dtype)",
               "    w = r.new_ones(r.shape[:2])"),
        # reduce's statistics not wired in the optimizer
        Mutant(T_KFAC, "                                reduce_input_stat if reduce else input_stat,",
               "                                input_stat,"),
        # the refusals
        Mutant(T_CURVATURE, "        if getattr(module, \"batch_first\", True) is False:",
               "        if getattr(module, \"batch_first\", True) is None:"),
        Mutant(T_CURVATURE, "    sharded = _fsdp2_modules(kfac._capture.model)\n", "    sharded = []\n"),
        Mutant(T_CURVATURE, "    if fisher_type != \"empirical\" and grad_hook != \"tensor\":",
               "    if False:"),
    ],
    "KFAC-CURVLINOPS": [
        # the MC draws in another order (the same distribution: only the peer's exact draws
        # see it)
        Mutant(T_FLAVOURS, "        draw = torch.multinomial(flat, 1, generator=generator).reshape(shape)",
               "        draw = torch.multinomial(flat.flip(0), 1, generator=generator).flip(0).reshape(shape)"),
    ],
    "PORT-LAMB-SURFACE": [
        Mutant(T_LAMB, "    return torch.view_as_real(t) if torch.is_complex(t) else t", "    return t"),
        Mutant(T_LAMB, "            vs.append(_real(state[\"exp_avg_sq\"]))", "            vs.append(state[\"exp_avg_sq\"])"),
        Mutant(T_LAMB, "            g = -g", "            g = g"),
        Mutant(T_LAMB, "            gs = torch._foreach_neg(gs)", "            gs = gs"),
        Mutant(T_LAMB, "            return group[\"foreach\"]", "            return False"),
        Mutant(T_LAMB, "        torch._foreach_add_(denom, eps)", "        torch._foreach_add_(denom, 2 * eps)"),
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
    "PORT-ROWS": [
        Mutant(T_KFAC, "                A = A_sum / _per_matrix(rows.clamp(min=1))", "                A = A_sum / world"),
        Mutant(T_KFAC, "                G = S_sum * _per_matrix(samples) / world / world / scale / scale",
               "                G = S_sum * _per_matrix(samples) / world / scale / scale"),
    ],
    "KFAC-CONVENTIONS": [
        Mutant(T_KFAC_CONVENTIONS, "        return positions ** 2, batch ** 2 * positions ** 3",
               "        return positions, batch ** 2 * positions ** 3"),
        Mutant(T_KFAC_CONVENTIONS, "    return 1, rows ** 2", "    return 1, rows"),
        Mutant(T_KFAC_CONVENTIONS, "        ours_damping = c * damping", "        ours_damping = damping"),
        Mutant(T_KFAC_CONVENTIONS, "        ours_kl = kl_clip * lr_0 ** 2 / (c * lr_kp ** 2)",
               "        ours_kl = kl_clip * lr_0 / (c * lr_kp)"),
        Mutant(T_KFAC_CONVENTIONS, "            settings = {\"lr\": group[\"lr\"] * c}", "            settings = {\"lr\": group[\"lr\"]}"),
        Mutant(T_KFAC, "                    blends[key] = torch.where(_per_matrix(first & (self.factor_init == \"batch\")),",
               "                    blends[key] = torch.where(_per_matrix(first),"),
    ],
    "PORT-KFAC-ACCUM": [
        Mutant(R_KFAC, "    g = samples * g\n", "    g = g\n", tests=("theory_tests/baselines/test_kfac_reference.py",)),
        # Shared by the oracle and the port: G = sum_i g_i g_i^T, the factor N that undoes the
        # mean-reduction of the loss forgotten in both.
        Mutant(R_KFAC, "    g = samples * g\n", "    g = g * samples ** 0.5\n",
               also=((T_KFAC_EQUATIONS, "    samples = n / layer.type.rows_per_sample(rows.shape[:-1])",
                      "    samples = n / n"),)),
        Mutant(T_KFAC_EQUATIONS, "    samples = n / layer.type.rows_per_sample(rows.shape[:-1])", "    samples = n"),
        Mutant(T_KFAC, "                s[key] = torch.where(_per_matrix(ok), blended, s[key])", "                s[key] = blended"),
    ],
    "PORT-FSDP2": [
        # K-FAC's rows never written back
        Mutant(T_KFAC, "                self._write(layer, grads, V if scale is None else V * scale)\n            grads.write_back()",
               "                self._write(layer, grads, V if scale is None else V * scale)"),
        # K-FAC owner placement: the owners' KL-clip terms not summed over the ranks (each
        # rank clips with its own layers' sum); the statistics reduced to rank 0 whoever owns
        Mutant(T_KFAC, "            dist.all_reduce(owned, group=group)",
               "            pass"),
        Mutant(T_KFAC, "                groups.setdefault(dist.get_global_rank(group, rank), []).append(layer)",
               "                groups.setdefault(0, []).append(layer)"),
    ],
    "PORT-DCP": [
        Mutant(T_KFAC, "        if not owns(self._owners, layer.name):  # another rank keeps it (DCP: one copy)\n            return {}",
               "        if False:\n            return {}"),
        # LAMB's step no longer torch's
        Mutant("torch_impl/baselines/lamb.py", "    def step(self, closure=None):", "    def step(self, closure):"),
    ],
    "MOE-KFAC": [
        # the oracle: G_e without its n_e (the mean-reduced loss's factor)
        Mutant(R_KFAC, "    return [None if a.shape[0] == 0 else kfac_factors(a, g, has_bias=has_bias)",
               "    return [None if a.shape[0] == 0 else kfac_factors(a, g / a.shape[0] ** 0.5, "
               "has_bias=has_bias)"),
        # shared factors: every expert's rows summed into expert 0's statistic
        Mutant(T_KFAC_EQUATIONS, "        out.index_add_(0, owner[j:j + num_experts], block.mT @ block)",
               "        out.index_add_(0, torch.zeros_like(owner[j:j + num_experts]), block.mT @ block)"),
        # an expert routed nothing updated anyway (its factor EMA decays towards 0)
        Mutant(T_KFAC, "                present = rows > 0 if isinstance(rows, torch.Tensor) else None",
               "                present = rows >= 0 if isinstance(rows, torch.Tensor) else None"),
        # every expert's factor divided by the stack's row count
        Mutant(T_KFAC, "                    rows, samples = _per_matrix(rows), _per_matrix(samples)",
               "                    rows, samples = rows.sum(), samples.sum()"),
        # the per-expert counts lost on the wire
        Mutant(T_KFAC, "                    rows = sums[-1]\n", "                    rows = sums[-1].sum()\n"),
        # factors shared across experts: every expert's A is the stack's total
        Mutant(T_KFAC_EQUATIONS, "        return _expert_outer_sums(flat, experts, layer.experts), n\n",
               "        return _expert_outer_sums(flat, experts, layer.experts).sum(0).expand("
               "layer.experts, -1, -1).clone(), n\n"),
        # ... and every expert's G
        Mutant(T_KFAC_EQUATIONS, "        return _expert_outer_sums(flat, experts, layer.experts), samples",
               "        return _expert_outer_sums(flat, experts, layer.experts).sum(0).expand("
               "layer.experts, -1, -1).clone(), samples"),
        # a segment of the batched product runs across a change of expert: rows of one
        # expert counted in another's factor
        Mutant(T_KFAC_EQUATIONS, "    starts[1:] = (e[1:] != e[:-1]) | (i[1:] // c != i[:-1] // c)",
               "    starts[1:] = i[1:] // c != i[:-1] // c"),
        # an expert with no rows updated anyway: each expert counted with the stack's rows
        Mutant(T_KFAC_EQUATIONS, "    return torch.zeros(num_experts, dtype=torch.long, device=experts.device)"
               ".index_add_(\n        0, experts, ones)",
               "    return ones.sum().expand(num_experts).clone()"),
        # an expert's padded rows counted (its N and its factor's mean)
        Mutant(T_KFAC_EQUATIONS, "    ones = torch.ones_like(experts) if mask is None else mask.reshape(-1).long()",
               "    ones = torch.ones_like(experts)"),
        # an expert with no rows takes the (zero) batch factor into its EMA
        Mutant(T_KFAC, "                finite, overflow, ok = finite | ~present, overflow & present, "
               "ok & present",
               "                finite, overflow, ok = finite | ~present, overflow & present, ok"),
        # one expert's non-finite statistic refuses the whole stack's update
        Mutant(T_KFAC, "    return torch.isfinite(F).flatten(-2).all(dim=-1)",
               "    return torch.isfinite(F).all()"),
        # the stack retried as one: a failing expert moves the others through float64 and
        # extra damping too (retries counted for the stack)
        Mutant(T_KFAC_EQUATIONS, "    out, ok = _attempt(F, damping, method, 0, 0.0)\n    if ok:\n"
               "        return out, 0, []",
               "    out, tries = decompose(F, damping, method)\n    if out is not None:\n"
               "        return out, tries, []"),
        # a failing expert reset to the identity instead of keeping its previous result
        Mutant(T_KFAC, "        result, attempts, failed = decompose_stack(s[key], self.damping, "
               "self.method,\n                                                   s.get(entry))",
               "        result, attempts, failed = decompose_stack(s[key], self.damping, "
               "self.method,\n                                                   None)"),
        # failures counted once per stack, not per expert
        Mutant(T_KFAC, "            self.decomposition_failures += len(failed)",
               "            self.decomposition_failures += 1"),
        # the wrong batch axis: expert e's V divided by another expert's eigenvalues of A
        Mutant(T_KFAC_EQUATIONS, "               lam_G.unsqueeze(-1) * lam_A.unsqueeze(-2))",
               "               lam_G.unsqueeze(-1) * lam_A.flip(0).unsqueeze(-2))"),
        # the stack symmetrised across experts (e with E-1-e) before its eigh
        Mutant(T_KFAC_EQUATIONS, "    M = (F + F.mT) / 2 if attempt == 0 else (F + F.mT).double() / 2",
               "    M = (F + F.mT.flip(tuple(range(F.dim() - 2)))) / 2 if attempt == 0 else "
               "(F + F.mT).double() / 2"),
        # the KL clip's sum over layers averaged over a stack's experts
        Mutant(T_KFAC, "            term = torch.where(seen, V * G_hat, 0).sum().to(dev)  # the preconditioned only",
               "            term = torch.where(seen, V * G_hat, 0).sum((-2, -1)).mean().to(dev)"),
    ],
    "PORT-ACCELERATE-FSDP2": [
        Mutant(T_KFAC, "        if self._binding.moved():",
               "        if not self._binding.moved():"),
        # K-FAC's reduction routes not re-planned for the new owners
        Mutant(T_KFAC, "            self._routes = self._plan_routes()\n        if self.factor_update_due():",
               "            pass\n        if self.factor_update_due():"),
    ],
    "PORT-INIT-STATE": [
        # LAMB: the counter at 1, exp_avg_sq missing, frozen parameters given state, existing
        # state reset, only the first group
        Mutant(T_LAMB, _LAMB_LOOP, _LAMB_LOOP.replace("pass", '_[1]["step"].fill_(1.0)')),
        Mutant(T_LAMB, _LAMB_LOOP, _LAMB_LOOP.replace("pass", '_[1].pop("exp_avg_sq")')),
        Mutant(T_LAMB, _LAMB_FILTER,
               "                                         if not self.state.get(p)]):"),
        Mutant(T_LAMB, _LAMB_FILTER,
               "                                         if p.requires_grad and "
               "not self.state.pop(p, None)]):"),
        Mutant(T_LAMB, "        for group in self.param_groups:\n            for _ in self._create_state(",
               "        for group in self.param_groups[:1]:\n            for _ in self._create_state("),
    ],
    "PORT-TENSOR-HYPER": [
        Mutant(T_LAMB, "            steps = counters if compiling else [int(k.item()) for k in counters]",
               "            steps = [int(k.item()) for k in counters]"),
        Mutant(T_LAMB, "                     betas=tuple(step_scalar(b) for b in group[\"betas\"])))",
               "                     betas=group[\"betas\"]))"),
        # LAMB's state created outside torch's _init_group protocol: a graph for the first step
        Mutant(T_LAMB, "    def _init_group(self, group, params, grads, ms, vs, counters):",
               "    def _init_group_(self, group, params, grads, ms, vs, counters):",
               also=((T_LAMB, "            self._init_group(group, params, grads, ms, vs, counters)",
                      "            self._init_group_(group, params, grads, ms, vs, counters)"),)),
    ],
    "PORT-ATOMIC": [
        Mutant("torch_impl/baselines/lamb.py", "                if p.grad is not None and p.grad.is_sparse:", "                if False:"),
        # issue 45: each group's hyperparameters checked as it steps, so a refusal in the last
        # group comes after the earlier ones stepped
        Mutant("torch_impl/baselines/lamb.py",
               "        self._check_groups()  # every group's, before any group changes",
               "        pass  # every group's, before any group changes",
               also=(("torch_impl/baselines/lamb.py",
                      "            params, grads, ms, vs, counters = [], [], [], [], []",
                      "            _check_group(group)\n"
                      "            params, grads, ms, vs, counters = [], [], [], [], []"),)),
    ],
    "PORT-TORCH-FLAGS": [
        Mutant("torch_impl/baselines/lamb.py", "    check_torch_flags(\"LAMB\", group)", "    pass"),
        Mutant("torch_impl/baselines/lamb.py", "            _check_group({**self.defaults, **param_group})", "            pass"),
    ],
    "PRECOND-STATE-LAYOUT": [
        # K-FAC's init_state without the decompositions: a template made before step 0
        # does not ask a checkpoint for them
        Mutant(T_KFAC, "        self._decompose_all(missing_only=True)\n", "        pass\n"),
    ],
    "DISCOVERY-NAMES": [
        # K-FAC splits one skip_modules string into its letters before discovery sees it
        Mutant(T_KFAC, "found = discover(unwrap_model(model), skip_modules, optimizer, max_factor_dim)",
               "found = discover(unwrap_model(model), tuple(skip_modules), optimizer, max_factor_dim)"),
    ],
}
