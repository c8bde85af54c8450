"""Mutants of torchtitan's ``GroupedExperts`` as three expert stacks
(``torch_impl/kronecker/experts/torchtitan.py``), keyed by the ``paper_notes/claims.md`` row whose tests
must kill them (``mutant.Mutant``'s format). Each breaks one line: a row of the wrong branch or
expert, the silu derivative dropped, the bf16 products dropped, the structure check loosened,
expert parallelism let through."""
from .mutant import Mutant

__all__ = ["GROUPED_EXPERTS_MUTANTS"]

T_TE = "torch_impl/kronecker/experts/torchtitan.py"
T_EC = "torch_impl/kronecker/capture/experts.py"

GROUPED_EXPERTS_MUTANTS = {
    "MOE-TITAN": [
        # the wrong branch's gradient: w1 given dL/du3, w3 given dL/du1
        Mutant(T_TE, "            g1, g3 = torch.autograd.grad(h, (u1, u3), g_h.to(h.dtype))",
               "            g3, g1 = torch.autograd.grad(h, (u1, u3), g_h.to(h.dtype))"),
        # the silu derivative dropped from w1's gradient rows
        Mutant(T_TE, "            g1, g3 = torch.autograd.grad(h, (u1, u3), g_h.to(h.dtype))",
               "            g1, g3 = g_h * u3, g_h * F.silu(u1)"),
        # w1 and w3 swapped in the recompute
        Mutant(T_TE, "        w1, w3, w2 = (getattr(module, p).detach().to(dtype) for p in _PARAMS)",
               "        w3, w1, w2 = (getattr(module, p).detach().to(dtype) for p in _PARAMS)"),
        # the offsets off by one: each expert's segment starts a row early
        Mutant(T_TE, "        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)",
               "        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32) - 1"),
        # the rows labelled with the next expert
        Mutant(T_TE, "        expert = torch.repeat_interleave(torch.arange(E, device=x.device),",
               "        expert = torch.repeat_interleave(torch.arange(E, device=x.device).roll(1),"),
        # the bf16 cast dropped: the rows of float32 products, not the forward's bf16 ones
        Mutant(T_TE, "        dtype = torch.bfloat16  # GroupedExperts casts x and W to it before each product",
               "        dtype = torch.float32"),
        # w2's output-gradient rows not rounded to the product's dtype (the cast's backward)
        Mutant(T_TE, "                               (h.detach(), g_out)]",
               "                               (h.detach(), grad_out.detach()[:S])]"),
        # the structure check loosened: a subclass's own _grouped_mm / forward accepted
        Mutant(T_TE, "            if getattr(type(module), method) is not getattr(base, method) or \\\n"
                     "                    method in vars(module):",
               "            if method in vars(module):"),
        # any class named GroupedExperts taken for torchtitan's
        Mutant(T_TE, "                 if c.__module__ == _MODULE and c.__qualname__ == _CLASS), None)",
               "                 if c.__qualname__ == _CLASS), None)"),
        # the shape check loosened: w2 not checked against (E, D, F)
        Mutant(T_TE, "        if tuple(w3.shape) != (E, f, d) or tuple(w2.shape) != (E, d, f):",
               "        if tuple(w3.shape) != (E, f, d):"),
        # an extra parameter let through
        Mutant(T_TE, "        if sorted(params) != sorted(_PARAMS):",
               "        if not set(_PARAMS) <= set(params):"),
        # expert parallelism let through: an EP dispatcher with its mesh wired
        Mutant(T_TE, "                                           and getattr(dispatcher, \"ep_mesh\", 0) is None)",
               "                                           )"),
        # expert parallelism let through: DTensor parameters at capture
        Mutant(T_TE, "        if any(_dtensor(getattr(module, n)) for n in _PARAMS):",
               "        if False:"),
        # the shared capture: every projection given the first projection's rows
        Mutant(T_EC, "            for layer, (a, g) in zip(layers, rows):",
               "            for layer, (a, g) in zip(layers, rows[:1] * len(rows)):"),
    ],
}
