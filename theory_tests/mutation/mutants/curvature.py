"""Mutants of the K-FAC-flavours oracle (``reference/baselines/kfac_flavours.py``, issue 46:
KC2–KC6, KC9), keyed by the ``paper_notes/claims.md`` row whose tests must kill them. The
brute-force curvature they are held to (``theory_tests/support/curvature.py``) is the truth and
is never mutated."""
from ..mutant import Mutant

__all__ = ["MUTANTS"]

R_FLAVOURS = "reference/baselines/kfac_flavours.py"

MUTANTS = {
    "KC2": [
        # the CE square root's sign: S Sᵀ = diag(p) + p pᵀ(…) no longer H
        Mutant(R_FLAVOURS, "np.eye(p.shape[1])) - p[:, :, None] * root[:, None, :]",
               "np.eye(p.shape[1])) + p[:, :, None] * root[:, None, :]"),
        # the CE square root transposed: diag(√p) − √p pᵀ = Sᵀ, whose columns do not square to H
        Mutant(R_FLAVOURS, "np.eye(p.shape[1])) - p[:, :, None] * root[:, None, :]",
               "np.eye(p.shape[1])) - root[:, :, None] * p[:, None, :]"),
        # the columns read as S's rows (the transpose again, at the column step)
        Mutant(R_FLAVOURS, "hessian_sqrt(kind, outputs).transpose(2, 0, 1)",
               "hessian_sqrt(kind, outputs).transpose(1, 0, 2)"),
        # MSE's root √2 I taken as 2 I (H = 4 I)
        Mutant(R_FLAVOURS, "np.broadcast_to(np.sqrt(2.0) * np.eye(C)", "np.broadcast_to(2.0 * np.eye(C)"),
    ],
    "KC3": [
        # MC "sampled" from the data's targets instead of the model: the EF, not the Fisher
        Mutant(R_FLAVOURS, "draws = [sample_targets(kind, outputs, rng) for _ in range(samples)]",
               "draws = [targets for _ in range(samples)]"),
        # each column weighted 1/M instead of 1/√M
        Mutant(R_FLAVOURS, "for y in draws]) / np.sqrt(samples)", "for y in draws]) / samples"),
        # CE classes drawn uniformly, not from softmax(f)
        Mutant(R_FLAVOURS, "cdf = np.cumsum(softmax(f), axis=1)",
               "cdf = np.cumsum(np.full(f.shape, 1 / f.shape[1]), axis=1)"),
        # MSE's Gaussian with variance I instead of I/2
        Mutant(R_FLAVOURS, "return f + rng.standard_normal(f.shape) / np.sqrt(2.0)",
               "return f + rng.standard_normal(f.shape)"),
    ],
    "KC4": [
        # expand's A averaged over the N samples (reduce's count) instead of the N·S rows
        Mutant(R_FLAVOURS, "return rows.T @ rows / (a.shape[0] * a.shape[1]), R * cols.T @ cols",
               "return rows.T @ rows / a.shape[0], R * cols.T @ cols"),
        # a dropped bias column (shared by expand and reduce): the bias input 0, not 1
        Mutant(R_FLAVOURS, "np.concatenate([a, np.ones(a.shape[:-1] + (1,))], axis=-1)",
               "np.concatenate([a, np.zeros(a.shape[:-1] + (1,))], axis=-1)"),
        # the bias column dropped outright
        Mutant(R_FLAVOURS, "    if not has_bias:\n        return a\n", "    if True:\n        return a\n"),
        # MSE's mean R as 1/#points (CE's) instead of 1/numel
        Mutant(R_FLAVOURS, "return 1.0 / (points if kind == \"ce\" else numel)", "return 1.0 / points"),
        # the empirical MSE column without ℓ's factor 2
        Mutant(R_FLAVOURS, "return 2.0 * (f - np.asarray(targets, dtype=np.float64))",
               "return f - np.asarray(targets, dtype=np.float64)"),
        # an expert's rows taken from every other expert
        Mutant(R_FLAVOURS, "        mine = routes == e\n", "        mine = routes != e\n"),
    ],
    "KC5": [
        # reduce's A averaged over the N·S rows (expand's count) instead of the N samples
        Mutant(R_FLAVOURS, "return a_bar.T @ a_bar / a.shape[0], R * g_hat.T @ g_hat",
               "return a_bar.T @ a_bar / (a.shape[0] * a.shape[1]), R * g_hat.T @ g_hat"),
        # ā summed instead of averaged over the S positions
        Mutant(R_FLAVOURS, "a_bar = _with_bias(a, has_bias).mean(axis=1)",
               "a_bar = _with_bias(a, has_bias).sum(axis=1)"),
        # ĝ averaged instead of summed
        Mutant(R_FLAVOURS, "g_hat = g.sum(axis=2).reshape(-1, g.shape[-1])",
               "g_hat = g.mean(axis=2).reshape(-1, g.shape[-1])"),
    ],
    "KC6": [
        # MKOR's ḡ as the mean of the rows instead of their sum
        Mutant(R_FLAVOURS, "g.reshape(-1, g.shape[-1]).sum(axis=0)", "g.reshape(-1, g.shape[-1]).mean(axis=0)"),
        # ā without the bias's 1
        Mutant(R_FLAVOURS, "rows = _with_bias(np.asarray(a, dtype=np.float64), has_bias)",
               "rows = np.asarray(a, dtype=np.float64)"),
    ],
    "KC9": [
        # the second singular pair instead of the top one
        Mutant(R_FLAVOURS, "G, A = s[0] * U[:, 0].reshape(d_out, d_out), Vt[0].reshape(width, width)",
               "G, A = s[1] * U[:, 1].reshape(d_out, d_out), Vt[1].reshape(width, width)"),
        # the block reshaped without the rearrangement
        Mutant(R_FLAVOURS, ".transpose(0, 2, 1, 3).reshape(", ".transpose(0, 1, 2, 3).reshape("),
    ],
}
