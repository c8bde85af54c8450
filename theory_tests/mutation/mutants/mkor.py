"""Mutants of MKOR (``torch_impl/mkor/``) and its oracle (``reference/mkor/``), keyed by the
``paper_notes/claims.md`` row whose tests must kill them (``theory_tests/mutation/mutant.py``
says what a mutant is)."""
from ..mutant import Mutant

__all__ = ["MUTANTS"]

R_EXPERTS = "reference/mkor/experts.py"
R_FACTORS = "reference/mkor/factors.py"
R_HYBRID = "reference/mkor/hybrid.py"
R_PRECONDITIONER = "reference/mkor/preconditioner.py"
R_VECTORS = "reference/mkor/vectors.py"
T_KFAC = "torch_impl/baselines/kfac.py"
T_FACTORS = "torch_impl/mkor/factors.py"
T_HYBRID = "torch_impl/mkor/hybrid.py"
T_LAYER_STATE = "torch_impl/mkor/layer_state.py"
T_PRECONDITIONER = "torch_impl/mkor/preconditioner.py"
T_VECTOR_EXCHANGE = "torch_impl/mkor/vector_exchange.py"
T_VECTORS = "torch_impl/mkor/vectors.py"
R_RANK_K = "reference/mkor/rank_k.py"
T_RANK_K = "torch_impl/mkor/rank_k.py"

_HOMES = "theory_tests/project/test_hyperparameter_homes.py::"

MUTANTS = {
    "K1": [
        Mutant(R_PRECONDITIONER, "            if layer.get(\"sgd\", False):", "            if layer.get(\"sgd\", True):"),
    ],
    "K2": [
        # The hooks' gate refreshed before the step count advances: captures one step late.
        Mutant(T_PRECONDITIONER, "        self._steps += 1\n        self._step_scale = None\n        self._capture.refresh()",
               "        self._capture.refresh()\n        self._steps += 1\n        self._step_scale = None"),
        Mutant(R_PRECONDITIONER, "    return steps % inv_freq == 0 or steps < warmup_steps",
               "    return steps % inv_freq == 1 or steps < warmup_steps"),
        Mutant(T_PRECONDITIONER, "            self._steps % o.inv_freq == 0 or self._steps < o.warmup_steps)",
               "            self._steps % o.inv_freq == 0 or self._steps <= o.warmup_steps)"),
    ],
    "K3-K6": [
        Mutant(R_VECTORS, "    g_bar = (n * g_rows).mean(axis=0)", "    g_bar = g_rows.mean(axis=0)"),
        Mutant(R_VECTORS, "            top, left = i * dh, j * dw", "            top, left = j * dh, i * dw"),
        Mutant(T_VECTORS, "    return total / rows_per_sample, n / rows_per_sample",
               "    return total, n / rows_per_sample",
               tests=("theory_tests/kronecker/test_capture_hooks.py::test_conv_vectors_match_explicit_unfold",)),
    ],
    "K5": [
        Mutant(T_PRECONDITIONER, "g_sum.to(cd) / g_div / scale)", "g_sum.to(cd) / g_div)"),
        # Shared by MKOR and K-FAC: both forget the loss scale in their statistics.
        Mutant(T_PRECONDITIONER, "g_sum.to(cd) / g_div / scale)", "g_sum.to(cd) / g_div)",
               also=((T_KFAC, "s_sum * samples / scale / scale, present)", "s_sum * samples, present)"),)),
        Mutant(T_PRECONDITIONER, "out[layer.name] = (a_sum.to(cd), rows, ", "out[layer.name] = (a_sum.to(cd) / scale, rows, "),
    ],
    "K7": [
        Mutant(R_FACTORS, "    return J - np.outer(Jv, vJ) / (1 + v @ Jv)", "    return J - np.outer(Jv, vJ) / (1 - v @ Jv)"),
        Mutant(T_FACTORS, "    return J - torch.outer(Jv, vJ) / (1 + torch.dot(v, Jv))",
               "    return J + torch.outer(Jv, vJ) / (1 + torch.dot(v, Jv))"),
    ],
    "K8": [
        Mutant(R_FACTORS, '    denominator = stat_decay + (1 - stat_decay) * (v @ Jv)', '    denominator = 1 + (1 - stat_decay) * (v @ Jv)'),
        Mutant(T_FACTORS, '    denominator = stat_decay + (1 - stat_decay) * torch.dot(v, Jv)',
               '    denominator = stat_decay + stat_decay * torch.dot(v, Jv)'),
        Mutant(T_FACTORS, '        w = (1 - stat_decay) / (stat_decay * (stat_decay + (1 - stat_decay) * q))',
               '        w = (1 - stat_decay) / (stat_decay * (1 + (1 - stat_decay) * q))',
               tests=("theory_tests/mkor/test_differential.py::test_factor_update_matches_the_oracle_for_every_option",)),
    ],
    "K9": [
        Mutant(R_FACTORS, '    return rho * J + coefficient * np.outer(Jv, v @ J)',
               '    return rho * J - coefficient * np.outer(Jv, v @ J)'),
    ],
    "K10": [
        Mutant(R_FACTORS, "    blended = RELEASED_BLEND * J + (1 - RELEASED_BLEND) * np.eye(J.shape[0])",
               "    blended = RELEASED_BLEND * J + RELEASED_BLEND * np.eye(J.shape[0])"),
        Mutant(T_FACTORS, "    blended = RELEASED_BLEND * J + (1 - RELEASED_BLEND) * _eye_like(J)",
               "    blended = RELEASED_BLEND * J + 0.5 * _eye_like(J)"),
    ],
    "K11": [
        Mutant(R_FACTORS, "    return zeta * J + (1 - zeta) * np.eye(J.shape[0])", "    return zeta * J + zeta * np.eye(J.shape[0])"),
        Mutant(T_FACTORS, "    return zeta * J + (1 - zeta) * _eye_like(J)", "    return zeta * J"),
    ],
    "K12": [
        Mutant(R_FACTORS, "        return np.eye(J.shape[0]), False", "        return J.copy(), False"),
        Mutant(T_FACTORS, "            w = torch.where(flag, scalar(0.0), w)",
               "            w = torch.where(flag, scalar(1.0), w)",
               tests=("theory_tests/mkor/test_differential.py::test_factor_update_matches_the_oracle_for_every_option",)),
    ],
    "K13": [
        Mutant(R_FACTORS, "    delta = L_inv @ G_hat @ R_inv", "    delta = L_inv @ G_hat @ R_inv.T @ R_inv"),
        Mutant(T_FACTORS, "    x_b = torch.addmv(R_inv[d, d] * grad_b.reshape(-1), G, R_inv[:d, d])",
               "    x_b = torch.addmv(grad_b.reshape(-1), G, R_inv[:d, d])",
               tests=("theory_tests/mkor/test_torch_factors.py::test_precondition_splits_bias_and_round_trips_conv_layout",)),
    ],
    "K14": [
        Mutant(R_FACTORS, "    s = grad_norm / delta_norm", "    s = delta_norm / grad_norm"),
        Mutant(T_FACTORS, "            delta_norm = delta_norm + torch.linalg.vector_norm(delta_b).square()",
               "            delta_norm = delta_norm + torch.linalg.vector_norm(delta_b)"),
    ],
    "K2–K14": [
        Mutant(R_PRECONDITIONER, "            out.append(rescale(delta_W, delta_b, grad_W, grad_b, self.config.rescale))",
               "            out.append((delta_W, delta_b))"),
        Mutant(T_LAYER_STATE, "    delta_W, delta_b = rescale(delta_W, delta_b if counted_b else None, grad_W,",
               "    delta_W, delta_b = rescale(delta_W * 2, delta_b if counted_b else None, grad_W,"),
        Mutant(T_LAYER_STATE, "    ok_a, fired_a = update(\"R_inv\", R, a_bar, s[\"updates_a\"] == 0, flag_a)",
               "    ok_a, fired_a = update(\"R_inv\", R, a_bar * 1.5, s[\"updates_a\"] == 0, flag_a)"),
    ],
    "K16": [
        Mutant(T_FACTORS, '    return symmetrise((J - (1 - stat_decay) * torch.outer(Jv, vJ) / denominator) / stat_decay)',
               '    return symmetrise((J - (1 - stat_decay) * torch.outer(Jv, vJ) / denominator) / stat_decay ** 0.5)'),
        Mutant(R_FACTORS, '    denominator = stat_decay + (1 - stat_decay) * (v @ Jv)\n    return symmetrise((J - (1 - stat_decay) * np.outer(Jv, vJ) / denominator) / stat_decay)',
               '    denominator = stat_decay + (1 - stat_decay) * (v @ Jv)\n    return symmetrise((J - (1 - stat_decay) * np.outer(Jv, vJ) / denominator) / stat_decay ** 0.5)'),
    ],
    "K17": [
        Mutant(R_FACTORS, "    return symmetrise(sherman_morrison(blended, v))", "    return symmetrise(sherman_morrison(blended, 2 * v))"),
        # The blend's identity weight 1.5 x 0.05: the spectrum leaves [.., 1] (K17's bound).
        Mutant(T_FACTORS, "    blended = RELEASED_BLEND * J + (1 - RELEASED_BLEND) * _eye_like(J)",
               "    blended = RELEASED_BLEND * J + 1.5 * (1 - RELEASED_BLEND) * _eye_like(J)"),
    ],
    "K18": [
        Mutant(R_HYBRID, "self.slow_checks + 1 if not r_t >= self.threshold else 0",
               "self.slow_checks + 1 if not r_t > self.threshold else 0",
               equivalent="differs only when r_t equals the threshold exactly"),
        Mutant(T_HYBRID, "        return (older - newer) / (w * abs(older))", "        return (older - newer) / abs(older)"),
        Mutant(T_HYBRID, "        return (self.rule.t + len(self.buffer)) % self.rule.check_every == 0",
               "        return (self.rule.t + len(self.buffer)) % self.rule.check_every == 1",
               tests=("theory_tests/mkor/test_torch_hybrid.py::test_every_way_of_passing_the_loss_gives_the_same_switch",)),
    ],
    "L3.1": [
        Mutant(R_FACTORS, '    denominator = stat_decay + (1 - stat_decay) * (v @ Jv)', '    denominator = stat_decay - (1 - stat_decay) * (v @ Jv)'),
        # The same sign flip in the oracle and the port; and the released step's SM sign.
        Mutant(R_FACTORS, "    denominator = stat_decay + (1 - stat_decay) * (v @ Jv)", "    denominator = stat_decay - (1 - stat_decay) * (v @ Jv)",
               also=((T_FACTORS, "    denominator = stat_decay + (1 - stat_decay) * torch.dot(v, Jv)",
                      "    denominator = stat_decay - (1 - stat_decay) * torch.dot(v, Jv)"),)),
        Mutant(R_FACTORS, "    return J - np.outer(Jv, vJ) / (1 + v @ Jv)", "    return J - np.outer(Jv, vJ) / (1 - v @ Jv)"),
        Mutant(T_FACTORS, '    denominator = stat_decay + (1 - stat_decay) * torch.dot(v, Jv)',
               '    denominator = stat_decay - (1 - stat_decay) * torch.dot(v, Jv)',
               tests=("theory_tests/mkor/test_torch_factors.py::test_ema_inverse_update_is_the_inverse_of_the_factor_ema",)),
    ],
    "KT1": [
        Mutant(R_FACTORS, '    return symmetrise((J - (1 - stat_decay) * np.outer(Jv, vJ) / denominator) / stat_decay)',
               '    return symmetrise((J - np.outer(Jv, vJ) / denominator) / stat_decay)'),
        Mutant(T_FACTORS, '    return symmetrise((J - (1 - stat_decay) * torch.outer(Jv, vJ) / denominator) / stat_decay)',
               '    return symmetrise((J - (1 - stat_decay) * torch.outer(Jv, vJ) / denominator) / stat_decay ** 2)'),
    ],
    "KT2": [
        Mutant(R_FACTORS, "    return J - np.outer(Jv, vJ) / (1 + v @ Jv)", "    return J - np.outer(Jv, vJ) / (1 + 2 * (v @ Jv))"),
        Mutant(T_FACTORS, "    return J - torch.outer(Jv, vJ) / (1 + torch.dot(v, Jv))",
               "    return J - torch.outer(Jv, vJ) / (2 + torch.dot(v, Jv))",
               tests=("theory_tests/mkor/test_torch_factors.py::test_sherman_morrison_is_the_inverse_of_the_rank1_update",)),
    ],
    "KT3": [
        Mutant(R_FACTORS, "    return (J + J.T) / 2", "    return (J + J.T) / 2 - 1e-3 * np.eye(J.shape[0])"),
        Mutant(T_FACTORS, "    J_new = torch.mul(J, A, out=out).addr_(a, a, alpha=-1.0)",
               "    J_new = torch.mul(J, A, out=out).addr_(a, a, alpha=-2.0)",
               tests=("theory_tests/mkor/test_torch_factors.py::test_factor_update_before_sm_blends_then_updates",)),
    ],
    "KT4": [
        Mutant(R_FACTORS, "RELEASED_BLEND = 0.95\n", "RELEASED_BLEND = 0.9\n"),
        Mutant(T_FACTORS, "RELEASED_BLEND = 0.95\n", "RELEASED_BLEND = 0.99\n",
               tests=("theory_tests/mkor/test_torch_factors.py::test_released_update_is_sm_of_the_blended_inverse_and_stays_in_its_bounds",
                      "theory_tests/mkor/test_torch_factors.py::test_paper_variant_first_trigger_at_update_14")),
    ],
    "KT5": [
        Mutant(R_FACTORS, "    return zeta * J + (1 - zeta) * np.eye(J.shape[0])", "    return (1 - zeta) * J + zeta * np.eye(J.shape[0])"),
        Mutant(T_FACTORS, "    return zeta * J + (1 - zeta) * _eye_like(J)", "    return zeta * J + (1 - zeta) * 2 * _eye_like(J)"),
    ],
    "KT6": [
        Mutant(R_FACTORS, "    if grad_norm == 0.0 or not (0.0 < delta_norm < np.inf):",
               "    if not (0.0 < delta_norm < np.inf):",
               equivalent="a zero gradient gives s = 0 and s Delta = 0, the gradient itself"),
        Mutant(T_FACTORS, "    usable = (grad_norm != 0) & (delta_norm > 0) & torch.isfinite(delta_norm)",
               "    usable = (delta_norm > 0) & torch.isfinite(delta_norm)",
               equivalent="a zero gradient gives s = 0 and s Delta = 0, the gradient itself"),
        Mutant(R_FACTORS, "    if grad_norm == 0.0 or not (0.0 < delta_norm < np.inf):",
               "    if grad_norm == 0.0 or not (0.0 < delta_norm):",
               equivalent="an infinite Delta gives s = 0 and a NaN product, which the oracle's "
                          "finite-product check returns as the raw gradient"),
        Mutant(T_FACTORS, "    usable = (grad_norm != 0) & (delta_norm > 0) & torch.isfinite(delta_norm)",
               "    usable = (grad_norm != 0) & (delta_norm > 0)"),
    ],
    "KT7": [
        Mutant(R_PRECONDITIONER, "            if layer.get(\"sgd\", False):", "            if not layer.get(\"sgd\", False):"),
        Mutant(T_LAYER_STATE, "    L_inv, R_inv = s.get(\"L_inv\"), s.get(\"R_inv\")",
               "    L_inv, R_inv = s.get(\"L_inv\") * 2, s.get(\"R_inv\")",
               equivalent="a factor scaled by 2 doubles Delta, which the norm-preserving rescale undoes"),
    ],
    "KT8": [
        Mutant(R_VECTORS, "    a_bar = a_rows.mean(axis=0)", "    a_bar = a_rows.sum(axis=0)"),
        Mutant(T_VECTORS, "    return (_with_one(total, n) if has_bias else total), n\n\n\ndef linear_grad_sum",
               "    return (_with_one(total, n + 1) if has_bias else total), n\n\n\ndef linear_grad_sum"),
        Mutant(T_VECTORS, "            else n.reshape(1).to(total.dtype))", "            else n.reshape(1).to(total.dtype) + 1)",
               tests=("theory_tests/kronecker/test_semantics.py::test_masked_a_bar_is_the_mean_over_real_rows",)),
    ],
    "KT9": [
        Mutant(R_FACTORS, "    return delta[:, :-1].reshape(grad_W.shape), delta[:, -1].copy()",
               "    return delta[:, 1:].reshape(grad_W.shape), delta[:, 0].copy()"),
        Mutant(T_FACTORS, "    X = torch.mm(G, R_inv[:d, :d], out=X).addr_(grad_b.reshape(-1), R_inv[d, :d])",
               "    X = torch.mm(G, R_inv[:d, :d], out=X).addr_(grad_b.reshape(-1), R_inv[:d, d] * 0)"),
    ],
    "KT10": [
        Mutant(R_PRECONDITIONER, "    return steps % inv_freq == 0 or steps < warmup_steps",
               "    return steps % inv_freq == 0 and steps >= warmup_steps"),
        Mutant(T_PRECONDITIONER, "            self._steps % o.inv_freq == 0 or self._steps < o.warmup_steps)",
               "            self._steps % o.inv_freq == 0)",
               tests=("theory_tests/kronecker/test_capture_hooks.py::test_hooks_capture_only_in_train_mode_with_grad_and_on_schedule",)),
    ],
    "KT11": [
        Mutant(R_FACTORS, "    return symmetrise(sherman_morrison(blended, v))",
               "    return symmetrise(np.linalg.inv(np.linalg.inv(blended) + np.outer(v, v)))"),
        Mutant(T_FACTORS, "    u = _vec(alpha, J) * _mv(J, v) + _vec(beta, J) * v", "    u = _vec(alpha, J) * torch.linalg.solve(torch.linalg.inv(J), v) + _vec(beta, J) * v"),
    ],
    "KT13": [
        Mutant(T_LAYER_STATE, "    ok_g, fired_g = update(\"L_inv\", L, g_bar, s[\"updates_g\"] == 0, flag_g)",
               "    ok_g, fired_g = update(\"L_inv\", L, g_bar * 1.001, s[\"updates_g\"] == 0, flag_g)"),
        # Not equivalent: the scale is applied before the bias column is appended.
        Mutant(R_FACTORS, "    G_hat = grad_W.reshape(d_out, -1)\n", "    G_hat = grad_W.reshape(d_out, -1) * 1.001\n"),
    ],
    "KT14": [
        Mutant(T_PRECONDITIONER, "        self._state = {}\n        self._hybrid.mark_switched(self._steps)",
               "        self._hybrid.mark_switched(self._steps)"),
        Mutant(R_HYBRID, "        if self.switch_step is not None and t >= self.switch_step:",
               "        if self.switch_step is not None and t > self.switch_step:"),
    ],
    "P-MKOR-convergence": [
        Mutant(T_LAYER_STATE, "    ok_a, fired_a = update(\"R_inv\", R, a_bar, s[\"updates_a\"] == 0, flag_a)",
               "    ok_a, fired_a = update(\"R_inv\", R, a_bar * 0, s[\"updates_a\"] == 0, flag_a)"),
    ],
    "PORT-HYPERPARAMETERS": [
        # options by consumer: two fields of a record swapped, one replaced by a constant, the
        # record built from another option; and a second variant table beside config.COLUMNS
        Mutant("torch_impl/mkor/config.py",
               "        return PreconditionRule(self.rescale, self.precondition_dtype, self.compute_dtype)",
               "        return PreconditionRule(self.rescale, self.compute_dtype, self.precondition_dtype)",
               tests=(_HOMES + "test_each_consumer_reads_its_options_under_their_names",)),
        Mutant("torch_impl/mkor/config.py",
               "        return ExchangeOptions(self.average, self.comm_dtype, self.compute_dtype)",
               "        return ExchangeOptions(\"once\", self.comm_dtype, self.compute_dtype)",
               tests=(_HOMES + "test_each_consumer_reads_its_options_under_their_names",)),
        Mutant(T_PRECONDITIONER, "        self._factor_rule, self._precondition_rule = o.factor_rule, o.precondition_rule",
               "        self._factor_rule, self._precondition_rule = o.factor_rule, o.factor_rule",
               tests=(_HOMES + "test_each_consumer_reads_its_options_under_their_names",)),
        Mutant(T_FACTORS, "    column = COLUMNS.get(variant)\n",
               "    column = {\"paper\": dict(stabilizer_timing=\"before_sm\", stabilizer_reset=\"blend\", "
               "first_update=\"sm\"), \"released\": dict(stabilizer_timing=\"deferred\", "
               "stabilizer_reset=\"identity\", first_update=\"identity\")}.get(variant)\n",
               tests=(_HOMES + "test_one_variant_table",)),
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
    ],
    "PORT-COMM-OVERLAP": [
        # the backward never reported done: no early launch; commits not counted: a stale
        # launch taken for the current statistics; the capture not telling its listener
        Mutant(T_VECTOR_EXCHANGE, "        if self.outstanding == 0:\n            self.on_backward_done()",
               "        if False:\n            self.on_backward_done()"),
        Mutant(T_VECTOR_EXCHANGE, "        self.commits += 1\n", "        pass\n"),
    ],
    "PORT-PAIRING": [
        Mutant(T_VECTORS, "    return torch.where(mask.unsqueeze(-1), rows, 0).sum(dim=lead), mask.sum()",
               "    return rows.sum(dim=lead), mask.sum()"),
    ],
    "PORT-COPY": [
        Mutant("torch_impl/mkor/hybrid.py", "class _LossTap(CopyInertHook):", "class _LossTap:"),
    ],
    "PORT-ROWS": [
        # Row counts across ranks: the mean of the ranks' means instead of the union's mean.
        Mutant(T_VECTOR_EXCHANGE, "                a_bar = a_sum / rows.clamp(min=1)\n", "                a_bar = a_sum / world\n"),
        Mutant(T_VECTOR_EXCHANGE, "        divide = world * world if self.average == \"double\" else world",
               "        divide = world * world if self.average == \"double\" else 1"),
        Mutant(T_PRECONDITIONER, "                else:  # only calls with 0 rows (an MoE expert routed no tokens)\n"
               "                    out.append((layer, None, None, False))",
               "                else:  # only calls with 0 rows (an MoE expert routed no tokens)\n"
               "                    out.append((layer, a_sum / 1, g, None))"),
        Mutant(T_LAYER_STATE, "        s[\"no_rows\"] = s[\"no_rows\"] + 1", "        s[\"no_rows\"] = s[\"no_rows\"] + 0"),
    ],
    "PORT-FSDP2": [
        # MKOR's preconditioned matrix not copied into the gathered gradient
        Mutant(T_LAYER_STATE, "        if grads.sharded:\n            matrix.copy_(delta_W)",
               "        if grads.sharded:\n            pass"),
    ],
    "PORT-DCP": [
        # a rank keeping a (never updated) state of a layer another rank owns: DCP saves one
        # of the copies, perhaps the stale one
        Mutant(T_PRECONDITIONER, "        if not self._owns(layer.name):\n            return {}\n",
               "        if False:\n            return {}\n"),
        # MKOR-H switched: the freed factors leave no layout, and a fresh optimizer's DCP
        # template asks for entries the checkpoint lacks
        Mutant(T_PRECONDITIONER, "        layers = (self._released_state() if self.switched else",
               "        layers = ({} if self.switched else"),
        # MKOR-H's buffered losses kept per rank (a checkpoint would hold one rank's), or its
        # rule's state (slow checks, recent means) not restored
        Mutant(T_HYBRID, "        self.buffer.append(loss if self.mean is None else self.mean(loss))",
               "        self.buffer.append(loss)"),
        Mutant(T_HYBRID, "        if self.rule is not None and state.get(\"rule\") is not None:",
               "        if False:"),
    ],
    "MOE-MKOR": [
        Mutant(R_EXPERTS, "        if not present[e]:\n", "        if False:\n"),
        # shared factors: every expert's rows summed into one statistic, given to all
        Mutant(T_VECTORS, "    total = rows.new_zeros(num_experts, rows.shape[-1]).index_add_(0, experts, kept)",
               "    total = kept.sum(0).expand(num_experts, -1).clone()"),
        # an expert routed nothing updated anyway (with zero vectors)
        Mutant(T_PRECONDITIONER, "                    out.append((layer, _row_mean(a_sum, rows), g, rows > 0))",
                "                    out.append((layer, _row_mean(a_sum, rows), g, rows >= 0))"),
        # the stabiliser's test taken over the whole stack: one expert over the threshold
        # resets them all
        Mutant(T_FACTORS, "    low, high = torch.aminmax(J) if J.dim() == 2 else (J.amin(dim=(-2, -1)), J.amax(dim=(-2, -1)))",
               "    low, high = torch.aminmax(J)"),
        # the rescale of a stack with the stack's norms, not each expert's
        Mutant(T_FACTORS, "    s = grad_norm / torch.where(usable_e, delta_norm, torch.ones_like(delta_norm))",
               "    s = grad_norm.norm() / torch.where(usable_e, delta_norm, "
               "torch.ones_like(delta_norm)).norm()"),
        # a non-finite vector refused for the whole stack, not for its expert
        Mutant(T_LAYER_STATE, "        finite_v = torch.isfinite(v).all(dim=-1)  # per expert for a stack",
               "        finite_v = torch.isfinite(v).all()"),
        # the per-expert counts lost on the wire: every expert divided by the stack's total
        Mutant("torch_impl/mkor/vector_exchange.py", "                rows = sums[2]\n",
               "                rows = sums[2].sum()\n"),
    ],
    "PORT-ACCELERATE-FSDP2": [
        # the swap check inverted: the replaced parameters are never followed (MKOR)
        Mutant(T_PRECONDITIONER, "        if self._binding.moved():",
               "        if not self._binding.moved():"),
    ],
    "KC7": [
        # the wrong group mean: a sum, or divided by k instead of the group's rows
        Mutant(R_RANK_K, "        G.append((samples * g[members]).mean(axis=0))",
               "        G.append((samples * g[members]).sum(axis=0))"),
        Mutant(R_RANK_K, "        a_mean = a[members].mean(axis=0)",
               "        a_mean = a[members].sum(axis=0) / rank"),
        # a padded row counted in its group
        Mutant(R_RANK_K, "        members = (index == j) & real", "        members = index == j"),
        Mutant(T_RANK_K, "    safe = n.clamp(min=1).unsqueeze(-1)",
               "    safe = torch.full_like(n, n.shape[-1]).unsqueeze(-1)"),
        # R_g dropped: G the group mean of g, not of the per-sample gradients
        Mutant(T_RANK_K, "    total = n.sum(dim=-1, keepdim=True).unsqueeze(-1)  # sum_j n_j",
               "    total = 1"),
        # the cut: the long groups one row too short
        Mutant(T_RANK_K, "    long_rows = r * (q + 1)  # rows in the r long groups",
               "    long_rows = r * q"),
        # padded rows summed into their group
        Mutant(T_RANK_K, "    kept = flat if keep is None else torch.where(keep.unsqueeze(-1), flat, 0)",
               "    kept = flat"),
        # an expert's padded pairs given places in its cut
        Mutant(T_RANK_K, "        routed = experts if keep is None else torch.where(keep, experts, num_experts)",
               "        routed = experts"),
    ],
    "KC8": [
        # a Woodbury sign
        Mutant(R_RANK_K, "    return symmetrise((J - Y @ (solve or _solve)(C, Y.T)) / stat_decay)",
               "    return symmetrise((J + Y @ (solve or _solve)(C, Y.T)) / stat_decay)"),
        Mutant(T_RANK_K, "        J_new.addmm_(Z.transpose(-1, -2), Z, alpha=-1.0)",
               "        J_new.addmm_(Z.transpose(-1, -2), Z, alpha=1.0)"),
        Mutant(T_RANK_K, "    J_new = J_new.baddbmm_(Z.transpose(-1, -2), Z, alpha=-1.0) if J.dim() == 3 else \\",
               "    J_new = J_new.baddbmm_(Z.transpose(-1, -2), Z, alpha=1.0) if J.dim() == 3 else \\"),
        # the rank-k weight 1/k dropped (paper: w = 1 - rho; released: weight 1)
        Mutant(R_RANK_K, "    C = stat_decay * k / (1 - stat_decay) * np.eye(k, dtype=J.dtype) + V @ Y",
               "    C = stat_decay / (1 - stat_decay) * np.eye(k, dtype=J.dtype) + V @ Y"),
        Mutant(R_RANK_K, "    C = k * np.eye(k, dtype=J.dtype) + V @ Y", "    C = np.eye(k, dtype=J.dtype) + V @ Y"),
        Mutant(T_RANK_K, "    return k * (stat_decay / (1 - stat_decay)) if variant == \"paper\" else k",
               "    return (stat_decay / (1 - stat_decay)) if variant == \"paper\" else k"),
        Mutant(T_RANK_K, "    return k * (stat_decay / (1 - stat_decay)) if variant == \"paper\" else k",
               "    return k * (stat_decay / (1 - stat_decay)) if variant == \"paper\" else k ** 0"),
        # k' ignored: an empty group counted in the weight
        Mutant(T_RANK_K, "        return groups.to(V.dtype)", "        return V.new_full(V.shape[:-2], float(V.shape[-2]))"),
        # a failed Cholesky's garbage used instead of refused
        Mutant(T_RANK_K, "    return torch.where((info == 0)[..., None, None], Z, torch.nan)", "    return Z"),
        # a deferred reset still applies the Woodbury term (the control flow rank k shares
        # with rank 1: factors._Plan.coefficients)
        Mutant(T_FACTORS, "            w = torch.where(flag, scalar(0.0), w)", "            w = w"),
        # the stabiliser's blend skipped in the Woodbury step
        Mutant(T_RANK_K, "    J_hat_V = _per(alpha, J, 2) * (V @ J) + _per(beta, J, 2) * V  # (\\hat J U)^T",
               "    J_hat_V = V @ J"),
    ],
    "RANK-K-PORT": [
        # a Conv2d's G in rows, not samples (the division by L lost)
        Mutant(T_PRECONDITIONER, "    return (sums if per_sample == 1 else sums / per_sample), counts.sum(dim=-1)",
               "    return sums, counts.sum(dim=-1)"),
        # the group counts lost: every group's mean is its sum
        Mutant(T_PRECONDITIONER, "    stat = torch.cat([sums, counts.unsqueeze(-1).to(sums.dtype)], dim=-1)",
               "    stat = torch.cat([sums, torch.ones_like(counts).unsqueeze(-1).to(sums.dtype)], dim=-1)"),
        # DDP: G not divided by the ranks (the gradients are averaged by DDP)
        Mutant(T_VECTOR_EXCHANGE, "        A, G, present, groups = group_vectors(a_stat, g_sum, layer.has_bias, divide)",
               "        A, G, present, groups = group_vectors(a_stat, g_sum, layer.has_bias)"),
        # the rank-k layers packed as rank-1 ones (k x d read as d)
        Mutant(T_VECTOR_EXCHANGE, "            if self.rank > 1:  # KC7's group means of the union (pooled by group index)",
               "            if False:"),
        # k' not passed on: empty groups weigh in
        Mutant(T_LAYER_STATE, "            rank_k_factor_update, groups=groups)", "            rank_k_factor_update)"),
    ],
}
