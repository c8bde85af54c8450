"""Mutants of the Kronecker engine MKOR and K-FAC share (``torch_impl/kronecker/``: the optimizer
base, discovery, layer types, FSDP2 placement, the exchange, the state layout), keyed by the
``paper_notes/claims.md`` row whose tests must kill them (``theory_tests/mutation/mutant.py``
says what a mutant is)."""
from ..mutant import Mutant

__all__ = ["MUTANTS"]

T_DISCOVERY = "torch_impl/kronecker/discovery.py"
T_EXCHANGE = "torch_impl/kronecker/exchange.py"
T_LAYERS = "torch_impl/kronecker/layers.py"
T_OPTIMIZER = "torch_impl/kronecker/optimizer.py"
T_PLACEMENT = "torch_impl/kronecker/placement.py"
T_STATE_LAYOUT = "torch_impl/kronecker/state_layout.py"

_POW2 = "2.0 ** round(__import__(\"math\").log2(scale))"
_REFUSALS = '    def __reduce_ex__(self, protocol, /):\n        self._refuse_copy()\n\n    def __reduce__(self, /):\n        self._refuse_copy()\n\n    def __getstate__(self):\n        self._refuse_copy()\n\n    __copy__ = __deepcopy__ = _refuse_copy'

MUTANTS = {
    "PORT-ATOMIC": [
        # MKOR / K-FAC precondition (factors, step count, every .grad) before the backbone
        # refuses a group.
        Mutant("torch_impl/kronecker/optimizer.py",
               "        self._check_backbone_groups()\n        if not self._amp_step():",
               "        if not self._amp_step():",
               tests=("theory_tests/common/test_atomic_refusals.py",)),
        # another class's _check_groups is not assumed to be this library's
        Mutant("torch_impl/kronecker/optimizer.py",
               "        if check is not None and cls.__module__.startswith(\"torch_impl.\"):",
               "        if check is not None:",
               tests=("theory_tests/common/test_atomic_refusals.py::test_a_foreign_backbones_check_groups_is_not_assumed_to_be_ours",)),
    ],
    "K1": [
        Mutant(T_DISCOVERY, "if reason is None and len(owners.get(id(weight), ())) > 1:",
               "if reason is None and len(owners.get(id(weight), ())) > 2:"),
        Mutant(T_LAYERS, "        return isinstance(module, self.classes or nn.Linear)\n",
               "        return type(module) in (self.classes or (nn.Linear,))\n"),
    ],
    "K3-K6": [
        Mutant(T_LAYERS, "        return patches.transpose(1, 2)", "        return patches.flip(1).transpose(1, 2)",
               tests=("theory_tests/kronecker/test_capture_hooks.py::test_conv_vectors_match_explicit_unfold",)),
    ],
    "K5": [
        Mutant(T_OPTIMIZER, "            self._step_scale = scale\n", "            self._step_scale = 1.0\n",
               tests=("theory_tests/kronecker/test_grad_scaler.py::test_grad_scaler_matches_unscaled_loop_bitwise",)),
        # Shared by MKOR and K-FAC (the wrapper): a scale rounded to a power of two, exact for
        # 2^k, so only a test with another scale (1000, 3.7) can see it.
        Mutant(T_OPTIMIZER, "        self._grad_scale = scale\n", f"        self._grad_scale = {_POW2}\n",
               also=((T_OPTIMIZER, "            self._step_scale = scale\n",
                      f"            self._step_scale = {_POW2}\n"),)),
    ],
    "K15": [
        Mutant(T_OPTIMIZER, "        self.precondition()\n        self.optimizer.step()\n",
               "        self.precondition()\n"),
    ],
    "KT12": [
        Mutant(T_EXCHANGE, "            mean = buffer[start:start + sum(sizes)].to(out_dtype) / count.clamp(min=1)",
               "            mean = buffer[start:start + sum(sizes)].to(out_dtype)"),
        Mutant(T_EXCHANGE, "        return self.numel * torch.empty((), dtype=self.dtype).element_size()",
               "        return self.numel * 4"),
        # The summed row count read from the wrong slot: the union's mean divides by 1.
        Mutant(T_EXCHANGE, "                        buffer[at].to(out_dtype)))", "                        buffer[at].to(out_dtype) * 0 + 1))"),
    ],
    "PORT-LAYERS": [
        Mutant(T_LAYERS, "        return weight_like.T\n", "        return weight_like.T.flip(0)\n",
               tests=("theory_tests/kronecker/test_hf_models.py::test_conv1d_preconditioned_gradient_is_the_formula",)),
        Mutant(T_DISCOVERY, "self.has_bias = module.bias is not None and module.bias.requires_grad",
               "self.has_bias = module.bias is not None"),
    ],
    "PORT-COPY": [
        # every refusal but copy.copy's gone (deepcopy and pickle fall through to object's)
        Mutant(T_OPTIMIZER, _REFUSALS, "    __copy__ = _refuse_copy"),
    ],
    "PORT-SELFCHECK": [
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
        Mutant(T_DISCOVERY, "        if reason is None and layer_type is not None and 0 in layer_type.shape(module):",
               "        if False:"),
        # discovery follows the model: a layer unfrozen later is never told
        Mutant(T_OPTIMIZER, "            if weight.requires_grad and weight.grad is not None and \\",
               "            if False and \\"),
    ],
    "PORT-FSDP2": [
        # the rank's rows never written back: FSDP2 steps the raw gradient
        Mutant(T_PLACEMENT, "    shard.to_local().copy_(mine.to_local())", "    pass"),
        # the gather skipped: the local rows preconditioned as if whole
        Mutant(T_PLACEMENT, "        self.weight, self.bias = (g.full_tensor() if is_dtensor(g) else g",
               "        self.weight, self.bias = (g.to_local() if is_dtensor(g) else g"),
        # a sharding the hooks cannot see whole let through
        Mutant(T_PLACEMENT, "    return placements == (Shard(0),) or placements == (Replicate(), Shard(0))",
               "    return True"),
        Mutant(T_PLACEMENT, "            if not under_fsdp or not _placement_ok(p):",
               "            if not _placement_ok(p):"),
        Mutant(T_PLACEMENT, "                    out[r][:n] = full[r * chunk:r * chunk + n]",
               "                    out[r][:n] = full[:n]"),
        Mutant(T_PLACEMENT, "    return dist.get_rank(group) == rank", "    return True"),
        # HSDP's (Replicate(), Shard(0)) refused; owner placement let onto a 2-D mesh
        Mutant(T_PLACEMENT, "    return placements == (Shard(0),) or placements == (Replicate(), Shard(0))",
               "    return placements == (Shard(0),)"),
        Mutant(T_PLACEMENT, "    if mesh.ndim != 1 or any(l.module.weight.device_mesh != mesh for l in sharded):",
               "    if any(l.module.weight.device_mesh != mesh for l in sharded):"),
    ],
    "PORT-DCP": [
        # one rank's state dict of owner-placed factors loaded without the pointer to DCP
        Mutant(T_PLACEMENT, "    if not saved:\n        raise ValueError(f\"{name}: the state_dict holds no state",
               "    if False:\n        raise ValueError(f\"{name}: the state_dict holds no state"),
        # MKOR's / K-FAC's state not carried where DCP keeps it, or not taken back from there
        Mutant("torch_impl/kronecker/optimizer.py", "            packed[i] = dict(packed.get(i, {}), **entry)",
               "            packed[i] = dict(packed.get(i, {}))"),
        Mutant("torch_impl/kronecker/optimizer.py", "            own = placed if placed is not None else own", "            own = own"),
        # each layer's state loaded into the layer after it (the saved keys matched by order)
        Mutant("torch_impl/kronecker/state_layout.py", "    return {id(p): k for p, k in zip(live, saved)}",
               "    return {id(p): k for p, k in zip(live, saved[1:] + saved[:1])}"),
        # the run's counters not laid out
        Mutant("torch_impl/kronecker/state_layout.py", "    if first is not None:\n        entries.setdefault(first, {})[run_key(key)]",
               "    if first is None:\n        entries.setdefault(first, {})[run_key(key)]"),
        # a keyword of the wrapper's own beside torch's step signature
        Mutant("torch_impl/kronecker/optimizer.py", "    def step(self, closure=None):", "    def step(self, closure=None, *, loss=None):"),
    ],
    "MOE-DISCOVERY": [
        # the router left with the generic reason
        Mutant("torch_impl/kronecker/discovery.py", "        if name in routers:\n",
               "        if False:\n"),
    ],
    "DISCOVERY-NAMES": [
        # every nn.Linear subclass taken for x W^T + b (PhiMoE's router, DeepSeek-V4's grouped
        # linear preconditioned again)
        Mutant(T_LAYERS, "        owner = forward_owner(type(module))\n", "        owner = nn.Linear\n"),
        # the class itself taken for the forward's owner: a subclass that only changes its
        # construction, or inherits a declared forward, refused
        Mutant(T_LAYERS, '    return next(c for c in cls.__mro__ if "forward" in vars(c))',
               "    return cls"),
        # a registered LinearType(cls) declares nothing
        Mutant(T_LAYERS, "if owner is nn.Linear or owner in self.classes or",
               "if owner is nn.Linear or False or"),
        # the known products' table not read (FalconLinear refused)
        Mutant(T_LAYERS, "_qualified(owner) in _KNOWN_LINEAR_PRODUCTS:", "_qualified(owner) in ():"),
        # a fused experts module's own name no longer skips its projections
        Mutant(T_DISCOVERY, "                        or within is not None and fnmatch.fnmatchcase(within, p)), None)",
               "                        ), None)"),
        # a pattern that matches nothing accepted in silence
        Mutant(T_DISCOVERY, "    if unmatched:\n", "    if False:\n"),
        # projection names not among the names a pattern may match
        Mutant(T_DISCOVERY, "            names.extend(prefix + p for p, _ in module.named_parameters(recurse=False))\n",
               "            pass\n"),
        # module names not among them
        Mutant(T_DISCOVERY, "        names.append(name)\n        if name in routers:",
               "        pass\n        if name in routers:"),
        # one string split into its letters
        Mutant(T_DISCOVERY, "    skip = (skip,) if isinstance(skip, str) else tuple(skip)",
               "    skip = tuple(skip)"),
        # the error's hints gone
        Mutant(T_DISCOVERY, "        if holders:\n", "        if False:\n"),
        Mutant(T_DISCOVERY, "        near = difflib.get_close_matches(pattern, names, n=3)",
               "        near = []"),
    ],
    "PORT-ACCELERATE-FSDP2": [
        # identity test inverted inside moved()
        Mutant(T_PLACEMENT, "any(r() is not p for r, p in zip(refs, now))",
               "any(r() is p and False for r, p in zip(refs, now))"),
        # an optimizer still holding the old tensors trains in silence
        Mutant(T_PLACEMENT, "        if stale:\n            raise RuntimeError(",
               "        if False:\n            raise RuntimeError("),
        # owner placement not redone: every rank keeps every layer
        Mutant(T_PLACEMENT, "                pre._state[name] = {}  # another rank keeps",
               "                pass  # another rank keeps"),
        # the capture's weight hooks left on the replaced parameters
        Mutant(T_PLACEMENT, "        pre._capture.rehook_weights()\n", "\n"),
    ],
    "PORT-STEP-HOOKS": [
        # the backbone stepped past torch's hook wrapper: its hooks (and global ones) skipped
        Mutant(T_OPTIMIZER, "        self.precondition()\n        self.optimizer.step()",
               "        self.precondition()\n        type(self.optimizer).step.__wrapped__(self.optimizer)"),
    ],
    "PRECOND-STATE-LAYOUT": [
        # the preconditioner's entries never added to the state dict
        Mutant(T_OPTIMIZER, "            packed[i] = dict(packed.get(i, {}), **entry)",
               "            packed[i] = dict(packed.get(i, {}))"),
        # the run's counters (step count, switch) not laid on the first parameter
        Mutant(T_STATE_LAYOUT, "    if first is not None:\n        entries.setdefault(first, {})",
               "    if False:\n        entries.setdefault(first, {})"),
        # a layer's saved state not taken back
        Mutant(T_STATE_LAYOUT, "            layers[name] = found", "            pass"),
        # the checkpoint's parameters matched to the live ones in the wrong order
        Mutant(T_STATE_LAYOUT, "    return {id(p): k for p, k in zip(live, saved)}",
               "    return {id(p): k for p, k in zip(live, reversed(saved))}"),
        # MKOR's init_state leaves the backbone's state to DCP's counted init step
        Mutant(T_OPTIMIZER, "        init_backbone_state(self.optimizer)\n", "        pass\n"),
    ],
}
