"""Mutants of the figures' reproduction checks, progress lines and environment (``figures/``,
and the mutation harness's own progress lines), keyed by the
``paper_notes/claims.md`` row whose tests must kill them (``theory_tests/mutation/mutant.py``
says what a mutant is)."""
from ..mutant import Mutant

__all__ = ["MUTANTS"]

F_CLI = "figures/cli.py"
F_COMMON = "figures/common.py"
F_REPRO = "figures/repro.py"
F_SUMS = "figures/fixed_sums.py"
F_VARIANCE = "figures/experiments/variance_reduction.py"
F_PROGRESS = "figures/progress.py"
F_SUMMARY = "figures/summary.py"
F_HARNESS = "theory_tests/mutation/harness.py"
F_CURV = "figures/curvature_methods.py"
F_STATE_CF = "figures/bench/state_closed_form.py"
F_STATE = "figures/bench/state_memory.py"
F_LOWP = "figures/experiments/low_precision.py"
F_REGISTRY = "figures/registry.py"
PYPROJECT = "pyproject.toml"


MUTANTS = {
    "FIG-REPRO": [
        # a tolerance comparison that always passes
        Mutant(F_REPRO, "        return abs(fresh - committed) <= self.bound(committed)",
               "        return abs(fresh - committed) <= self.bound(committed) + math.inf"),
        # bit for bit never expected: the committed environment falls back to the tolerance
        Mutant(F_REPRO, "    return None not in a.values() and a == b",
               "    return False and a == b"),
        # the curve's own spread ignored: a sensitive curve gets the figure's median only
        Mutant(F_REPRO, "        sd = max(curves.get((row[\"optimizer\"], metric), 0.0), "
                  "pooled.get(quantity(metric), 0.0))",
               "        sd = pooled.get(quantity(metric), 0.0)"),
        # the key columns (optimizer, lr, seed, step, ...) no longer compared
        Mutant(F_REPRO, "        moved = [k for k in keys if new.get(k) != old[k]]",
               "        moved = []"),
        # the wall-clock column compared: every regeneration drifts
        Mutant(F_REPRO, "        keys = [k for k in old if k not in (VALUE, TIMING)]",
               "        keys = [k for k in old if k not in (VALUE,)]"),
        # the default output folder is the committed one again
        Mutant(F_COMMON, "    return committed_dir(mode) if update else FRESH / mode",
               "    return committed_dir(mode)"),
        # a drift no longer fails the command
        Mutant(F_CLI, "    if drifted and not args.update:", "    if drifted and args.update:"),
        # --help cut at the description's first line again
        Mutant(F_CLI, "description=DESCRIPTION,", "description=DESCRIPTION.splitlines()[0],"),
    ],
    "FIG-LAST-PLACE": [
        # bit for bit again: the one-ulp difference of a reduction is a drift
        Mutant(F_REPRO, "ULPS = 4\n", "ULPS = 0\n"),
        # any difference of finite floats passes in the committed environment
        Mutant(F_REPRO, "    return math.isfinite(a) and math.isfinite(b) and ulps_apart(a, b) <= ULPS",
               "    return math.isfinite(a) and math.isfinite(b)"),
        # the JSON's numbers bit for bit again (the CSV's keep the allowance)
        Mutant(F_REPRO, "        if not same and last_place(fresh, committed):",
               "        if not same and False:"),
        # the CSV's values bit for bit again (the JSON's keep the allowance)
        Mutant(F_REPRO, "        if result.exact and last_place(a, b):", "        if False:"),
        # a plain left-to-right sum: its result depends on the order
        Mutant(F_SUMS, "        return math.fsum(xs)\n", "        return sum(xs)\n"),
        # NumPy's mean of the slice again (issue 45 item 6)
        Mutant(F_VARIANCE, "fixed_sums.mean(v[:, half:])", "float(v[:, half:].mean())"),
        # the summary table's seed mean by NumPy again
        Mutant(F_COMMON, "final=fixed_sums.mean(finals)", "final=float(np.mean(finals))"),
    ],
    "FIG-PROGRESS": [
        # a waiting task queued behind the busiest worker, not on the first free one
        Mutant(F_PROGRESS, "            free[0] += self.recorded[t] * k",
               "            free[-1] += self.recorded[t] * k"),
        # the recorded durations taken as they are, whatever this run's speed
        Mutant(F_PROGRESS, "        k = sum(t for t, _ in pairs) / recorded if recorded > 0 else 1.0",
               "        k = 1.0"),
        # before any task finishes, the recorded speed, however long the running ones take
        Mutant(F_PROGRESS, "        return max(k, min(running)) if running else k",
               "        return k"),
        # a heartbeat line on every poll, not after a minute of silence
        Mutant(F_PROGRESS, "        if now - self.last < HEARTBEAT:\n            return\n", ""),
        # a worker records its own command line again (doubled flags, a temporary folder)
        Mutant(F_CLI, "                    command=command or command_line(argv))",
               "                    command=command_line(argv))"),
        # the worker flags appended even when the command has them
        Mutant(F_CLI, 'return rest + [flag for flag in ("--no-progress", "--no-summary") if flag not in rest]',
               'return rest + ["--no-progress", "--no-summary"]'),
        # a finished task is not reported
        Mutant(F_CLI, "                progress.finished(label)\n", ""),
        # a worker no longer says which task it starts
        Mutant(F_CLI, "        _STARTS.put(label)\n", "        pass\n"),
        # the mutation harness's time left: the elapsed time times the mutants left
        Mutant(F_HARNESS, "    left = elapsed / done * (total - done) if done else 0.0",
               "    left = elapsed * (total - done)"),
        # no total before the first mutant
        Mutant(F_HARNESS, '    print(f"{len(todo)} mutants to run on {max(1, args.jobs)} worker(s)", flush=True)\n',
               ""),
    ],
    "FIG-CURVATURE": [
        # the scaled distance without its best scalar: the raw distance again
        Mutant(F_CURV, "    c = float((block * approx).sum()) / kk if kk > 0 else 0.0",
               "    c = 1.0"),
        # reduce's and expand's statistics swapped in the oracle path
        Mutant(F_CURV, 'rule = oracle.expand_factors if kfac_approx == "expand" else '
                       'oracle.reduce_factors',
               'rule = oracle.reduce_factors if kfac_approx == "expand" else '
               'oracle.expand_factors'),
        # the wrong group mean: a group's sum (its size times the mean)
        Mutant(F_CURV, "torch.stack([group.mean(0) for group in torch.tensor_split(rows, k)])",
               "torch.stack([group.sum(0) for group in torch.tensor_split(rows, k)])"),
        # the port's group sums drawn as means: the figure's MKOR statistic off by the sizes
        Mutant(F_CURV, "    return sums / counts.unsqueeze(-1).to(sums.dtype)",
               "    return sums"),
        # a Linear's per-sample multiplier R_g taken as the samples, not the rows (K3)
        Mutant(F_CURV, "per_sample = fwd.a[name].shape[0] if isinstance(layer, nn.Conv2d) "
                       "else a.shape[0]",
               "per_sample = fwd.a[name].shape[0]"),
        # MKOR's bias column dropped
        Mutant(F_CURV, "        if layer.bias is not None:\n            a = torch.cat(",
               "        if False:\n            a = torch.cat("),
        # rounding noise drawn as a distance: nothing is ever recorded as cancelled
        Mutant(F_CURV, "VANISHED = 1e-20\n", "VANISHED = 0.0\n"),
        # the training hook never called: mc / type-2 K-FAC would have no columns
        Mutant(F_COMMON, "            before_backward(opt, output, y)\n", "            pass\n"),
    ],
    "MEMORY-TABLE": [
        # MARS-AdamW's closed form one buffer short: the last gradient forgotten
        Mutant(F_STATE_CF, '(("exp_avg", "exp_avg_sq", "last_grad") if mars_type == "mars-adamw"',
               '(("exp_avg", "exp_avg_sq") if mars_type == "mars-adamw"'),
        # MARS-M's efficient variant counted with the last gradient it does not keep
        Mutant(F_STATE_CF, 'return ("momentum_buffer",) if efficient else',
               'return ("momentum_buffer", "last_grad") if efficient else'),
        # exact mode's x_{t-1} counted in state_dtype instead of the parameter's dtype
        Mutant(F_STATE_CF, 'counts["prev_param"] += sum(p.numel() * item_size(p.dtype) for p in params_)',
               'counts["prev_param"] += sum(p.numel() * item_size(options.get("state_dtype") or p.dtype) for p in params_)'),
        # the last block's scale dropped when it is not full
        Mutant(F_STATE_CF, "4 * math.ceil(n / block_size)", "4 * (n // block_size)"),
        # the last gradient quantized too
        Mutant(F_STATE_CF, '"max_exp_avg_sq", "momentum_buffer")',
               '"max_exp_avg_sq", "momentum_buffer", "last_grad")'),
        # a Kahan buffer on every parameter, float32 ones included
        Mutant(F_STATE_CF, 'if options.get("kahan_sum") and item_size(p.dtype) == 2:',
               'if options.get("kahan_sum"):'),
        # MKOR's R^-1 without the bias column
        Mutant(F_STATE_CF, "module.in_features + (module.bias is not None)",
               "module.in_features"),
        # K-FAC's decompositions counted in the factor dtype, not float32
        Mutant(F_STATE_CF, "size, f32 = item_size(factor_dtype), item_size(torch.float32)",
               "size, f32 = item_size(factor_dtype), item_size(factor_dtype)"),
        # K-FAC's eigenvalues forgotten
        Mutant(F_STATE_CF, 'own[f"eig_{side}[0]"] = sum(dims) * f32',
               'own[f"eig_{side}[0]"] = 0'),
        # the measurement counts the 0-d step counters with the state
        Mutant(F_STATE, "            if value.ndim == 0:\n", "            if False:\n"),
        # a measured count that differs from its closed form no longer marked
        Mutant(F_STATE, """mark = "" if e["matches"] else""", """mark = "" if True else"""),
        # the step time reported as its ratio: not divided by its rounds' AdamW time
        Mutant(F_STATE, '"adamw_seconds": ref, "ratio": t / ref,',
               '"adamw_seconds": ref, "ratio": t,'),
    ],
    "FIG-LOW-PRECISION": [
        # the effect's sign turned: float32 − variant, a worse variant drawn as better
        Mutant(F_LOWP, "            paired = S.paired_ci(vals, ref)",
               "            paired = S.paired_ci(ref, vals)"),
        # the verdicts swapped: an interval above 0 read as better
        Mutant(F_LOWP, '{"positive": "worse", "negative": "better"}',
               '{"positive": "better", "negative": "worse"}'),
        # the seed noise's SE without its sqrt(n)
        Mutant(F_LOWP, "reference_se=sd / math.sqrt(len(ref))", "reference_se=sd"),
        # the stochastic curve rounded to nearest: two nearest curves, no stochastic one
        Mutant(F_LOWP, '_mars("bf16 stochastic", BF16, ("state_rounding", "stochastic"))',
               '_mars("bf16 stochastic", BF16, ("state_rounding", "nearest"))'),
        # MARS's default beta2 = 0.99, where nearest barely stalls: not the figure's setting
        Mutant(F_LOWP, "BETAS = (0.95, 0.999)", "BETAS = (0.95, 0.99)"),
        # a tensor of exactly one block sent to the float32 group
        Mutant(F_REGISTRY, "    big = [p for p in params if p.numel() >= block]",
               "    big = [p for p in params if p.numel() > block]"),
        # the spec's state_dtype name no longer turned into a dtype
        Mutant(F_REGISTRY, 'for key in ("ns_dtype", "state_dtype"):',
               'for key in ("ns_dtype",):'),
    ],
    "FIG-ENVIRONMENT": [
        # transformers unpinned: a newer one changes the BERT figures' last bits
        Mutant(PYPROJECT, '    "transformers==5.25.0",\n', '    "transformers>=4.46",\n'),
        # the summary claims one environment whatever the figures record
        Mutant(F_SUMMARY, "    if all(p == first for p in prints):", "    if True:"),
        # scipy's version no longer recorded: the budget scan's intervals depend on it
        Mutant(F_COMMON, '("scipy", "scipy"), ', ""),
    ],
}
