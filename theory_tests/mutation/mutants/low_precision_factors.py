"""Mutants of 16-bit Kronecker factors (issue 47 item 3): MKOR's stochastic factor writes and
their streams, K-FAC's bf16 factors, and the float64 measure of both (LP5,
FACTOR-ROUNDING-PORT), keyed by the ``paper_notes/claims.md`` row whose tests must kill them."""
from ..mutant import Mutant

__all__ = ["MUTANTS"]

T_STORAGE = "torch_impl/kronecker/factor_storage.py"
T_PRECONDITIONER = "torch_impl/mkor/preconditioner.py"
T_CONFIG = "torch_impl/mkor/config.py"
T_KFAC = "torch_impl/baselines/kfac.py"
T_KFAC_EQUATIONS = "torch_impl/baselines/kfac_equations.py"
T_KFAC_STATE = "torch_impl/baselines/kfac_state.py"
R_PRECISION = "reference/mkor/factor_precision.py"

MUTANTS = {
    "LP5": [
        # the factor write rounds toward zero (truncates the float32 bits) instead of LP1
        Mutant(T_STORAGE, "    upper = torch.triu(stochastic_round(x, dtype, seed))",
               "    upper = torch.triu((x.contiguous().view(torch.int32) & -65536)"
               ".view(torch.float32).to(dtype))"),
        # K-FAC's decomposition run in the factor's bf16 (eigh refuses it: a float64 retry
        # whose result is rounded back to bf16)
        Mutant(T_KFAC_EQUATIONS, "    return F.to(torch.promote_types(F.dtype, torch.float32))",
               "    return F"),
        # K-FAC's EMA blended in bf16: the old factor's product and the sum rounded again
        Mutant(T_KFAC, "new, beta * s[key].to(new.dtype) + (1 - beta) * new",
               "new, beta * s[key] + ((1 - beta) * new).to(s[key].dtype)"),
        # the oracle's stabiliser applied to the factor instead of to its inverse
        Mutant(R_PRECISION,
               "    return np.linalg.inv(weight * np.linalg.inv(L) + (1 - weight) * np.eye(d))",
               "    return weight * L + (1 - weight) * np.eye(d)"),
        # the oracle's EMA with the rank-1 weight 1 (the released code's) under "paper"
        Mutant(R_PRECISION, "        return stat_decay * L + (1 - stat_decay) * np.outer(v, v)",
               "        return stat_decay * L + np.outer(v, v)"),
        # the blend's contraction from the wrong end of the spectrum (lambda_min(J))
        Mutant(R_PRECISION, "    lam = 1.0 / (factor_spectrum(L) if spectrum is None else spectrum)[0].min()",
               "    lam = 1.0 / (factor_spectrum(L) if spectrum is None else spectrum)[0].max()"),
        # kappa with the factor's smallest eigenvalue instead of its norm
        Mutant(R_PRECISION, "    return float(row_sums * (factor_spectrum(L) if spectrum is None else spectrum)[0].max())",
               "    return float(row_sums * (factor_spectrum(L) if spectrum is None else spectrum)[0].min())"),
        # the bound forgets the errors already kept (one write's worth only)
        Mutant(R_PRECISION, "    return contraction * bound + unit * kappa", "    return unit * kappa"),
    ],
    "FACTOR-ROUNDING-PORT": [
        # the factor write rounds toward zero instead of stochastically
        Mutant(T_STORAGE, "    upper = torch.triu(stochastic_round(x, dtype, seed))",
               "    upper = torch.triu((x.contiguous().view(torch.int32) & -65536)"
               ".view(torch.float32).to(dtype))"),
        # each entry rounded on its own: J_ij and J_ji round apart (an asymmetric factor)
        Mutant(T_STORAGE, "    return upper + torch.triu(upper, 1).mT  # exact: one of each pair is 0",
               "    return stochastic_round(x, dtype, seed)"),
        # the layer index dropped from the seed: every layer shares a stream
        Mutant(T_PRECONDITIONER,
               "        return {key: factor_seed(self.rounding_seed, self._index[name], key, self._steps)",
               "        return {key: factor_seed(self.rounding_seed, 0, key, self._steps)"),
        # the side dropped: L_inv and R_inv share a stream
        Mutant(T_PRECONDITIONER,
               "        return {key: factor_seed(self.rounding_seed, self._index[name], key, self._steps)",
               "        return {key: factor_seed(self.rounding_seed, self._index[name], \"factor\", "
               "self._steps)"),
        # the update count dropped: every update of a factor reuses one stream
        Mutant(T_PRECONDITIONER,
               "        return {key: factor_seed(self.rounding_seed, self._index[name], key, self._steps)",
               "        return {key: factor_seed(self.rounding_seed, self._index[name], key, 0)"),
        # ... at the source: the count not mixed into the seed
        Mutant(T_STORAGE, "    return stream_seed(rounding_seed, index, name_word(name), count)",
               "    return stream_seed(rounding_seed, index, name_word(name))"),
        # each rank keeps its own default draw (no broadcast): replicated factors diverge
        Mutant(T_STORAGE, "    if world_size(process_group) > 1:", "    if False:"),
        # a checkpoint's seed not restored: the resumed run rounds with its own
        Mutant(T_PRECONDITIONER, "            self.rounding_seed = int(state[\"rounding_seed\"])",
               "            pass"),
        # "stochastic" with a float32 factor accepted (and silently rounding nothing)
        Mutant(T_CONFIG, "        if self.factor_rounding == \"stochastic\" and self.factor_dtype not in ROUNDING_DTYPES:",
               "        if False:"),
        # K-FAC's checkpoint loads the factors in the compute dtype
        Mutant(T_KFAC_STATE, "        loaded[name] = {k: _to_device(v, dev, factor_dtype if k in (\"A\", \"G\") else compute_dtype)",
               "        loaded[name] = {k: _to_device(v, dev, compute_dtype)"),
        # K-FAC's factor_dtype wider than the compute dtype accepted
        Mutant(T_KFAC_STATE, "    if torch.finfo(value).bits > torch.finfo(compute_dtype).bits:",
               "    if False:"),
    ],
}
