"""Mutants of low-precision optimizer state (issue 47): the stochastic rounding rule and its
streams (LP1, LP2), the optimizers' storage options (state_dtype on MARS-M and LAMB,
state_rounding, kahan_sum), keyed by the ``paper_notes/claims.md`` row whose tests must kill
them."""
from ..mutant import Mutant

__all__ = ["MUTANTS"]

R_ROUND = "reference/common/rounding.py"
T_ROUND = "torch_impl/common/rounding.py"
T_LAMB = "torch_impl/baselines/lamb.py"
T_STORAGE = "torch_impl/common/state_storage.py"
T_EXACT = "torch_impl/mars/exact_mode.py"
T_QUANTIZED = "torch_impl/common/quantized_state.py"
_WORDS = '        words = (seed, group_index, position, name_word(name), int(st["step"]))'
T_MARS_M = "torch_impl/mars/mars_m.py"
_KEEPING = ("        state_storage.load_state_dict_keeping_storage(self, super().load_state_dict,\n"
            "                                                      state_dict)\n")

MUTANTS = {
    "LP1": [
        # the oracle rounds toward zero's neighbour lo always (truncation, biased)
        Mutant(R_ROUND, "return np.where(u < p_up, hi, lo)", "return np.where(u < 0, hi, lo)"),
        # the oracle's probability of rounding up reversed: P(hi) = (hi - x)/(hi - lo)
        Mutant(R_ROUND, "p_up = np.divide(np.asarray(x) - lo, gap,",
               "p_up = np.divide(hi - np.asarray(x), gap,"),
        # the port's rule rounds up with the complement probability
        Mutant(T_ROUND, "up = u < (x - lo) / (hi - lo)", "up = u >= (x - lo) / (hi - lo)"),
        # the bf16 bit path truncates: rounding toward zero instead of stochastic
        Mutant(T_ROUND, "bits = (x.contiguous().view(torch.int32) + r).bitwise_and_(-65536)",
               "bits = (x.contiguous().view(torch.int32) + 0 * r).bitwise_and_(-65536)"),
        # the bit path adds 15 random bits: P(up) halved
        Mutant(T_ROUND, "r = torch.randint(0, 1 << 16, x.shape,", "r = torch.randint(0, 1 << 15, x.shape,"),
        # overflow rounds stochastically to the largest finite value (hides an overflow)
        Mutant(T_ROUND, "keep = torch.isfinite(x) & (x.abs() <= torch.finfo(torch.bfloat16).max)",
               "keep = torch.isfinite(x)"),
    ],
    "LP2": [
        # every word after the first ignored: all tensors, buffers and steps share one stream
        Mutant(T_ROUND, "        h = _splitmix64(h ^ (int(w) & _MASK64))",
               "        h = h or _splitmix64(h ^ (int(w) & _MASK64))"),
        # the seed not used: the generator's default stream for every write
        Mutant(T_ROUND, "    g.manual_seed(seed)\n", "    g.manual_seed(0)\n"),
    ],
    "LP3": [
        # the compensation not added back: x = p, c is written but never read
        Mutant(T_STORAGE, "                x.add_(comp)  # LP3: the lost low bits back",
               "                pass  # LP3: the lost low bits back"),
        # the compensation not updated: it stays 0 (plain round-to-nearest parameters)
        Mutant(T_STORAGE, "        comp.copy_(working.sub(stored))", "        comp.zero_()"),
        # c' = RN(x - p) with the old p (before the write): the wrong residual
        Mutant(T_STORAGE, "    stored.copy_(working)\n    if comp is not None:  # LP3: what RN(x) lost, itself rounded to the parameter's dtype\n        comp.copy_(working.sub(stored))",
               "    if comp is not None:  # LP3: what RN(x) lost, itself rounded to the parameter's dtype\n        comp.copy_(working.sub(stored))\n    stored.copy_(working)"),
        # with stochastic rounding on, the Kahan parameter is written stochastically (and its
        # compensation never updated)
        Mutant(T_STORAGE, "        if comp is not None or stored.dtype not in ROUNDING_DTYPES:",
               "        if stored.dtype not in ROUNDING_DTYPES:"),
    ],
    "KAHAN-PORT": [
        # float32 parameters given a compensation buffer (memory for nothing)
        Mutant(T_STORAGE, '    return group["kahan_sum"] and p.dtype in ROUNDING_DTYPES',
               '    return group["kahan_sum"]'),
        # the step of a Kahan parameter not widened: bf16 arithmetic, no compensation at all
        Mutant(T_STORAGE, '    if group["state_rounding"] == "stochastic" or kahan_applies(p, group) or \\',
               '    if group["state_rounding"] == "stochastic" or \\'),
        # the buffer kept when kahan_sum is turned off
        Mutant(T_STORAGE, "        st.pop(KAHAN, None)", "        pass"),
        # init_state (and the step) never create the buffer: Kahan silently off
        Mutant(T_STORAGE, "            st[KAHAN] = torch.zeros_like(p, memory_format=torch.preserve_format)",
               "            pass"),
    ],
    "STATE-ROUNDING-PORT": [
        # the write-back rounds toward zero (truncates the float32 bits) instead of by LP1
        Mutant(T_STORAGE, "    stored.copy_(stochastic_round(working, stored.dtype, stream_seed(*words)))",
               "    stored.copy_((working.view(torch.int32) & -65536).view(torch.float32).to(stored.dtype))"),
        # one stream shared by the tensors of a group (the position dropped from the seed)
        Mutant(T_STORAGE, _WORDS, _WORDS.replace("group_index, position,", "group_index, 0,")),
        # ... by the groups (the group index dropped)
        Mutant(T_STORAGE, _WORDS, _WORDS.replace("group_index, position,", "0, position,")),
        # the step word dropped: the same stream at every step
        Mutant(T_STORAGE, _WORDS, _WORDS.replace('int(st["step"]))', "0)")),
        # the buffer's name dropped: m, v and last_grad of a tensor share a stream
        Mutant(T_STORAGE, _WORDS, _WORDS.replace("name_word(name)", 'name_word("")')),
        # a 16-bit parameter written to nearest under stochastic rounding
        Mutant(T_STORAGE, "        if comp is not None or stored.dtype not in ROUNDING_DTYPES:",
               "        if comp is not None or stored.dtype not in ROUNDING_DTYPES or name == PARAM:"),
        # the step computes in the narrow dtype (bf16 parameters with bf16 state)
        Mutant(T_STORAGE, "        dtype = torch.promote_types(dtype, torch.float32)", "        dtype = dtype"),
        # every optimizer takes the same default stream
        Mutant(T_STORAGE, '        optimizer.defaults["rounding_seed"] = default_rounding_seed()',
               '        optimizer.defaults["rounding_seed"] = 0'),
        # exact mode's g_prev refill written to nearest
        Mutant(T_STORAGE, "            value.dtype.itemsize > stored.dtype.itemsize:",
               "            False:"),
        # ... with the stream of the step that wrote it, not of the step that reads it
        Mutant(T_EXACT, '                            G_PREV, float(st.get("step", 0)) + 1)',
               '                            G_PREV, float(st.get("step", 0)))'),
        # the shards of a DTensor share one stream (the mesh coordinate dropped)
        Mutant(T_STORAGE, "stream_seed(*words, *coordinate)", "stream_seed(*words)"),
        # a group that cannot round accepted (float32 state: stochastic silently does nothing)
        Mutant(T_STORAGE, "            _check_roundable(p, stored_dtype(p, group))", "            pass"),
    ],
    "QUANT8-STATE-PORT": [
        # a second moment on the signed map (half its codes never used)
        Mutant(T_QUANTIZED, '"exp_avg_sq": False, "max_exp_avg_sq": False,',
               '"exp_avg_sq": True, "max_exp_avg_sq": False,'),
        Mutant(T_QUANTIZED, '"momentum_buffer": True, "moment1": True, "moment2": False}',
               '"momentum_buffer": False, "moment1": True, "moment2": False}'),
        # the step reads zeros instead of the dequantized moment
        Mutant(T_STORAGE, "                t = quantized_state.dequantize(st, name, self.group, dtype)",
               "                t = torch.zeros_like(p, dtype=dtype)"),
        # the new moment never quantized back (nearest and stochastic write-backs)
        Mutant(T_STORAGE, "                quantized_state.quantize_into(st, name, self.group, working)",
               "                pass"),
        Mutant(T_STORAGE, "            quantized_state.quantize_into(st, name, group, working)",
               "            pass"),
        # torch's load casts the codes to the parameter's floating dtype
        Mutant(T_STORAGE, "                            torch.is_tensor(value) and quantized_state.is_quantized_entry(key))",
               "                            False)"),
        # the scales loaded in the state dtype (bf16 for a bf16 parameter)
        Mutant(T_STORAGE, "        dtype = torch.uint8 if key.endswith(quantized_state.CODES) else torch.float32",
               "        dtype = torch.uint8 if key.endswith(quantized_state.CODES) else (group[\"state_dtype\"] or p.dtype)"),
        # the step of a bf16 parameter computed in bf16 on the dequantized moments
        Mutant(T_STORAGE, '            group.get("state_quantization"):', "            False:"),
        # a tensor smaller than a block accepted
        Mutant(T_QUANTIZED, "        if p.numel() < block:", "        if False:"),
        # a changed block size accepted (the scales then belong to other blocks)
        Mutant(T_QUANTIZED, "        if st[name + ABSMAX].numel() != blocks:", "        if False:"),
        # the codes written with another block size than the scales were read with
        Mutant(T_QUANTIZED, '    codes, absmax = quantize_blockwise(values, _code(name, values.device), group["block_size"])',
               '    codes, absmax = quantize_blockwise(values, _code(name, values.device), 256)'),
    ],
    # state_dtype on MARS-M and LAMB (MARS's own mutants: mutants/mars.py, same row)
    "PORT-STATE-DTYPE": [
        # the working copies never written back: the stored state stays as it was
        Mutant(T_MARS_M, "            back.finish()  # each copy rounded back into its stored tensor",
               "            pass  # each copy rounded back into its stored tensor"),
        Mutant(T_LAMB, "            back.finish()\n", "            pass\n"),
        # torch's own load: the state cast to the parameter's dtype
        Mutant(T_MARS_M, _KEEPING, "        super().load_state_dict(state_dict)\n"),
        Mutant(T_LAMB, _KEEPING, "        super().load_state_dict(state_dict)\n"),
        # LAMB's state created in the parameter's dtype whatever state_dtype says
        Mutant(T_LAMB, '            state_storage.ensure_state(state, p, group, ("exp_avg", "exp_avg_sq"))',
               '            state_storage.ensure_state(state, p, dict(group, state_dtype=None), '
               '("exp_avg", "exp_avg_sq"))'),
    ],
}
