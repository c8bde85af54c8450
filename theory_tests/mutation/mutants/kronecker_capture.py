"""Mutants of the engine's capture (``torch_impl/kronecker/capture/``), keyed by the
``paper_notes/claims.md`` row whose tests must kill them (``theory_tests/mutation/mutant.py``
says what a mutant is)."""
from ..mutant import Mutant

__all__ = ["MUTANTS"]

T_CALLS = "torch_impl/kronecker/capture/calls.py"
T_CAPTURE = "torch_impl/kronecker/capture/capture.py"
T_EAGER = "torch_impl/kronecker/capture/eager.py"
T_EXPERTS = "torch_impl/kronecker/capture/experts.py"
T_HOOKS = "torch_impl/kronecker/capture/hooks.py"
T_LEDGER = "torch_impl/kronecker/capture/ledger.py"
T_ROW_PROVENANCE = "torch_impl/kronecker/capture/row_provenance.py"
T_SELF_CHECK = "torch_impl/kronecker/capture/self_check.py"
T_STATISTICS = "torch_impl/kronecker/capture/statistics.py"
T_TOKEN_MASKS = "torch_impl/kronecker/capture/token_masks.py"


_ACC = "theory_tests/kronecker/test_accounting.py::"
MUTANTS = {
    "PORT-ACCOUNTED": [
        # A zero gradient counted as a pass (the check proved nothing).
        Mutant(T_SELF_CHECK, "            elif total == 0 or (total < 0 and ratio == 0):",
               "            elif False:"),
        # A check skipped on a capture step whose statistics are used (the old every-10th).
        Mutant(T_SELF_CHECK, "        self.checking = bool(capturing and self.enabled)",
               "        self.checking = bool(capturing and self.enabled and self.captures % 10 == 0)"),
        # A layer counted as having statistics though none entered its factors.
        Mutant(T_LEDGER, "            elif has_statistics(name):", "            elif True:"),
        # A vacuous check's statistics not refused: they reach the factors unverified.
        Mutant(T_CAPTURE, "        for name in list(released) + list(vacuous):",
               "        for name in list(released):"),
        # An expert whose own terms all vanished is not refused (its twin Linear would be).
        Mutant(T_SELF_CHECK, "                self.vacuous_experts[name] = [t == 0 for t in totals]",
               "                self.vacuous_experts[name] = [False for t in totals]",
               tests=("theory_tests/mkor/test_experts_port.py::test_an_expert_routed_no_token_counts_no_rows_as_its_twin_does",)),
        # The refused experts' counts kept: they update as if verified.
        Mutant(T_STATISTICS, "    if x.numel() == 0:  # an identity side stores nothing",
               "    if True:",
               tests=("theory_tests/mkor/test_experts_port.py::test_an_expert_routed_no_token_counts_no_rows_as_its_twin_does",)),
        # MKOR: identity factors' bf16 product handed on as if preconditioned.
        Mutant("torch_impl/mkor/layer_state.py", "    seen = (s[\"updates_a\"] + s[\"updates_g\"]) > 0",
               "    seen = (s[\"updates_a\"] + s[\"updates_g\"]) >= 0"),
        # K-FAC: factors that never took a statistic (I, damped, clipped) transform the gradient.
        Mutant("torch_impl/baselines/kfac.py", "                seen = _per_matrix(s[\"updates\"] > 0)",
               "                seen = _per_matrix(s[\"updates\"] >= 0)"),
        # K-FAC: an unpreconditioned layer's <G, G> in the KL clip's sum.
        Mutant("torch_impl/baselines/kfac.py",
               "            term = torch.where(seen, V * G_hat, 0).sum().to(dev)  # the preconditioned only",
               "            term = (V * G_hat).sum().to(dev)",
               tests=("theory_tests/baselines/test_kfac_experts.py::test_the_kl_clip_sums_every_experts_term",)),
        # K-FAC: the KL clip's factor applied to an unpreconditioned layer's raw gradient.
        Mutant("torch_impl/baselines/kfac.py",
               "                scale = None if nu is None else torch.where(seen, nu.to(V.device), 1.0)",
               "                scale = None if nu is None else nu.to(V.device)"),
        # comm_overlap: the early launch that carried refused statistics is used anyway.
        Mutant("torch_impl/mkor/preconditioner.py",
               "            if refused:  # an early (comm_overlap) launch carried the refused statistics",
               "            if False:  # an early (comm_overlap) launch carried the refused statistics",
               tests=("theory_tests/distributed/test_mkor_comm.py::test_statistics_refused_after_an_overlapped_launch_never_reach_a_factor",)),
        # A checkpoint load forgets which layers' factors took a statistic.
        Mutant("torch_impl/kronecker/optimizer.py",
               "        self._capture.ledger.restore(self._layers_with_statistics(), self._steps)",
               "        self._capture.ledger.restore([], self._steps)"),
        # The report calls a waiting layer preconditioned.
        Mutant("torch_impl/kronecker/optimizer.py",
               "        return capture.check.released.get(name) or capture.ledger.reason(name)",
               "        return capture.check.released.get(name)"),
    ],
    "PORT-COMM-OVERLAP": [
        Mutant(T_CAPTURE, "            self.listener.captured(layer)", "            pass"),
    ],
    "PORT-PAIRING": [
        # Shared-call pairing: the old rule (statistics dropped whenever .grad is None) moved
        # to commit time drops every earlier call of a module used several times per forward.
        Mutant(T_STATISTICS, "        if st.settled and layer.module.weight.grad is None:\n            # the gradient",
               "        if layer.module.weight.grad is None:\n            # the gradient"),
        Mutant(T_STATISTICS, "        if st.settled and layer.module.weight.grad is None:\n            # the gradient",
               "        if False:\n            # the gradient"),
        Mutant(T_STATISTICS, "        if st.settled and self._by_name[name].module.weight.grad is None:",
               "        if False:"),
        Mutant(T_CAPTURE, "                    self.commit(layer, a_stat, mask, grad_rows(grad), sketch)",
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
        Mutant(T_EAGER, "            if torch.compiler.is_compiling():\n                return self.eager_forward(",
               "            if False:\n                return self.eager_forward("),
        # The row tracker entered in the model's pre-hook: dynamo resumes under a dispatch
        # mode and compiles nothing.
        Mutant(T_TOKEN_MASKS, "        if self.in_forward:\n            self.tracker.enter()",
               "        if True:\n            self.tracker.enter()",
               tests=("theory_tests/kronecker/test_compile_routing.py::test_compiled_equals_eager_and_breaks_only_around_the_model",)),
        # A copy of the model keeps a route to the original's capture.
        Mutant(T_EAGER, "        return _unrouted, (self.forward,)",
               "        return EagerCaptureSteps, (self.capture, self.forward)"),
        # remove() leaves a bound forward in the instance dict.
        Mutant(T_EAGER, "            if self._had_own:", "            if True:"),
    ],
    "PORT-COPY": [
        Mutant(T_HOOKS, "        return InertHook()", "        return self"),
        Mutant(T_HOOKS, "    def __reduce__(self):", "    def _reduce_unused(self):"),
        Mutant(T_CAPTURE, "            hooks.append((module, \"backward\", BoundHook(self.module_backward, layer)))",
               "            hooks.append((module, \"backward\", lambda *a: self.module_backward(layer, *a)))"),
    ],
    "PORT-MASKS": [
        # A transpose not followed: sequence-first rows read the batch-first mask.
        Mutant(T_ROW_PROVENANCE, "    tag[a], tag[b] = tag[b], tag[a]\n", "    tag[a], tag[b] = tag[a], tag[b]\n"),
        # A permute not followed.
        Mutant(T_ROW_PROVENANCE, "    return tuple(tags[0][d] for d in dims)", "    return tuple(tags[0])"),
        # masked() ignores the model's layout (the shape-based bug for B = T).
        Mutant(T_TOKEN_MASKS, "    dims = (0, 1) if batch_first else (1, 0)", "    dims = (0, 1)"),
        # An inner model keeps another call's tags on its token inputs.
        Mutant(T_TOKEN_MASKS, "            if srcs and srcs != {src}:", "            if False:"),
        # A mask passed by position is not bound to the signature.
        Mutant(T_TOKEN_MASKS, "        mask = _two_d(values.get(self.mask_kwarg))\n        src = None",
               "        mask = _two_d(kwargs.get(self.mask_kwarg))\n        src = None",
               tests=("theory_tests/kronecker/test_capture_masks.py::test_a_mask_passed_by_position_is_a_mask",)),
        # Masks enter only at the top-level call (a wrapper's inner model reads none).
        Mutant(T_TOKEN_MASKS, "            if mask_kwarg in signature.parameters or module is model:",
               "            if module is model:",
               tests=("theory_tests/kronecker/test_capture_masks.py::test_a_wrapper_fed_a_dict_batch_reads_the_mask_where_it_enters_the_inner_model",)),
        # One batch axis per mask instead of per call: FSMT's decoder rows after
        # cross-attention combine two "batches" and are left untied.
        Mutant(T_ROW_PROVENANCE, "    entries[batch_dim] = ((\"t\", batch_key(size[0]), 0, 0, 1, size[0]),)",
               "    entries[batch_dim] = ((\"t\", src, 0, 0, 1, size[0]),)",
               tests=("theory_tests/kronecker/test_capture_masks.py::test_fsmt_layers_are_sequence_first_and_its_head_batch_first",)),
        # torch's recurrent layers' documented layout not applied (GRU's loop loses it).
        Mutant(T_CALLS, "                ctx.tracker.set_tag(out, tuple(tag[:-1]) + (None,))",
               "                pass",
               tests=("theory_tests/kronecker/test_capture_masks.py::test_recurrent_layers_keep_their_rows_layout",)),
        # embedding: the looked-up rows lose the indices' positions.
        Mutant(T_ROW_PROVENANCE, "    return (tuple(indices) if indices is not None else (None,) * args[1].dim()) + (None,)",
               "    return (None,) * args[1].dim() + (None,)"),
        # Matrix products: the right operand's tags taken for the rows.
        Mutant(T_ROW_PROVENANCE, "    rows = a[0] if a is not None else None\n    cols = b[1] if b is not None else None\n    return (rows, cols)",
               "    rows = b[0] if b is not None else None\n    cols = b[1] if b is not None else None\n    return (rows, cols)"),
    ],
    "PORT-SELFCHECK": [
        # A wrong mask: padding rows' gradient not looked at.
        Mutant(T_SELF_CHECK, "            pad = padding.amax() if padding.numel() else g.new_zeros(())",
               "            pad = padding.amax() * 0 if padding.numel() else g.new_zeros(())"),
        # A missed call: a backward through a use no hook captured passes.
        Mutant(T_SELF_CHECK, "            run.ratio = torch.where(observed != 0, math.inf, 0.0).to(dtype)",
               "            run.ratio = torch.where(observed != 0, 0.0, 0.0).to(dtype)"),
        # A second use of the weight: the comparison never fails.
        Mutant(T_SELF_CHECK, "            elif ratio > 1 and not math.isnan(ratio):",
               "            elif ratio > 1e300 and not math.isnan(ratio):"),
        # The rounding bound a million times too tight: right captures fail.
        Mutant(T_SELF_CHECK, "    return 2 * gamma + 3 * low_unit", "    return (2 * gamma + 3 * low_unit) * 1e-6"),
        # The weight side without the rows the mask dropped is not the padding check's.
        Mutant(T_SELF_CHECK, "            if verdict.get(\"padding\") == \"fail\" and ratio > 1:",
               "            if False:"),
    ],
    "PORT-CAPTURE-SHAPES": [
        Mutant(T_CAPTURE, "            if state == \"eval\":\n                if output.requires_grad:\n                    self.eval_seen.add(layer.name)",
               "            if state == \"eval\":\n                if output.requires_grad:\n                    pass"),
    ],
    "MOE-MKOR": [
        # the rows recomputed outside the forward's autocast (float32 rows of a bf16 forward)
        Mutant(T_EXPERTS, "with torch.autocast(autocast[0], dtype=autocast[1], enabled=autocast[2]):",
               "with torch.autocast(autocast[0], dtype=autocast[1], enabled=False):"),
        # a pair's mask read in slot-major order instead of its token's
        Mutant(T_EXPERTS, "            mask = None if found.mask is None else found.mask[token]",
               "            mask = None if found.mask is None else found.mask.repeat(token.numel() // found.mask.numel())"),
        # the row tracker's mask cache keyed without the rows' shape: flattened rows (a MoE
        # block's input, Qwen2-MoE's shared expert) get the (B, T) mask of earlier rows
        Mutant(T_ROW_PROVENANCE, "    key = (src, tuple(flat), tuple(lead))", "    key = (src, tuple(flat))"),
        # the self-check's weight test summed over the stack (blind to a gradient moved
        # between experts)
        Mutant(T_SELF_CHECK, "                 torch.randn(layer.experts, generator=g, dtype=torch.float64).to(device, dtype))",
               "                 torch.ones(layer.experts, dtype=torch.float64).to(device, dtype))"),
    ],
    "MOE-TITAN": [
        # the shared capture: every projection given the first projection's rows
        Mutant(T_EXPERTS, "            for layer, (a, g) in zip(layers, rows):",
               "            for layer, (a, g) in zip(layers, rows[:1] * len(rows)):"),
    ],
    "PORT-ACCELERATE-FSDP2": [
        # re-hooking re-registers nothing
        Mutant(T_CAPTURE, "        self._weight_handles = self._hook_weights()\n        self._handles.extend(self._weight_handles)\n\n    def remove",
               "        self._weight_handles = []\n\n    def remove"),
    ],
}
