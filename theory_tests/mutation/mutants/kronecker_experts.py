"""Mutants of the engine's fused-experts layouts (``torch_impl/kronecker/experts/``), keyed by the
``paper_notes/claims.md`` row whose tests must kill them (``theory_tests/mutation/mutant.py``
says what a mutant is)."""
from ..mutant import Mutant

__all__ = ["MUTANTS"]

T_TORCHTITAN = "torch_impl/kronecker/experts/torchtitan.py"
T_TRANSFORMERS = "torch_impl/kronecker/experts/transformers.py"
T_RECOMPUTE = "torch_impl/kronecker/experts/recompute.py"
T_ARITHMETIC = "torch_impl/kronecker/experts/arithmetic.py"
T_PARALLEL = "torch_impl/kronecker/experts/parallel.py"
T_HF_EP = "torch_impl/kronecker/experts/transformers_ep.py"
T_PLACEMENT = "torch_impl/kronecker/placement.py"
T_MKOR = "torch_impl/mkor/preconditioner.py"
T_KFAC = "torch_impl/baselines/kfac.py"
T_CONTAINER = "torch_impl/integrations/torchtitan.py"
EP_TWO = ("theory_tests/distributed/test_kronecker_ep.py::test_two_ep_ranks_train_as_one_process",)
HF_EP = "theory_tests/distributed/test_kronecker_ep_transformers.py::"
HF_EP_TWO = (HF_EP + "test_two_ep_ranks_train_as_one_process",)
HF_EP_EMPTY = (HF_EP + "test_a_rank_whose_chunk_gets_no_row",)
HF_EP_REFUSED = (HF_EP + "test_other_ep_layouts_are_refused_with_the_reason",)


MUTANTS = {
    "MOE-MKOR": [
        # the routing weight left out of the gradient rows (down and, through it, up)
        Mutant(T_RECOMPUTE, "        g_z = (g_w * weights.to(weighted)).to(z.dtype)",
               "        g_z = g_w.to(z.dtype)"),
        # the down projection fed the gate's input instead of its output
        Mutant(T_RECOMPUTE, " (a_down, g_y.detach())]",
               " (h.detach()[:, :a_down.shape[1]].to(a_down.dtype), g_y.detach())]"),
        # the up projection's gradient rows taken after its float32 bias, not of its product
        Mutant(T_RECOMPUTE, "    return [(a_up, g_h.detach().to(p_up.dtype)),",
               "    return [(a_up, g_h.detach()),"),
    ],
    "MOE-ARITH": [
        # a recompute in the wrong dtype: the rows rounded as the rule assumed before (the
        # autocast dtype, else the promoted one), not as the forward's product had them
        Mutant(T_TRANSFORMERS, "    if arithmetic is None:\n        arithmetic = _nothing_multiplied(module, hidden)",
               "    if True:\n        arithmetic = _nothing_multiplied(module, hidden)"),
        # under autocast, the a rows taken as autocast's copy, not as the layer's input
        Mutant(T_RECOMPUTE, "    if torch.is_autocast_enabled(device) and product.dtype == torch.get_autocast_dtype(device):",
               "    if False:"),
        # the products recomputed under the forward's autocast (grouped_mm's are not)
        Mutant(T_RECOMPUTE, "    with torch.autocast(device, enabled=False):\n        h = up.forward(x.to(p_up.dtype))",
               "    with torch.autocast(device, enabled=torch.is_autocast_enabled(device)):\n"
               "        h = up.forward(x.to(p_up.dtype))"),
        # the output gradient not rounded to the forward's accumulator (Inkling2's float32)
        Mutant(T_RECOMPUTE, "        g_w = g_out.to(arithmetic.accumulator).to(weighted)",
               "        g_w = g_out.to(weighted)"),
        # the accumulator read as the output's dtype, the cast before it not seen
        Mutant(T_ARITHMETIC, "        accumulator = self.cast_from.get(ptr, output.dtype) if ptr is not None else output.dtype",
               "        accumulator = output.dtype"),
        # the eager loop's structure ignored: every pair gated at once, not expert by expert
        Mutant(T_TRANSFORMERS, "    if not arithmetic.per_expert:  # a stack multiplied at once",
               "    if True:  # a stack multiplied at once"),
        # an in-place bias add (batched_mm) not rounded to the product's dtype
        Mutant(T_RECOMPUTE, "    return y if bias is None else (y + bias.to(product.bias)).to(product.out)",
               "    return y if bias is None else (y + bias.to(product.bias))"),
        # an in-place bias add read as an out-of-place one (the promoted dtype)
        Mutant(T_ARITHMETIC, "            self.bias_adds[name].add((b.dtype, outs[0].dtype))",
               "            self.bias_adds[name].add((b.dtype, torch.promote_types(b.dtype, outs[0].dtype)))"),
        # a weight's cast (autocast's, the privacy filter's .float()) not followed
        Mutant(T_ARITHMETIC, "                for o in outs:\n                    self._set(o, (\"w\", name))",
               "                pass"),
    ],
    "MOE-DISCOVERY": [
        # a declared bias taken on trust
        Mutant(T_TRANSFORMERS, "        if module.has_bias and (b is None or tuple(b.shape) != (E, d_out)):",
               "        if False:"),
    ],
    "MOE-TITAN": [
        # the wrong branch's gradient: w1 given dL/du3, w3 given dL/du1
        Mutant(T_TORCHTITAN, "            g1, g3 = torch.autograd.grad(h, (u1, u3), g_h.to(h.dtype))",
               "            g3, g1 = torch.autograd.grad(h, (u1, u3), g_h.to(h.dtype))"),
        # the silu derivative dropped from w1's gradient rows
        Mutant(T_TORCHTITAN, "            g1, g3 = torch.autograd.grad(h, (u1, u3), g_h.to(h.dtype))",
               "            g1, g3 = g_h * u3, g_h * F.silu(u1)"),
        # w1 and w3 swapped in the recompute
        Mutant(T_TORCHTITAN, "        w1, w3, w2 = (_local_tensor(getattr(module, p)).detach().to(dtype) for p in _PARAMS)",
               "        w3, w1, w2 = (_local_tensor(getattr(module, p)).detach().to(dtype) for p in _PARAMS)"),
        # the offsets off by one: each expert's segment starts a row early
        Mutant(T_TORCHTITAN, "        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)",
               "        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32) - 1"),
        # the rows labelled with the next expert
        Mutant(T_TORCHTITAN, "        expert = torch.repeat_interleave(torch.arange(E, device=x.device),",
               "        expert = torch.repeat_interleave(torch.arange(E, device=x.device).roll(1),"),
        # the bf16 cast dropped: the rows of float32 products, not the forward's bf16 ones
        Mutant(T_TORCHTITAN, "        dtype = torch.bfloat16  # GroupedExperts casts x and W to it before each product",
               "        dtype = torch.float32"),
        # w2's output-gradient rows not rounded to the product's dtype (the cast's backward)
        Mutant(T_TORCHTITAN, "                               (h.detach(), g_out)]",
               "                               (h.detach(), grad_out.detach()[:S])]"),
        # the structure check loosened: a subclass's own _grouped_mm / forward accepted
        Mutant(T_TORCHTITAN, "            overridden = getattr(type(module), method) is not getattr(base, method)",
               "            overridden = False"),
        # any class named GroupedExperts taken for torchtitan's
        Mutant(T_TORCHTITAN, "                 if c.__module__ == _MODULE and c.__qualname__ == _CLASS), None)",
               "                 if c.__qualname__ == _CLASS), None)"),
        # the shape check loosened: w2 not checked against (E, D, F)
        Mutant(T_TORCHTITAN, "        if tuple(w3.shape) != (E, f, d) or tuple(w2.shape) != (E, d, f):",
               "        if tuple(w3.shape) != (E, f, d):"),
        # an extra parameter let through
        Mutant(T_TORCHTITAN, "        if sorted(params) != sorted(_PARAMS):",
               "        if not set(_PARAMS) <= set(params):"),
        # expert parallelism let through: an EP dispatcher with its mesh wired
        Mutant(T_TORCHTITAN, "                                           and getattr(dispatcher, \"ep_mesh\", 0) is None)",
               "                                           )"),
        # expert parallelism let through: DTensor parameters at capture
        Mutant(T_TORCHTITAN, "        if shard is None and any(_dtensor(getattr(module, n)) for n in _PARAMS):",
               "        if False:"),
    ],
    "EXPERT-PARALLEL": [
        # an expert's factors updated from another rank's rows: MKOR's stack sums all-reduced
        # over every rank (other chunks' experts added to this chunk's)
        Mutant(T_MKOR, "            VectorExchange(layers, model, o.exchange, layers[0].expert_shard.row_group, o.rank,",
               "            VectorExchange(layers, model, o.exchange, process_group, o.rank,",
               tests=EP_TWO),
        # the same for K-FAC's stack sums
        Mutant(T_KFAC, "        plan += [(None, layers, layers[0].expert_shard.row_group) for layers in by_rows.values()]",
               "        plan += [(None, layers, self.process_group) for layers in by_rows.values()]",
               tests=EP_TWO),
        # a local expert index taken as the global one: every rank's chunk read as the first
        Mutant(T_PARALLEL, "    return (c * per, (c + 1) * per)",
               "    return (0, per)", tests=EP_TWO),
        # a step that gathers what it should not: the stack's gradient gathered (and thrown
        # away) -- the values unchanged, only the collectives counted see it
        Mutant(T_PLACEMENT, "        self.weight, self.bias = (None if g is None else g.to_local() if is_dtensor(g) else g",
               "        self.weight, self.bias = (None if g is None else (g.full_tensor(), g.to_local())[1] if is_dtensor(g) else g",
               tests=EP_TWO),
        # K-FAC's KL clip summing only this rank's experts' terms (never all-reduced)
        Mutant(T_KFAC, "            if owner_placed or getattr(layer, \"expert_shard\", None) is not None:",
               "            if owner_placed:", tests=EP_TWO),
        # per-expert owners under FSDP2 dropped: the whole stack owned by one rank, its
        # gradient gathered there (a 3-D tensor moved in step())
        Mutant(T_PLACEMENT, "    if split_stacks:\n        from torch.distributed.tensor import Shard",
               "    if False:\n        from torch.distributed.tensor import Shard",
               tests=("theory_tests/distributed/test_mkor_experts.py::test_fsdp2_owner_placement_is_per_expert",)),
        # the data-parallel world read from the EP groups too: the container refuses the model
        Mutant(T_CONTAINER, "                if not _beyond_fsdp(group):\n                    worlds.add(world)",
               "                worlds.add(world)", tests=EP_TWO),
    ],
    "EXPERT-PARALLEL-HF": [
        # the module's own call hooked: this rank's tokens with global expert ids, whose rows
        # other ranks multiply
        Mutant(T_TRANSFORMERS, "        return DispatchedCall(dispatch)", "        return module",
               tests=HF_EP_TWO),
        # the recompute multiplying the parameters as they are (DTensors of all experts), not
        # the local chunk the dispatch's forward ran on
        Mutant(T_TRANSFORMERS, "                                        else _local_projections(module))",
               "                                        else expert_projections(module))",
               tests=HF_EP_TWO),
        # E read as the local count: the stacks' global shape contradicts it, the experts skipped
        Mutant(T_HF_EP, "        self.experts = module.num_experts * self.ep_mesh.size()",
               "        self.experts = module.num_experts", tests=HF_EP_TWO),
        # transformers' methods left wrapped after remove()
        Mutant(T_HF_EP, "            self.impl.experts_forward = self.original\n",
               "            pass\n", tests=HF_EP_TWO),
        # AllToAllEP's placeholder call on no received row read as one row of expert 0
        Mutant(T_HF_EP, "            return hidden[:0], top_k_index[:0], top_k_weights[:0]",
               "            return hidden, top_k_index, top_k_weights", tests=HF_EP_EMPTY),
        # a call with no pair given rows of no width (the self-check cannot multiply them)
        Mutant(T_TRANSFORMERS, "    if expert.numel() == 0:  # no pairs", "    if False:  # no pairs",
               tests=HF_EP_EMPTY),
        # AutoEP accepted with its all-reduce path (sentinel ids on a shared batch)
        Mutant(T_HF_EP, "        if impl.all_reduce is not None or impl.megamoe is not None:",
               "        if impl.megamoe is not None:", tests=HF_EP_REFUSED),
        # the dispatch's EP mesh not tied to the stacks' placements
        Mutant(T_TRANSFORMERS, "        why = ep_problem(E, _stacks(module), dispatch.ep_mesh)",
               "        why = None", tests=HF_EP_REFUSED),
    ],
}
