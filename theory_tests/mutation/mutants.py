"""Curated mutants, one-line bugs in the math, keyed by the ``paper_notes/claims.md`` row
whose tests must kill them (``theory_tests/mutation/harness.py`` runs them).

A ``Mutant`` (``mutant.py``) is an exact text replacement; ``tests`` (optional) replaces the
row's test column; ``equivalent`` (optional) says why a mutant cannot change behaviour, and
such a mutant is expected to survive. Each row that names code has at least one mutant of it, in
the oracle and in the port where each exists.
"""
from .mutant import Mutant
from .mutants_mars import MARS_MUTANTS
from .mutants_mars_properties import MARS_PROPERTY_MUTANTS
from .mutants_issue30 import ISSUE30_MUTANTS
from .mutants_newcomer import NEWCOMER_MUTANTS
from .mutants_low_precision import LOW_PRECISION_MUTANTS
from .mutants_figures_repro import FIGURES_REPRO_MUTANTS
from .mutants_experts import EXPERTS_MUTANTS
from .mutants_kfac_experts import KFAC_EXPERTS_MUTANTS
from .mutants_matrix_batch import MATRIX_BATCH_MUTANTS
from .mutants_orthogonalisers import ORTHOGONALISER_MUTANTS
from .mutants_hf import HF_MUTANTS
from .mutants_peers import PEER_MUTANTS
from .mutants_init_state import INIT_STATE_MUTANTS
from .mutants_torchtitan import TORCHTITAN_MUTANTS
from .mutants_grouped_experts import GROUPED_EXPERTS_MUTANTS
from .mutants_torchtitan_scale import TORCHTITAN_SCALE_MUTANTS

__all__ = ["Mutant", "MUTANTS"]


R_F, T_F = "reference/mkor/factors.py", "torch_impl/mkor/factors.py"
R_M, R_V = "reference/mkor/preconditioner.py", "reference/mkor/vectors.py"
T_V, T_C = "torch_impl/mkor/vectors.py", "torch_impl/kronecker/capture/capture.py"
T_L, T_P = "torch_impl/mkor/layer_state.py", "torch_impl/mkor/preconditioner.py"
T_D, T_K = "torch_impl/kronecker/discovery.py", "torch_impl/baselines/kfac.py"
R_K, R_H, T_H = "reference/baselines/kfac.py", "reference/mkor/hybrid.py", "torch_impl/mkor/hybrid.py"
T_LAYERS, T_W = "torch_impl/kronecker/layers.py", "torch_impl/kronecker/optimizer.py"
T_DIST = "torch_impl/kronecker/exchange.py"
T_TM = "torch_impl/kronecker/capture/token_masks.py"
T_RP = "torch_impl/kronecker/capture/row_provenance.py"
T_SC = "torch_impl/kronecker/capture/self_check.py"
T_EC = "torch_impl/kronecker/capture/eager.py"
T_HO = "torch_impl/kronecker/capture/hooks.py"
T_FSDP = "torch_impl/kronecker/placement.py"
T_SHARD = "torch_impl/common/sharding.py"
T_ST = "torch_impl/kronecker/capture/statistics.py"
T_CALLS = "torch_impl/kronecker/capture/calls.py"
T_VX = "torch_impl/mkor/vector_exchange.py"
_HOMES = "theory_tests/project/test_hyperparameter_homes.py::"
_REFUSALS = '    def __reduce_ex__(self, protocol, /):\n        self._refuse_copy()\n\n    def __reduce__(self, /):\n        self._refuse_copy()\n\n    def __getstate__(self):\n        self._refuse_copy()\n\n    __copy__ = __deepcopy__ = _refuse_copy'
T_KC = "torch_impl/baselines/kfac_conventions.py"
T_KE = "torch_impl/baselines/kfac_equations.py"
R_FO, T_LAMB = "reference/common/first_order.py", "torch_impl/baselines/lamb.py"
# The power-of-two rounding of a loss scale (exact for 2^k, wrong for any other scale).
_POW2 = "2.0 ** round(__import__(\"math\").log2(scale))"

MUTANTS = {
    "K1": [
        Mutant(R_M, "            if layer.get(\"sgd\", False):", "            if layer.get(\"sgd\", True):"),
        Mutant(T_D, "if reason is None and len(owners.get(id(weight), ())) > 1:",
               "if reason is None and len(owners.get(id(weight), ())) > 2:"),
        Mutant(T_LAYERS, "        return isinstance(module, nn.Linear)\n",
               "        return type(module) is nn.Linear\n"),
    ],
    "K2": [
        # The hooks' gate refreshed before the step count advances: captures one step late.
        Mutant(T_P, "        self._steps += 1\n        self._step_scale = None\n        self._capture.refresh()",
               "        self._capture.refresh()\n        self._steps += 1\n        self._step_scale = None"),
        Mutant(R_M, "    return steps % inv_freq == 0 or steps < warmup_steps",
               "    return steps % inv_freq == 1 or steps < warmup_steps"),
        Mutant(T_P, "            self._steps % o.inv_freq == 0 or self._steps < o.warmup_steps)",
               "            self._steps % o.inv_freq == 0 or self._steps <= o.warmup_steps)"),
    ],
    "K3-K6": [
        Mutant(R_V, "    g_bar = (n * g_rows).mean(axis=0)", "    g_bar = g_rows.mean(axis=0)"),
        Mutant(R_V, "            top, left = i * dh, j * dw", "            top, left = j * dh, i * dw"),
        Mutant(T_V, "    return total / rows_per_sample, n / rows_per_sample",
               "    return total, n / rows_per_sample",
               tests=("theory_tests/kronecker/test_capture_hooks.py::test_conv_vectors_match_explicit_unfold",)),
        Mutant(T_LAYERS, "        return patches.transpose(1, 2)", "        return patches.flip(1).transpose(1, 2)",
               tests=("theory_tests/kronecker/test_capture_hooks.py::test_conv_vectors_match_explicit_unfold",)),
    ],
    "K5": [
        Mutant(T_P, "g_sum.to(cd) / g_div / scale)", "g_sum.to(cd) / g_div)"),
        Mutant(T_W, "            self._step_scale = scale\n", "            self._step_scale = 1.0\n",
               tests=("theory_tests/kronecker/test_grad_scaler.py::test_grad_scaler_matches_unscaled_loop_bitwise",)),
        # Shared by MKOR and K-FAC: both forget the loss scale in their statistics.
        Mutant(T_P, "g_sum.to(cd) / g_div / scale)", "g_sum.to(cd) / g_div)",
               also=((T_K, "s_sum * samples / scale / scale, present)", "s_sum * samples, present)"),)),
        # Shared by MKOR and K-FAC (the wrapper): a scale rounded to a power of two, exact for
        # 2^k, so only a test with another scale (1000, 3.7) can see it.
        Mutant(T_W, "        self._grad_scale = scale\n", f"        self._grad_scale = {_POW2}\n",
               also=((T_W, "            self._step_scale = scale\n",
                      f"            self._step_scale = {_POW2}\n"),)),
        Mutant(T_P, "out[layer.name] = (a_sum.to(cd), rows, ", "out[layer.name] = (a_sum.to(cd) / scale, rows, "),
        Mutant(T_K, "s_sum * samples / scale / scale, present)", "s_sum * samples / scale, present)"),
        # The factor N / s^2 rounded to float32 (computed from GradScaler's float32 scale
        # alone, as the port once did): off by ~7e-8 unless s is a power of two.
        Mutant(T_K, "s_sum * samples / scale / scale, present)", "s_sum * (samples / scale / scale), present)"),
    ],
    "K7": [
        Mutant(R_F, "    return J - np.outer(Jv, vJ) / (1 + v @ Jv)", "    return J - np.outer(Jv, vJ) / (1 - v @ Jv)"),
        Mutant(T_F, "    return J - torch.outer(Jv, vJ) / (1 + torch.dot(v, Jv))",
               "    return J + torch.outer(Jv, vJ) / (1 + torch.dot(v, Jv))"),
    ],
    "K8": [
        Mutant(R_F, '    denominator = stat_decay + (1 - stat_decay) * (v @ Jv)', '    denominator = 1 + (1 - stat_decay) * (v @ Jv)'),
        Mutant(T_F, '    denominator = stat_decay + (1 - stat_decay) * torch.dot(v, Jv)',
               '    denominator = stat_decay + stat_decay * torch.dot(v, Jv)'),
        Mutant(T_F, '        w = (1 - stat_decay) / (stat_decay * (stat_decay + (1 - stat_decay) * q))',
               '        w = (1 - stat_decay) / (stat_decay * (1 + (1 - stat_decay) * q))',
               tests=("theory_tests/mkor/test_differential.py::test_factor_update_matches_the_oracle_for_every_option",)),
    ],
    "K9": [
        Mutant(R_F, '    return rho * J + coefficient * np.outer(Jv, v @ J)',
               '    return rho * J - coefficient * np.outer(Jv, v @ J)'),
    ],
    "K10": [
        Mutant(R_F, "    blended = RELEASED_BLEND * J + (1 - RELEASED_BLEND) * np.eye(J.shape[0])",
               "    blended = RELEASED_BLEND * J + RELEASED_BLEND * np.eye(J.shape[0])"),
        Mutant(T_F, "    blended = RELEASED_BLEND * J + (1 - RELEASED_BLEND) * _eye_like(J)",
               "    blended = RELEASED_BLEND * J + 0.5 * _eye_like(J)"),
    ],
    "K11": [
        Mutant(R_F, "    return zeta * J + (1 - zeta) * np.eye(J.shape[0])", "    return zeta * J + zeta * np.eye(J.shape[0])"),
        Mutant(T_F, "    return zeta * J + (1 - zeta) * _eye_like(J)", "    return zeta * J"),
    ],
    "K12": [
        Mutant(R_F, "        return np.eye(J.shape[0]), False", "        return J.copy(), False"),
        Mutant(T_F, "        w = torch.where(flag, scalar(0.0), w)", "        w = torch.where(flag, scalar(1.0), w)",
               tests=("theory_tests/mkor/test_differential.py::test_factor_update_matches_the_oracle_for_every_option",)),
    ],
    "K13": [
        Mutant(R_F, "    delta = L_inv @ G_hat @ R_inv", "    delta = L_inv @ G_hat @ R_inv.T @ R_inv"),
        Mutant(T_F, "    x_b = torch.addmv(R_inv[d, d] * grad_b.reshape(-1), G, R_inv[:d, d])",
               "    x_b = torch.addmv(grad_b.reshape(-1), G, R_inv[:d, d])",
               tests=("theory_tests/mkor/test_torch_factors.py::test_precondition_splits_bias_and_round_trips_conv_layout",)),
    ],
    "K14": [
        Mutant(R_F, "    s = grad_norm / delta_norm", "    s = delta_norm / grad_norm"),
        Mutant(T_F, "            delta_norm = delta_norm + torch.linalg.vector_norm(delta_b).square()",
               "            delta_norm = delta_norm + torch.linalg.vector_norm(delta_b)"),
    ],
    "K15": [
        Mutant(T_W, "        self.precondition()\n        self.optimizer.step()\n",
               "        self.precondition()\n"),
        # LAMB's bias corrections, the same bug in the oracle and the port (a differential
        # test cannot see it; the closed forms and the Adam-built LAMB can, with weight decay).
        Mutant(R_FO, "    r = (m / (1 - b1**k)) / (np.sqrt(v / (1 - b2**k)) + eps)",
               "    r = (m / (1 - b1**(k + 1))) / (np.sqrt(v / (1 - b2**k)) + eps)",
               also=((T_LAMB, "r = (m / (1 - beta1 ** k)) / ((v / (1 - beta2 ** k)).sqrt()",
                      "r = (m / (1 - beta1 ** (k + 1))) / ((v / (1 - beta2 ** k)).sqrt()"),)),
        Mutant(R_FO, "    r = (m / (1 - b1**k)) / (np.sqrt(v / (1 - b2**k)) + eps)",
               "    r = m / (np.sqrt(v / (1 - b2**k)) + eps)",
               also=((T_LAMB, "r = (m / (1 - beta1 ** k)) / ((v / (1 - beta2 ** k)).sqrt()",
                      "r = m / ((v / (1 - beta2 ** k)).sqrt()"),)),
        Mutant(R_FO, "    r = (m / (1 - b1**k)) / (np.sqrt(v / (1 - b2**k)) + eps)",
               "    r = (m / (1 - b1**k)) / (np.sqrt(v) + eps)",
               also=((T_LAMB, "r = (m / (1 - beta1 ** k)) / ((v / (1 - beta2 ** k)).sqrt()",
                      "r = (m / (1 - beta1 ** k)) / (v.sqrt()"),)),
        Mutant(R_FO, "    r = (m / (1 - b1**k)) / (np.sqrt(v / (1 - b2**k)) + eps)",
               "    r = (m / (1 - b1**k)) / np.sqrt(v / (1 - b2**k) + eps)",
               also=((T_LAMB, "((v / (1 - beta2 ** k)).sqrt() + group[\"eps\"])",
                      "((v / (1 - beta2 ** k) + group[\"eps\"]).sqrt())"),)),
    ],
    "K2–K14": [
        Mutant(R_M, "            out.append(rescale(delta_W, delta_b, grad_W, grad_b, self.config.rescale))",
               "            out.append((delta_W, delta_b))"),
        Mutant(T_L, "    delta_W, delta_b = rescale(delta_W, delta_b if counted_b else None, grad_W,",
               "    delta_W, delta_b = rescale(delta_W * 2, delta_b if counted_b else None, grad_W,"),
        Mutant(T_L, "    ok_a, fired_a = update(\"R_inv\", R, a_bar, s[\"updates_a\"] == 0, flag_a)",
               "    ok_a, fired_a = update(\"R_inv\", R, a_bar * 1.5, s[\"updates_a\"] == 0, flag_a)"),
    ],
    "K16": [
        Mutant(T_F, '    return symmetrise((J - (1 - stat_decay) * torch.outer(Jv, vJ) / denominator) / stat_decay)',
               '    return symmetrise((J - (1 - stat_decay) * torch.outer(Jv, vJ) / denominator) / stat_decay ** 0.5)'),
        Mutant(R_F, '    denominator = stat_decay + (1 - stat_decay) * (v @ Jv)\n    return symmetrise((J - (1 - stat_decay) * np.outer(Jv, vJ) / denominator) / stat_decay)',
               '    denominator = stat_decay + (1 - stat_decay) * (v @ Jv)\n    return symmetrise((J - (1 - stat_decay) * np.outer(Jv, vJ) / denominator) / stat_decay ** 0.5)'),
    ],
    "K17": [
        Mutant(R_F, "    return symmetrise(sherman_morrison(blended, v))", "    return symmetrise(sherman_morrison(blended, 2 * v))"),
        # The blend's identity weight 1.5 x 0.05: the spectrum leaves [.., 1] (K17's bound).
        Mutant(T_F, "    blended = RELEASED_BLEND * J + (1 - RELEASED_BLEND) * _eye_like(J)",
               "    blended = RELEASED_BLEND * J + 1.5 * (1 - RELEASED_BLEND) * _eye_like(J)"),
    ],
    "K18": [
        Mutant(R_H, "self.slow_checks + 1 if not r_t >= self.threshold else 0",
               "self.slow_checks + 1 if not r_t > self.threshold else 0",
               equivalent="differs only when r_t equals the threshold exactly"),
        Mutant(T_H, "        return (older - newer) / (w * abs(older))", "        return (older - newer) / abs(older)"),
        Mutant(T_H, "        return (self.rule.t + len(self.buffer)) % self.rule.check_every == 0",
               "        return (self.rule.t + len(self.buffer)) % self.rule.check_every == 1",
               tests=("theory_tests/mkor/test_torch_hybrid.py::test_every_way_of_passing_the_loss_gives_the_same_switch",)),
    ],
    "K19": [
        # Conv2d's A averaged over samples instead of rows (L = 4 times too large): the MLP
        # differential test has no Conv2d; the per-sample definition has.
        Mutant(T_KE, "    return flat.T @ flat, n\n",
               "    return flat.T @ flat, n / layer.type.rows_per_sample(rows.shape[:-1])\n"),
        Mutant(T_KE, "    samples = n / layer.type.rows_per_sample(rows.shape[:-1])", "    samples = n"),
        # Shared by the oracle and the port: a Conv2d's G scaled by its B L rows instead of
        # its B samples (the issue's survivor, before the oracle had a Conv2d path).
        Mutant(R_K, "    samples = rows / rows_per_sample\n", "    samples = rows\n",
               also=((T_KE, "    samples = n / layer.type.rows_per_sample(rows.shape[:-1])",
                      "    samples = n"),)),
        Mutant(R_K, "    return QG @ ((QG.T @ G_hat @ QA) / (np.outer(lamG, lamA) + damping)) @ QA.T",
               "    return QG @ ((QG.T @ G_hat @ QA) / (np.outer(lamG, lamA) + 2 * damping)) @ QA.T"),
        Mutant(T_KE, "        X = X / (lam + damping)", "        X = X / (lam + 2 * damping)"),
        Mutant(T_K, "        return nu.clamp(max=1.0)", "        return nu.clamp(max=2.0)"),
    ],
    "L3.1": [
        Mutant(R_F, '    denominator = stat_decay + (1 - stat_decay) * (v @ Jv)', '    denominator = stat_decay - (1 - stat_decay) * (v @ Jv)'),
        # The same sign flip in the oracle and the port; and the released step's SM sign.
        Mutant(R_F, "    denominator = stat_decay + (1 - stat_decay) * (v @ Jv)", "    denominator = stat_decay - (1 - stat_decay) * (v @ Jv)",
               also=((T_F, "    denominator = stat_decay + (1 - stat_decay) * torch.dot(v, Jv)",
                      "    denominator = stat_decay - (1 - stat_decay) * torch.dot(v, Jv)"),)),
        Mutant(R_F, "    return J - np.outer(Jv, vJ) / (1 + v @ Jv)", "    return J - np.outer(Jv, vJ) / (1 - v @ Jv)"),
        Mutant(T_F, '    denominator = stat_decay + (1 - stat_decay) * torch.dot(v, Jv)',
               '    denominator = stat_decay - (1 - stat_decay) * torch.dot(v, Jv)',
               tests=("theory_tests/mkor/test_torch_factors.py::test_ema_inverse_update_is_the_inverse_of_the_factor_ema",)),
    ],
    "KT1": [
        Mutant(R_F, '    return symmetrise((J - (1 - stat_decay) * np.outer(Jv, vJ) / denominator) / stat_decay)',
               '    return symmetrise((J - np.outer(Jv, vJ) / denominator) / stat_decay)'),
        Mutant(T_F, '    return symmetrise((J - (1 - stat_decay) * torch.outer(Jv, vJ) / denominator) / stat_decay)',
               '    return symmetrise((J - (1 - stat_decay) * torch.outer(Jv, vJ) / denominator) / stat_decay ** 2)'),
    ],
    "KT2": [
        Mutant(R_F, "    return J - np.outer(Jv, vJ) / (1 + v @ Jv)", "    return J - np.outer(Jv, vJ) / (1 + 2 * (v @ Jv))"),
        Mutant(T_F, "    return J - torch.outer(Jv, vJ) / (1 + torch.dot(v, Jv))",
               "    return J - torch.outer(Jv, vJ) / (2 + torch.dot(v, Jv))",
               tests=("theory_tests/mkor/test_torch_factors.py::test_sherman_morrison_is_the_inverse_of_the_rank1_update",)),
    ],
    "KT3": [
        Mutant(R_F, "    return (J + J.T) / 2", "    return (J + J.T) / 2 - 1e-3 * np.eye(J.shape[0])"),
        Mutant(T_F, "    J_new = torch.mul(J, A, out=out).addr_(a, a, alpha=-1.0)",
               "    J_new = torch.mul(J, A, out=out).addr_(a, a, alpha=-2.0)",
               tests=("theory_tests/mkor/test_torch_factors.py::test_factor_update_before_sm_blends_then_updates",)),
    ],
    "KT4": [
        Mutant(R_F, "RELEASED_BLEND = 0.95\n", "RELEASED_BLEND = 0.9\n"),
        Mutant(T_F, "RELEASED_BLEND = 0.95\n", "RELEASED_BLEND = 0.99\n",
               tests=("theory_tests/mkor/test_torch_factors.py::test_released_update_is_sm_of_the_blended_inverse_and_stays_in_its_bounds",
                      "theory_tests/mkor/test_torch_factors.py::test_paper_variant_first_trigger_at_update_14")),
    ],
    "KT5": [
        Mutant(R_F, "    return zeta * J + (1 - zeta) * np.eye(J.shape[0])", "    return (1 - zeta) * J + zeta * np.eye(J.shape[0])"),
        Mutant(T_F, "    return zeta * J + (1 - zeta) * _eye_like(J)", "    return zeta * J + (1 - zeta) * 2 * _eye_like(J)"),
    ],
    "KT6": [
        Mutant(R_F, "    if grad_norm == 0.0 or not (0.0 < delta_norm < np.inf):",
               "    if not (0.0 < delta_norm < np.inf):",
               equivalent="a zero gradient gives s = 0 and s Delta = 0, the gradient itself"),
        Mutant(T_F, "    usable = (grad_norm != 0) & (delta_norm > 0) & torch.isfinite(delta_norm)",
               "    usable = (delta_norm > 0) & torch.isfinite(delta_norm)",
               equivalent="a zero gradient gives s = 0 and s Delta = 0, the gradient itself"),
        Mutant(R_F, "    if grad_norm == 0.0 or not (0.0 < delta_norm < np.inf):",
               "    if grad_norm == 0.0 or not (0.0 < delta_norm):",
               equivalent="an infinite Delta gives s = 0 and a NaN product, which the oracle's "
                          "finite-product check returns as the raw gradient"),
        Mutant(T_F, "    usable = (grad_norm != 0) & (delta_norm > 0) & torch.isfinite(delta_norm)",
               "    usable = (grad_norm != 0) & (delta_norm > 0)"),
    ],
    "KT7": [
        Mutant(R_M, "            if layer.get(\"sgd\", False):", "            if not layer.get(\"sgd\", False):"),
        Mutant(T_L, "    L_inv, R_inv = s.get(\"L_inv\"), s.get(\"R_inv\")",
               "    L_inv, R_inv = s.get(\"L_inv\") * 2, s.get(\"R_inv\")",
               equivalent="a factor scaled by 2 doubles Delta, which the norm-preserving rescale undoes"),
    ],
    "KT8": [
        Mutant(R_V, "    a_bar = a_rows.mean(axis=0)", "    a_bar = a_rows.sum(axis=0)"),
        Mutant(T_V, "    return (_with_one(total, n) if has_bias else total), n\n\n\ndef linear_grad_sum",
               "    return (_with_one(total, n + 1) if has_bias else total), n\n\n\ndef linear_grad_sum"),
        Mutant(T_V, "            else n.reshape(1).to(total.dtype))", "            else n.reshape(1).to(total.dtype) + 1)",
               tests=("theory_tests/kronecker/test_semantics.py::test_masked_a_bar_is_the_mean_over_real_rows",)),
    ],
    "KT9": [
        Mutant(R_F, "    return delta[:, :-1].reshape(grad_W.shape), delta[:, -1].copy()",
               "    return delta[:, 1:].reshape(grad_W.shape), delta[:, 0].copy()"),
        Mutant(T_F, "    X = torch.mm(G, R_inv[:d, :d], out=X).addr_(grad_b.reshape(-1), R_inv[d, :d])",
               "    X = torch.mm(G, R_inv[:d, :d], out=X).addr_(grad_b.reshape(-1), R_inv[:d, d] * 0)"),
    ],
    "KT10": [
        Mutant(R_M, "    return steps % inv_freq == 0 or steps < warmup_steps",
               "    return steps % inv_freq == 0 and steps >= warmup_steps"),
        Mutant(T_P, "            self._steps % o.inv_freq == 0 or self._steps < o.warmup_steps)",
               "            self._steps % o.inv_freq == 0)",
               tests=("theory_tests/kronecker/test_capture_hooks.py::test_hooks_capture_only_in_train_mode_with_grad_and_on_schedule",)),
    ],
    "KT11": [
        Mutant(R_F, "    return symmetrise(sherman_morrison(blended, v))",
               "    return symmetrise(np.linalg.inv(np.linalg.inv(blended) + np.outer(v, v)))"),
        Mutant(T_F, "    u = _vec(alpha, J) * _mv(J, v) + _vec(beta, J) * v", "    u = _vec(alpha, J) * torch.linalg.solve(torch.linalg.inv(J), v) + _vec(beta, J) * v"),
    ],
    "KT12": [
        Mutant(T_DIST, "            mean = buffer[start:start + sum(sizes)].to(out_dtype) / count.clamp(min=1)",
               "            mean = buffer[start:start + sum(sizes)].to(out_dtype)"),
        Mutant(T_DIST, "        return self.numel * torch.empty((), dtype=self.dtype).element_size()",
               "        return self.numel * 4"),
        # The summed row count read from the wrong slot: the union's mean divides by 1.
        Mutant(T_DIST, "                        buffer[at].to(out_dtype)))", "                        buffer[at].to(out_dtype) * 0 + 1))"),
    ],
    "KT13": [
        Mutant(T_L, "    ok_g, fired_g = update(\"L_inv\", L, g_bar, s[\"updates_g\"] == 0, flag_g)",
               "    ok_g, fired_g = update(\"L_inv\", L, g_bar * 1.001, s[\"updates_g\"] == 0, flag_g)"),
        # Not equivalent: the scale is applied before the bias column is appended.
        Mutant(R_F, "    G_hat = grad_W.reshape(d_out, -1)\n", "    G_hat = grad_W.reshape(d_out, -1) * 1.001\n"),
    ],
    "KT14": [
        Mutant(T_P, "        self._state = {}\n        self._hybrid.mark_switched(self._steps)",
               "        self._hybrid.mark_switched(self._steps)"),
        Mutant(R_H, "        if self.switch_step is not None and t >= self.switch_step:",
               "        if self.switch_step is not None and t > self.switch_step:"),
    ],
    "P-MKOR-convergence": [
        Mutant(T_L, "    ok_a, fired_a = update(\"R_inv\", R, a_bar, s[\"updates_a\"] == 0, flag_a)",
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
        Mutant(T_P, "        self._factor_rule, self._precondition_rule = o.factor_rule, o.precondition_rule",
               "        self._factor_rule, self._precondition_rule = o.factor_rule, o.factor_rule",
               tests=(_HOMES + "test_each_consumer_reads_its_options_under_their_names",)),
        Mutant(T_F, "    column = COLUMNS.get(variant)\n",
               "    column = {\"paper\": dict(stabilizer_timing=\"before_sm\", stabilizer_reset=\"blend\", "
               "first_update=\"sm\"), \"released\": dict(stabilizer_timing=\"deferred\", "
               "stabilizer_reset=\"identity\", first_update=\"identity\")}.get(variant)\n",
               tests=(_HOMES + "test_one_variant_table",)),
    ],
    "PORT-COMM-OVERLAP": [
        # the backward never reported done: no early launch; commits not counted: a stale
        # launch taken for the current statistics; the capture not telling its listener
        Mutant(T_VX, "        if self.outstanding == 0:\n            self.on_backward_done()",
               "        if False:\n            self.on_backward_done()"),
        Mutant(T_VX, "        self.commits += 1\n", "        pass\n"),
        Mutant(T_C, "            self.listener.captured(layer)", "            pass"),
    ],
    "PORT-LAYERS": [
        Mutant(T_LAYERS, "        return weight_like.T\n", "        return weight_like.T.flip(0)\n",
               tests=("theory_tests/kronecker/test_hf_models.py::test_conv1d_preconditioned_gradient_is_the_formula",)),
        Mutant(T_D, "self.has_bias = module.bias is not None and module.bias.requires_grad",
               "self.has_bias = module.bias is not None"),
    ],
    "PORT-PAIRING": [
        # Shared-call pairing: the old rule (statistics dropped whenever .grad is None) moved
        # to commit time drops every earlier call of a module used several times per forward.
        Mutant(T_ST, "        if st.settled and layer.module.weight.grad is None:\n            # the gradient",
               "        if layer.module.weight.grad is None:\n            # the gradient"),
        Mutant(T_ST, "        if st.settled and layer.module.weight.grad is None:\n            # the gradient",
               "        if False:\n            # the gradient"),
        Mutant(T_ST, "        if st.settled and self._by_name[name].module.weight.grad is None:",
               "        if False:"),
        Mutant(T_V, "    return torch.where(mask.unsqueeze(-1), rows, 0).sum(dim=lead), mask.sum()",
               "    return rows.sum(dim=lead), mask.sum()"),
        Mutant(T_C, "                    self.commit(layer, a_stat, mask, grad_rows(grad), sketch)",
               "                    self.commit(layer, a_stat, None, grad_rows(grad), sketch)",
               equivalent="a masked row's output gradient is exactly 0 when the loss ignores it"),
    ],
    "PORT-CHECKPOINT": [
        # Recompute mask: a reentrant recompute reads the (finished) call's context, no mask.
        Mutant(T_CALLS, "            return self._regions.get(torch._C._current_autograd_node(), _UNKNOWN)",
               "            return self._call"),
        Mutant(T_CALLS, "            self._call.regions = True  # a grad-free", "            self._call.regions = False  # a grad-free"),
        Mutant(T_CALLS, "                ctx.nested = True", "                ctx.nested = False"),
        Mutant(T_CALLS, "        if self._explicit is not None:\n            tag_explicit(",
               "        if False:\n            tag_explicit("),
    ],
    "PORT-COMPILE": [
        # A compiled capture step traced through the model: graph breaks at every layer hook.
        Mutant(T_EC, "            if torch.compiler.is_compiling():\n                return self.eager_forward(",
               "            if False:\n                return self.eager_forward("),
        # The row tracker entered in the model's pre-hook: dynamo resumes under a dispatch
        # mode and compiles nothing.
        Mutant(T_TM, "        if self.in_forward:\n            self.tracker.enter()",
               "        if True:\n            self.tracker.enter()",
               tests=("theory_tests/kronecker/test_compile_routing.py::test_compiled_equals_eager_and_breaks_only_around_the_model",)),
        # A copy of the model keeps a route to the original's capture.
        Mutant(T_EC, "        return _unrouted, (self.forward,)",
               "        return EagerCaptureSteps, (self.capture, self.forward)"),
        # remove() leaves a bound forward in the instance dict.
        Mutant(T_EC, "            if self._had_own:", "            if True:"),
    ],
    "PORT-LAMB-SURFACE": [
        Mutant(T_LAMB, "    return torch.view_as_real(t) if torch.is_complex(t) else t", "    return t"),
        Mutant(T_LAMB, "            vs.append(_real(state[\"exp_avg_sq\"]))", "            vs.append(state[\"exp_avg_sq\"])"),
        Mutant(T_LAMB, "            g = -g", "            g = g"),
        Mutant(T_LAMB, "            gs = torch._foreach_neg(gs)", "            gs = gs"),
        Mutant(T_LAMB, "            return group[\"foreach\"]", "            return False"),
        Mutant(T_LAMB, "        torch._foreach_add_(denom, eps)", "        torch._foreach_add_(denom, 2 * eps)"),
    ],
    "PORT-COPY": [
        # every refusal but copy.copy's gone (deepcopy and pickle fall through to object's)
        Mutant(T_W, _REFUSALS, "    __copy__ = _refuse_copy"),
        Mutant(T_HO, "        return InertHook()", "        return self"),
        Mutant(T_HO, "    def __reduce__(self):", "    def _reduce_unused(self):"),
        Mutant(T_C, "            hooks.append((module, \"backward\", BoundHook(self.module_backward, layer)))",
               "            hooks.append((module, \"backward\", lambda *a: self.module_backward(layer, *a)))"),
        Mutant("torch_impl/mkor/hybrid.py", "class _LossTap(CopyInertHook):", "class _LossTap:"),
    ],
    "PORT-MASKS": [
        # A transpose not followed: sequence-first rows read the batch-first mask.
        Mutant(T_RP, "    tag[a], tag[b] = tag[b], tag[a]\n", "    tag[a], tag[b] = tag[a], tag[b]\n"),
        # A permute not followed.
        Mutant(T_RP, "    return tuple(tags[0][d] for d in dims)", "    return tuple(tags[0])"),
        # masked() ignores the model's layout (the shape-based bug for B = T).
        Mutant(T_TM, "    dims = (0, 1) if batch_first else (1, 0)", "    dims = (0, 1)"),
        # An inner model keeps another call's tags on its token inputs.
        Mutant(T_TM, "            if srcs and srcs != {src}:", "            if False:"),
        # A mask passed by position is not bound to the signature.
        Mutant(T_TM, "        mask = _two_d(values.get(self.mask_kwarg))\n        src = None",
               "        mask = _two_d(kwargs.get(self.mask_kwarg))\n        src = None",
               tests=("theory_tests/kronecker/test_capture_masks.py::test_a_mask_passed_by_position_is_a_mask",)),
        # Masks enter only at the top-level call (a wrapper's inner model reads none).
        Mutant(T_TM, "            if mask_kwarg in signature.parameters or module is model:",
               "            if module is model:",
               tests=("theory_tests/kronecker/test_capture_masks.py::test_a_wrapper_fed_a_dict_batch_reads_the_mask_where_it_enters_the_inner_model",)),
        # One batch axis per mask instead of per call: FSMT's decoder rows after
        # cross-attention combine two "batches" and are left untied.
        Mutant(T_RP, "    entries[batch_dim] = ((\"t\", batch_key(size[0]), 0, 0, 1, size[0]),)",
               "    entries[batch_dim] = ((\"t\", src, 0, 0, 1, size[0]),)",
               tests=("theory_tests/kronecker/test_capture_masks.py::test_fsmt_layers_are_sequence_first_and_its_head_batch_first",)),
        # torch's recurrent layers' documented layout not applied (GRU's loop loses it).
        Mutant(T_CALLS, "                ctx.tracker.set_tag(out, tuple(tag[:-1]) + (None,))",
               "                pass",
               tests=("theory_tests/kronecker/test_capture_masks.py::test_recurrent_layers_keep_their_rows_layout",)),
        # embedding: the looked-up rows lose the indices' positions.
        Mutant(T_RP, "    return (tuple(indices) if indices is not None else (None,) * args[1].dim()) + (None,)",
               "    return (None,) * args[1].dim() + (None,)"),
        # Matrix products: the right operand's tags taken for the rows.
        Mutant(T_RP, "    rows = a[0] if a is not None else None\n    cols = b[1] if b is not None else None\n    return (rows, cols)",
               "    rows = b[0] if b is not None else None\n    cols = b[1] if b is not None else None\n    return (rows, cols)"),
    ],
    "PORT-SELFCHECK": [
        # A wrong mask: padding rows' gradient not looked at.
        Mutant(T_SC, "            pad = padding.amax() if padding.numel() else g.new_zeros(())",
               "            pad = padding.amax() * 0 if padding.numel() else g.new_zeros(())"),
        # A missed call: a backward through a use no hook captured passes.
        Mutant(T_SC, "            run.ratio = torch.where(observed != 0, math.inf, 0.0).to(dtype)",
               "            run.ratio = torch.where(observed != 0, 0.0, 0.0).to(dtype)"),
        # A second use of the weight: the comparison never fails.
        Mutant(T_SC, "                if ratio > 1 and name not in self.released:",
               "                if ratio > 1e300 and name not in self.released:"),
        # The rounding bound a million times too tight: right captures fail.
        Mutant(T_SC, "    return 2 * gamma + 3 * low_unit", "    return (2 * gamma + 3 * low_unit) * 1e-6"),
        # The weight side without the rows the mask dropped is not the padding check's.
        Mutant(T_SC, "            if verdict.get(\"padding\") == \"fail\" and ratio > 1:",
               "            if False:"),
        # The report's columns sized for short names: long module names shift them.
        Mutant("torch_impl/kronecker/report.py",
               "        width = max([len(\"module\"), *(len(name or \"<model>\") for name in self)])",
               "        width = 40"),
    ],
    "PORT-CAPTURE-SHAPES": [
        Mutant(T_LAYERS, "        return x if x.dim() > 1 else x.unsqueeze(0)  # an unbatched sample: a batch of one",
               "        return x"),
        Mutant(T_LAYERS, "        if x.dim() == 3:  # an unbatched (C, H, W) sample: a batch of one",
               "        if False:  # an unbatched (C, H, W) sample: a batch of one"),
        Mutant(T_D, "        if reason is None and layer_type is not None and 0 in layer_type.shape(module):",
               "        if False:"),
        # discovery follows the model: a layer unfrozen later is never told
        Mutant(T_W, "            if weight.requires_grad and weight.grad is not None and \\",
               "            if False and \\"),
        Mutant(T_C, "            if state == \"eval\":\n                if output.requires_grad:\n                    self.eval_seen.add(layer.name)",
               "            if state == \"eval\":\n                if output.requires_grad:\n                    pass"),
    ],
    "PORT-ROWS": [
        # Row counts across ranks: the mean of the ranks' means instead of the union's mean.
        Mutant(T_VX, "                a_bar = a_sum / rows.clamp(min=1)\n", "                a_bar = a_sum / world\n"),
        Mutant(T_VX, "        divide = world * world if self.average == \"double\" else world",
               "        divide = world * world if self.average == \"double\" else 1"),
        Mutant(T_K, "                A = A_sum / _per_matrix(rows.clamp(min=1))", "                A = A_sum / world"),
        Mutant(T_K, "                G = S_sum * _per_matrix(samples) / world / world / scale / scale",
               "                G = S_sum * _per_matrix(samples) / world / scale / scale"),
        Mutant(T_P, "                else:  # only calls with 0 rows (an MoE expert routed no tokens)\n"
               "                    out.append((layer, None, None, False))",
               "                else:  # only calls with 0 rows (an MoE expert routed no tokens)\n"
               "                    out.append((layer, a_sum / 1, g, None))"),
        Mutant(T_L, "        s[\"no_rows\"] = s[\"no_rows\"] + 1", "        s[\"no_rows\"] = s[\"no_rows\"] + 0"),
    ],
    "KFAC-CONVENTIONS": [
        Mutant(T_KC, "        return positions ** 2, batch ** 2 * positions ** 3",
               "        return positions, batch ** 2 * positions ** 3"),
        Mutant(T_KC, "    return 1, rows ** 2", "    return 1, rows"),
        Mutant(T_KC, "        ours_damping = c * damping", "        ours_damping = damping"),
        Mutant(T_KC, "        ours_kl = kl_clip * lr_0 ** 2 / (c * lr_kp ** 2)",
               "        ours_kl = kl_clip * lr_0 / (c * lr_kp)"),
        Mutant(T_KC, "            settings = {\"lr\": group[\"lr\"] * c}", "            settings = {\"lr\": group[\"lr\"]}"),
        Mutant(T_K, "                    blends[key] = torch.where(_per_matrix(first & (self.factor_init == \"batch\")),",
               "                    blends[key] = torch.where(_per_matrix(first),"),
    ],
    "PORT-KFAC-ACCUM": [
        Mutant(R_K, "    g = samples * g\n", "    g = g\n", tests=("theory_tests/baselines/test_kfac_reference.py",)),
        # Shared by the oracle and the port: G = sum_i g_i g_i^T, the factor N that undoes the
        # mean-reduction of the loss forgotten in both.
        Mutant(R_K, "    g = samples * g\n", "    g = g * samples ** 0.5\n",
               also=((T_KE, "    samples = n / layer.type.rows_per_sample(rows.shape[:-1])",
                      "    samples = n / n"),)),
        Mutant(T_KE, "    samples = n / layer.type.rows_per_sample(rows.shape[:-1])", "    samples = n"),
        Mutant(T_K, "                s[key] = torch.where(_per_matrix(ok), blended, s[key])", "                s[key] = blended"),
    ],
    "PORT-FSDP2": [
        # the rank's rows never written back: FSDP2 steps the raw gradient
        Mutant(T_FSDP, "    shard.to_local().copy_(mine.to_local())", "    pass"),
        # the gather skipped: the local rows preconditioned as if whole
        Mutant(T_FSDP, "        self.weight, self.bias = (g.full_tensor() if is_dtensor(g) else g",
               "        self.weight, self.bias = (g.to_local() if is_dtensor(g) else g"),
        # MKOR's preconditioned matrix not copied into the gathered gradient
        Mutant(T_L, "        if grads.sharded:\n            matrix.copy_(delta_W)",
               "        if grads.sharded:\n            pass"),
        # K-FAC's rows never written back
        Mutant(T_K, "                self._write(layer, grads, V if nu is None else V * nu.to(V.device))\n            grads.write_back()",
               "                self._write(layer, grads, V if nu is None else V * nu.to(V.device))"),
        # a sharding the hooks cannot see whole let through
        Mutant(T_FSDP, "    return placements == (Shard(0),) or placements == (Replicate(), Shard(0))",
               "    return True"),
        Mutant(T_FSDP, "            if not under_fsdp or not _placement_ok(p):",
               "            if not _placement_ok(p):"),
        # owner placement: every layer to rank 0; the wrong rows sent back; every rank keeping
        # every factor
        Mutant(T_SHARD, "        rank = min(range(world_size), key=lambda r: (load[r], r))",
               "        rank = min(range(world_size), key=lambda r: (r, load[r]))"),
        Mutant(T_FSDP, "                    out[r][:n] = full[r * chunk:r * chunk + n]",
               "                    out[r][:n] = full[:n]"),
        Mutant(T_FSDP, "    return dist.get_rank(group) == rank", "    return True"),
        # HSDP's (Replicate(), Shard(0)) refused; owner placement let onto a 2-D mesh
        Mutant(T_FSDP, "    return placements == (Shard(0),) or placements == (Replicate(), Shard(0))",
               "    return placements == (Shard(0),)"),
        Mutant(T_FSDP, "    if mesh.ndim != 1 or any(l.module.weight.device_mesh != mesh for l in sharded):",
               "    if any(l.module.weight.device_mesh != mesh for l in sharded):"),
        # K-FAC owner placement: the owners' KL-clip terms not summed over the ranks (each
        # rank clips with its own layers' sum); the statistics reduced to rank 0 whoever owns
        Mutant(T_K, "            dist.all_reduce(owned, group=next(iter(self._owners.values()))[1])",
               "            pass"),
        Mutant(T_K, "                groups.setdefault(dist.get_global_rank(group, rank), []).append(layer)",
               "                groups.setdefault(0, []).append(layer)"),
    ],
    "PORT-DCP": [
        # a rank keeping a (never updated) state of a layer another rank owns: DCP saves one
        # of the copies, perhaps the stale one
        Mutant(T_P, "        if not self._owns(layer.name):\n            return {}\n",
               "        if False:\n            return {}\n"),
        Mutant(T_K, "        if not owns(self._owners, layer.name):  # another rank keeps it (DCP: one copy)\n            return {}",
               "        if False:\n            return {}"),
        # MKOR-H switched: the freed factors leave no layout, and a fresh optimizer's DCP
        # template asks for entries the checkpoint lacks
        Mutant(T_P, "        layers = (self._released_state() if self.switched else",
               "        layers = ({} if self.switched else"),
        # MKOR-H's buffered losses kept per rank (a checkpoint would hold one rank's), or its
        # rule's state (slow checks, recent means) not restored
        Mutant(T_H, "        self.buffer.append(loss if self.mean is None else self.mean(loss))",
               "        self.buffer.append(loss)"),
        Mutant(T_H, "        if self.rule is not None and state.get(\"rule\") is not None:",
               "        if False:"),
        # one rank's state dict of owner-placed factors loaded without the pointer to DCP
        Mutant(T_FSDP, "    if not saved:\n        raise ValueError(f\"{name}: the state_dict holds no state",
               "    if False:\n        raise ValueError(f\"{name}: the state_dict holds no state"),
    ],
}


# The MARS family's mutants live in their own file (one list per optimizer family).
# A row both families prove (PORT-DCP) takes the mutants of both lists.
for _family in (MARS_MUTANTS, MARS_PROPERTY_MUTANTS, ISSUE30_MUTANTS, NEWCOMER_MUTANTS,
                LOW_PRECISION_MUTANTS, FIGURES_REPRO_MUTANTS, EXPERTS_MUTANTS,
                MATRIX_BATCH_MUTANTS, KFAC_EXPERTS_MUTANTS, ORTHOGONALISER_MUTANTS,
                HF_MUTANTS, PEER_MUTANTS, INIT_STATE_MUTANTS, TORCHTITAN_MUTANTS,
                GROUPED_EXPERTS_MUTANTS, TORCHTITAN_SCALE_MUTANTS):
    for _row, _mutants in _family.items():
        MUTANTS[_row] = MUTANTS.get(_row, []) + list(_mutants)

