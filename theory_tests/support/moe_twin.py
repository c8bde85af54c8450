"""A "twin" of a transformers mixture-of-experts model whose experts are ``nn.Linear`` layers
(issue 31), and tiny fused-expert models to build it from.

transformers 5 stores a model's experts fused: one module (its class decorated by
``transformers.integrations.moe.use_experts_implementation``, which sets ``has_gate``,
``has_bias``, ``is_transposed``, ``is_concatenated``, ``has_post_expert_norm``) holds 3-D
parameters ``gate_up_proj`` (or ``up_proj``) and ``down_proj`` of leading size ``num_experts``.
``build_twin`` deep-copies a model and replaces every such module by a :class:`TwinExperts`
holding, per expert, ``nn.Linear`` copies of that expert's matrices and running the eager loop
over the experts that got tokens. The twin is the reference semantics of "each expert is its
own layer": a plain ``nn.Linear`` sees exactly the rows the fused expert should be
preconditioned with.

``fused_view`` / ``twin_grads_as_fused`` give the twin's parameters / gradients under the fused
model's parameter names and layout, so a fused model and its twin can be compared after
training or after one backward pass.
"""
import copy

import torch
import torch.nn as nn

__all__ = ["LAYOUT_FLAGS", "is_fused_experts", "fused_experts_modules", "TwinExperts",
           "build_twin", "set_unroute_mask", "fused_view", "twin_grads_as_fused",
           "tiny_moe_models", "FAMILIES", "lm_batch"]

#: what the decorator sets on every instance of a decorated experts class
LAYOUT_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated")
_SCALARS = (bool, int, float, str, type(None))


def _projection_names(module):
    """(up, down): the fused parameter names of the up (gate_up or up) and down projection."""
    return ("gate_up_proj" if module.has_gate else "up_proj"), "down_proj"


def is_fused_experts(module):
    """Whether ``module`` is a fused experts module: the decorator's layout attributes are set
    and its up and down projections are 3-D parameters of leading size ``num_experts``."""
    if not all(hasattr(module, flag) for flag in LAYOUT_FLAGS):
        return False
    num_experts = getattr(module, "num_experts", None)
    if not isinstance(num_experts, int):
        return False
    for name in _projection_names(module):
        weight = module._parameters.get(name)
        if weight is None or weight.dim() != 3 or weight.shape[0] != num_experts:
            return False
    return True


def fused_experts_modules(model):
    """[(name, module)] of every fused experts module of ``model``."""
    return [(name, m) for name, m in model.named_modules() if is_fused_experts(m)]


class TwinExpert(nn.Module):
    """One expert as ``nn.Linear`` layers: ``gate_up`` (with a gate) or ``up``, and ``down``."""

    def __init__(self, up_name, up, down):
        super().__init__()
        self.up_name = up_name
        setattr(self, up_name, up)
        self.down = down

    @property
    def up_linear(self):
        return getattr(self, self.up_name)


def _linear_copy(weight, bias, transposed):
    """An nn.Linear holding a copy of one expert's matrix ((d_out, d_in) after the transpose
    of the transposed layout) and bias."""
    matrix = weight.detach().mT if transposed else weight.detach()
    d_out, d_in = matrix.shape
    linear = nn.Linear(d_in, d_out, bias=bias is not None, dtype=matrix.dtype,
                       device=matrix.device)
    with torch.no_grad():
        linear.weight.copy_(matrix)
        if bias is not None:
            linear.bias.copy_(bias.detach())
    linear.weight.requires_grad_(weight.requires_grad)
    if bias is not None:
        linear.bias.requires_grad_(bias.requires_grad)
    return linear


class TwinExperts(nn.Module):
    """A fused experts module as ``nn.ModuleList`` of :class:`TwinExpert`, with the same
    forward ``(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k))``.

    The forward is the eager loop: for each expert e that got pairs (an expert routed nothing
    is not called), the pairs (slot, token) of ``torch.where((top_k_index == e).T)`` (the eager
    loop's slot-major order), h = up(x), a2 = the fused module's own ``_apply_gate(h)`` (bound
    to this module: it reads ``act_fn`` and the scalar attributes copied from the original,
    e.g. GPT-OSS's ``alpha`` and ``limit``) or ``act_fn(h)`` without a gate, y = down(a2), the
    post-expert norm if any, and ``out.index_add_(0, token, w * y)``.

    ``token_keep`` (None or a bool tensor with one entry per token, set by
    ``set_unroute_mask``) drops the pairs of the tokens it marks False from the loop.
    """

    def __init__(self, fused):
        super().__init__()
        up_name, down_name = _projection_names(fused)
        self.up_name, self.down_name = up_name, down_name
        for flag in LAYOUT_FLAGS + ("has_post_expert_norm",):
            setattr(self, flag, bool(getattr(fused, flag, False)))
        self.num_experts = fused.num_experts
        self.fused_class = type(fused).__name__
        # the fused module's parameter names, in its order (biases, norm weights included)
        self.fused_order = [name for name, _ in fused.named_parameters()]
        bias = (lambda name: getattr(fused, name + "_bias")) if self.has_bias else (lambda _: None)
        up, down = getattr(fused, up_name), getattr(fused, down_name)
        self.experts = nn.ModuleList(
            TwinExpert("gate_up" if self.has_gate else "up",
                       _linear_copy(up[e], None if bias(up_name) is None else bias(up_name)[e],
                                    self.is_transposed),
                       _linear_copy(down[e],
                                    None if bias(down_name) is None else bias(down_name)[e],
                                    self.is_transposed))
            for e in range(self.num_experts))
        # submodules the gate or the norm use (act_fn, post_expert_norm) keep their names
        for name, child in fused.named_children():
            setattr(self, name, child)
        # scalar attributes an _apply_gate may read (GPT-OSS: alpha, limit), and the config
        for name, value in vars(fused).items():
            if not name.startswith("_") and name != "training" and isinstance(value, _SCALARS):
                if not hasattr(self, name):
                    setattr(self, name, value)
        if "config" in vars(fused):
            self.config = fused.config
        self.gate_fn = type(fused)._apply_gate if self.has_gate else None
        self.token_keep = None

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        keep = self.token_keep
        if keep is not None and keep.numel() != hidden_states.shape[0]:
            raise ValueError(f"unroute mask has {keep.numel()} entries for "
                             f"{hidden_states.shape[0]} tokens")
        for e, expert in enumerate(self.experts):
            hit = top_k_index == e
            if keep is not None:
                hit = hit & keep.reshape(-1, 1).to(hit.device)
            slot, token = torch.where(hit.T)
            if token.numel() == 0:
                continue
            h = expert.up_linear(hidden_states[token])
            a2 = self.gate_fn(self, h) if self.has_gate else self.act_fn(h)
            y = expert.down(a2)
            if self.has_post_expert_norm:
                y = self.post_expert_norm(y)
            y = y * top_k_weights[token, slot, None]
            final.index_add_(0, token, y.to(final.dtype))
        return final

    def fused_tensors(self, get):
        """[(fused parameter name, tensor)] in the fused module's order: ``get`` applied to each
        expert's Linear weight (or bias), stacked in the fused layout ((E, d_in, d_out) when
        transposed); other parameters (a norm's weight) as they are. A stack whose ``get`` is
        None for every expert is None; a None among others is zeros (an expert not called)."""
        own = dict(self.named_parameters())
        linear_of = {self.up_name: lambda ex: ex.up_linear, self.down_name: lambda ex: ex.down}
        out = []
        for name in self.fused_order:
            base = name[:-len("_bias")] if name.endswith("_bias") else name
            if base not in linear_of:
                out.append((name, get(own[name])))
                continue
            parts = []
            for expert in self.experts:
                linear = linear_of[base](expert)
                p = linear.bias if name.endswith("_bias") else linear.weight
                parts.append((get(p), p))
            if all(t is None for t, _ in parts):
                out.append((name, None))
                continue
            tensors = [torch.zeros_like(p) if t is None else t for t, p in parts]
            if self.is_transposed and not name.endswith("_bias"):
                tensors = [t.mT for t in tensors]
            out.append((name, torch.stack(tensors)))
        return out


def _set_child(root, dotted, module):
    parent_name, _, child = dotted.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, module)


def set_unroute_mask(twin, unroute_mask):
    """Set (or clear, with None) the real-token mask of every TwinExperts of ``twin``: a bool
    tensor (B, S), flattened as the MoE blocks flatten their (B, S, H) input."""
    keep = None if unroute_mask is None else unroute_mask.reshape(-1).bool()
    for module in twin.modules():
        if isinstance(module, TwinExperts):
            module.token_keep = keep
    return twin


def build_twin(model, unroute_mask=None):
    """A deep copy of ``model`` with every fused experts module replaced by a TwinExperts
    holding copies of its experts' matrices (the original is not touched).

    ``unroute_mask``: optional bool (B, S), True at real tokens; the twin then leaves the pairs
    of padded tokens out of its loops. For a right-padded causal LM whose loss ignores the
    padding, every weight's gradient is unchanged by this (padded positions feed no real
    position and no loss term) and each twin Linear sees the rows of real tokens only.
    """
    twin = copy.deepcopy(model)
    if is_fused_experts(twin):
        return set_unroute_mask(TwinExperts(twin), unroute_mask)
    for name, module in list(twin.named_modules()):
        if is_fused_experts(module):
            _set_child(twin, name, TwinExperts(module))
    return set_unroute_mask(twin, unroute_mask)


def _as_fused(twin, get):
    prefixes = [name for name, m in twin.named_modules() if isinstance(m, TwinExperts)]
    modules = dict(twin.named_modules())
    out, emitted = {}, set()
    for name, p in twin.named_parameters():
        owner = next((pre for pre in prefixes
                      if pre == "" or name.startswith(pre + ".")), None)
        if owner is None:
            out[name] = get(p)
            continue
        if owner in emitted:
            continue
        emitted.add(owner)
        dot = owner + "." if owner else ""
        for fused_name, tensor in modules[owner].fused_tensors(get):
            out[dot + fused_name] = tensor
    return out


def fused_view(twin):
    """{fused model's parameter name: tensor}: the twin's parameters (detached), each experts
    module's Linear weights stacked back into the fused 3-D layout."""
    return _as_fused(twin, lambda p: p.detach())


def twin_grads_as_fused(twin):
    """``fused_view`` of the gradients (.grad; zeros for an expert that was not called, None
    where no expert or parameter has one)."""
    return _as_fused(twin, lambda p: p.grad)


# ----------------------------------------------------------------------- tiny fused models

FAMILIES = ("mixtral", "qwen2_moe", "gpt_oss")


def _tiny_config(family, num_layers):
    import transformers
    common = dict(hidden_size=16, num_hidden_layers=num_layers, num_attention_heads=2,
                  num_key_value_heads=2, vocab_size=64, max_position_embeddings=32,
                  num_experts_per_tok=2)
    if family == "mixtral":
        return (transformers.MixtralConfig(intermediate_size=12, num_local_experts=4, **common),
                transformers.MixtralForCausalLM)
    if family == "qwen2_moe":
        return (transformers.Qwen2MoeConfig(intermediate_size=24, moe_intermediate_size=12,
                                            shared_expert_intermediate_size=12, num_experts=4,
                                            **common),
                transformers.Qwen2MoeForCausalLM)
    if family == "gpt_oss":
        # default RoPE (the config's YaRN default warns at this size); a small swiglu_limit so
        # the clamps of its gate are active at this init scale (|h| ~ 0.1)
        return (transformers.GptOssConfig(intermediate_size=12, num_local_experts=4, head_dim=8,
                                          sliding_window=4, swiglu_limit=0.1,
                                          rope_parameters={"rope_type": "default",
                                                           "rope_theta": 10000.0},
                                          **common),
                transformers.GptOssForCausalLM)
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def tiny_moe_models(families=FAMILIES, seed=0, num_layers=2, dtype=torch.float64):
    """{family: (config, model)}: tiny causal LMs with fused experts, built offline from their
    configs (hidden 16, 4 experts, top-2, 2 heads, vocab 64), seeded, in ``dtype``, train mode
    (no dropout), ``config._experts_implementation = "eager"``.

    * "mixtral": MixtralExperts, intermediate 12 (default layout: [gate; up], (E, d_out, d_in)).
    * "qwen2_moe": Qwen2MoeExperts, moe_intermediate 12, plus its shared expert (nn.Linear
      layers) and sigmoid shared-expert gate.
    * "gpt_oss": GptOssExperts: interleaved gate/up, transposed (E, d_in, d_out), biases, its
      clamped SwiGLU ``_apply_gate``; the expert biases, zero at init, are drawn (std 0.1).
    """
    out = {}
    for family in families:
        config, cls = _tiny_config(family, num_layers)
        config._experts_implementation = "eager"
        torch.manual_seed(seed)
        model = cls(config).to(dtype).train()
        if family == "gpt_oss":
            g = torch.Generator().manual_seed(seed + 1)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("_proj_bias"):
                        p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        out[family] = (config, model)
    return out


def lm_batch(t, padded, size=2, seq=8, vocab=64):
    """(input_ids, attention_mask, labels) of step ``t``: random ids, and with ``padded`` the
    second row right-padded after 5 tokens (mask 0, labels -100 there)."""
    g = torch.Generator().manual_seed(t)
    ids = torch.randint(0, vocab, (size, seq), generator=g)
    mask = torch.ones(size, seq, dtype=torch.long)
    if padded:
        mask[1, 5:] = 0  # right padding, ignored by the loss
    return ids, mask, ids.masked_fill(mask == 0, -100)
