"""Mutants of issue 30's guarantees (no silent wrong answer): the functional API's checks,
tensor hyperparameters, ``state_dtype`` through a checkpoint, the missing-gradient rule, the
preconditioners' step hooks and the documented names; keyed by ``paper_notes/claims.md`` rows."""
from .mutant import Mutant

__all__ = ["ISSUE30_MUTANTS"]

T_CHK, T_FN = "torch_impl/mars/functional_checks.py", "torch_impl/mars/functional.py"
T_VAL, T_SCA = "torch_impl/common/validation.py", "torch_impl/common/scalars.py"
T_F, T_MF = "torch_impl/mars/mars_equations.py", "torch_impl/mars/mars_m_equations.py"
T_LAMB, T_SD = "torch_impl/baselines/lamb.py", "torch_impl/mars/state_dtype.py"
T_MARS, T_MM = "torch_impl/mars/mars.py", "torch_impl/mars/mars_m.py"
T_EX, T_W = "torch_impl/mars/exact_mode.py", "torch_impl/kronecker/optimizer.py"

ISSUE30_MUTANTS = {
    "PORT-FUNCTIONAL": [
        # zip's silent truncation back: lengths unchecked
        Mutant(T_CHK, "        if column is None or len(column) != n:", "        if column is None:"),
        # an unknown kind let through (it then fails, or takes another route's rule)
        Mutant(T_CHK, "        if kind not in needs:", "        if False:"),
        Mutant(T_CHK, "            if t.shape != shape:", "            if False:"),
        Mutant(T_CHK, "        if kind in matrices and len(shape) != matrix_batch_dims + 2:",
               "        if False:"),
        Mutant(T_CHK, "        if not (torch.is_tensor(k) and k.numel() == 1 and not k.is_cuda):",
               "        if not torch.is_tensor(k):"),
        # amsgrad's buffer not required
        Mutant(T_FN, "(\"max_exp_avg_sqs\",) if amsgrad", "(\"max_exp_avg_sqs\",) if False"),
    ],
    "PORT-TENSOR-HYPER": [
        # a tensor read on the host while compiling: a graph break / a constant per value
        Mutant(T_SCA, "    return x.item() if torch.is_tensor(x) and not torch.compiler.is_compiling() else x",
               "    return x.item() if torch.is_tensor(x) else x"),
        Mutant(T_VAL, "    if tensor and torch.is_tensor(value):\n        value = tensor_scalar(name, value)",
               "    if False:\n        value = tensor_scalar(name, value)"),
        Mutant(T_VAL, "    if value.numel() != 1 or not value.is_floating_point() or value.is_cuda \\",
               "    if value.numel() != 1 or value.is_cuda \\"),
        Mutant(T_F, "    beta1, beta2 = (_number(b) for b in betas)\n", "    beta1, beta2 = betas\n"),
        Mutant(T_MF, "    momentum = mars_equations._number(momentum)", "    momentum = momentum"),
        Mutant(T_FN, "    beta1 = mars_equations._number(beta1)  # a tensor beta1",
               "    beta1 = beta1  # a tensor beta1"),
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
    "PORT-STATE-DTYPE": [
        # a saved group without the key: torch casts the state to the parameter's dtype
        Mutant(T_SD, "        dtype = group.get(\"state_dtype\", optimizer.defaults.get(\"state_dtype\"))",
               "        dtype = group.get(\"state_dtype\")"),
        Mutant(T_MARS, "                elif st[name].dtype != dtype:", "                elif False:"),
    ],
    "PORT-MISSING-GRAD": [
        # approx mode keeps the g of the last step the tensor took part in
        Mutant(T_EX, "                opt.state[p][\"last_grad\"].zero_()",
               "                opt.state[p][\"last_grad\"].mul_(1.0)"),
        Mutant(T_MARS, "        exact_mode.forget_missing_gradients(self)  # (M2)",
               "        pass  # (M2)"),
        Mutant(T_MM, "        exact_mode.forget_missing_gradients(self)  # (M2)",
               "        pass  # (M2)"),
        # the authors' loop keeps the older previous_grad / makes none
        Mutant(T_EX, "                    st[\"previous_grad\"].zero_()", "                    pass"),
        Mutant(T_EX, "                    st[\"previous_grad\"] = torch.zeros_like(st[\"last_grad\"])",
               "                    pass"),
        # exact mode: a tensor without a gradient at x_{t-1} keeps its buffer (c~ of the last step)
        Mutant(T_EX, "                if p.grad is None:  # p did not enter the loss at x_{t-1}\n                    buf.zero_()",
               "                if p.grad is None:  # p did not enter the loss at x_{t-1}\n                    pass"),
    ],
    "PORT-STEP-HOOKS": [
        # the backbone stepped past torch's hook wrapper: its hooks (and global ones) skipped
        Mutant(T_W, "        self.precondition()\n        self.optimizer.step()",
               "        self.precondition()\n        type(self.optimizer).step.__wrapped__(self.optimizer)"),
    ],
    "PORT-DOC-REFS": [
        Mutant("torch_impl/mars/__init__.py", "``torch_impl.mars.functional.mars(params, grads, ...)``",
               "``torch_impl.functional.mars(params, grads, ...)``"),
    ],
}
