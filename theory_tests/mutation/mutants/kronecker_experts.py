"""Mutants of the engine's fused-experts layouts (``torch_impl/kronecker/experts/``), keyed by the
``paper_notes/claims.md`` row whose tests must kill them (``theory_tests/mutation/mutant.py``
says what a mutant is)."""
from ..mutant import Mutant

__all__ = ["MUTANTS"]

T_TORCHTITAN = "torch_impl/kronecker/experts/torchtitan.py"
T_TRANSFORMERS = "torch_impl/kronecker/experts/transformers.py"


MUTANTS = {
    "MOE-MKOR": [
        # the routing weight left out of the gradient rows (down and, through it, up)
        Mutant(T_TRANSFORMERS, "        g_y = (w.to(grad_out.dtype) * grad_out.detach()[token]).to(y_dtype)",
               "        g_y = grad_out.detach()[token].to(y_dtype)"),
        # the down projection fed the gate's input instead of its output
        Mutant(T_TRANSFORMERS, "    return token, expert, [(x, g_h), (a2.detach(), g_y.detach())]",
               "    return token, expert, [(x, g_h), (h.detach()[:, :a2.shape[1]], g_y.detach())]"),
        # the up projection's gradient rows taken after its float32 bias, not of its product
        Mutant(T_TRANSFORMERS, "    g_h = g_h.detach().to(product_dtype(x, up.weight))\n",
               "    g_h = g_h.detach()\n"),
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
        Mutant(T_TORCHTITAN, "        w1, w3, w2 = (getattr(module, p).detach().to(dtype) for p in _PARAMS)",
               "        w3, w1, w2 = (getattr(module, p).detach().to(dtype) for p in _PARAMS)"),
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
        Mutant(T_TORCHTITAN, "            if getattr(type(module), method) is not getattr(base, method) or \\\n"
                     "                    method in vars(module):",
               "            if method in vars(module):"),
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
        Mutant(T_TORCHTITAN, "        if any(_dtensor(getattr(module, n)) for n in _PARAMS):",
               "        if False:"),
    ],
}
