"""The composition matrix's rows with fused experts (issue 31 item 4): transformers 5.24's
Mixtral, Qwen2-MoE, Aria (its text model) and GPT-OSS, whose experts are one module holding 3-D
parameters (``gate_up_proj`` / ``down_proj``, classes decorated by
``transformers.integrations.moe.use_experts_implementation``), and the independent computation of
those experts' per-expert rows for :class:`~composition_observer.Observer` -- plain torch and
the module's own gate, nothing of ``torch_impl``.

The four rows differ where a capture could go wrong:

* **mixtral** -- ``MixtralExperts``: ``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I)
  (``out = x W^T``), gate and up concatenated; the router's softmax in float32;
* **qwen2_moe** -- the same expert layout, plus a shared expert (three ``nn.Linear``) and a
  ``shared_expert_gate`` ``nn.Linear(H, 1)``, all four called on the flattened (B*T, H) tokens;
  q / k / v with biases;
* **aria** -- ``AriaExperts`` stored transposed (``is_transposed=True``: ``gate_up_proj``
  (E, H, 2I), ``down_proj`` (E, I, H), ``out = x W``), the router's softmax over the top-k
  logits only, and shared experts (``nn.Linear``) called on the (B, T, H) tokens;
* **gpt_oss** -- ``GptOssExperts`` (``is_concatenated=False, is_transposed=True,
  has_bias=True``): gate and up interleaved in ``gate_up_proj`` (E, H, 2I), per-expert biases
  (E, 2I) / (E, H) (so each expert's a carries the bias column [a | 1]), a clamped SwiGLU
  ``_apply_gate``; its forward names the routing inputs ``router_indices`` /
  ``routing_weights``; attention with sinks (a bare parameter: ``GptOssAttention`` is skipped,
  its projections preconditioned), a sliding-window layer and a full one.

Each routed (token t, slot j) pair, expert e = ``top_k_index[t, j]``, weight
w = ``top_k_weights[t, j]``, is one row of expert e's two layers (the rows an ``nn.Linear``
expert called on its tokens would see):

* up projection: a = x_t, g = dL/dh at h = W^up_e x_t (+ b);
* down projection: a = gate(h) (the module's ``_apply_gate``, or ``act_fn`` without a gate),
  g = dL/dy = w dL/dout_t (through ``post_expert_norm``'s VJP if the module has one).

:class:`RoutedCalls` records each call's (hidden_states, top_k_index, top_k_weights) with a
forward pre-hook and the output's gradient with ``retain_grad``; :meth:`RoutedCalls.rows`
recomputes the pairs' rows with ``torch.einsum`` over per-pair gathered weights (no loop over
the experts, unlike both the model's eager loop and the capture) and autograd through the
module's own gate, and checks that the recomputed pairs, weighted and summed per token, give
back the module's output (so a wrong reading of the layout -- transposed, concatenated -- fails
here, not silently). Padded tokens' pairs are masked by their token's mask.
"""
import torch
from transformers import (AriaTextConfig, AriaTextForCausalLM, GptOssConfig, GptOssForCausalLM,
                          MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM)

from theory_tests.support.composition_rows import TokenRows, token_mask
from theory_tests.support.hf_cases import VOCAB

f64 = torch.float64

__all__ = ["FUSED", "tiny_mixtral", "tiny_qwen2_moe", "tiny_aria", "tiny_gpt_oss",
           "mixtral_rows", "qwen2_moe_rows", "aria_rows", "gpt_oss_rows", "is_fused_experts", "fused_layers", "RoutedCalls",
           "expert_counts"]

#: the matrix's rows with fused experts
FUSED = ("mixtral", "qwen2_moe", "aria", "gpt_oss")

#: what transformers' decorator sets on every fused-experts instance (its declared layout)
_LAYOUT = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm")


def _common(n_layer):
    return dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=n_layer,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                tie_word_embeddings=False)


def _build(cls, cfg, seed, dtype):
    # the default experts implementation (grouped_mm) refuses float64 on CPU: the eager loop
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype).train()
    assert model.config._experts_implementation == "eager"
    return model


def tiny_mixtral(seed=0, dtype=f64, n_layer=2):
    """MixtralForCausalLM, hidden 16, 2 layers, 2 heads (1 KV head), 4 experts of intermediate
    8, top-2, no router jitter, untied head."""
    cfg = MixtralConfig(intermediate_size=8, num_local_experts=4, num_experts_per_tok=2,
                        router_jitter_noise=0.0, **_common(n_layer))
    return _build(MixtralForCausalLM, cfg, seed, dtype)


def tiny_qwen2_moe(seed=0, dtype=f64, n_layer=1):
    """Qwen2MoeForCausalLM, hidden 16, 1 sparse layer, 4 experts of intermediate 8, top-2
    (``norm_topk_prob`` False: transformers' default), a shared expert of intermediate 16 with
    its sigmoid ``shared_expert_gate``, untied head."""
    cfg = Qwen2MoeConfig(intermediate_size=16, moe_intermediate_size=8,
                         shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                         decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
                         **_common(n_layer))
    return _build(Qwen2MoeForCausalLM, cfg, seed, dtype)


def tiny_aria(seed=0, dtype=f64, n_layer=1):
    """AriaTextForCausalLM, hidden 16, 1 layer, 4 transposed experts of intermediate 8, top-2,
    one shared expert, untied head."""
    cfg = AriaTextConfig(intermediate_size=8, moe_num_experts=4, moe_topk=2,
                         moe_num_shared_experts=1, **_common(n_layer))
    return _build(AriaTextForCausalLM, cfg, seed, dtype)


def tiny_gpt_oss(seed=0, dtype=f64, n_layer=2):
    """GptOssForCausalLM, hidden 16, 2 layers (sliding window 4, then full attention), 2 heads
    of 8 (1 KV head), 4 experts of intermediate 8 with biases, top-2, plain RoPE (the default
    config's YaRN needs the original context length), untied head. The experts' biases start
    at 0 (transformers' init); their gradients do not."""
    cfg = GptOssConfig(intermediate_size=8, num_local_experts=4, num_experts_per_tok=2,
                       head_dim=8, sliding_window=4,
                       layer_types=["sliding_attention", "full_attention"][:n_layer],
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       **_common(n_layer))
    return _build(GptOssForCausalLM, cfg, seed, dtype)


# -- what each layer's rows are ------------------------------------------------------------------
#: the (B, T) tokens flattened batch-major: the rows of a module called on
#: ``hidden_states.view(-1, H)`` (every MoE block here flattens before routing), and the
#: tokens whose pairs are a fused experts module's rows
FLAT = TokenRows(flat=True)


def _experts_layer(name):
    return ".mlp.experts." in name


def mixtral_rows(name):
    """Mixtral: every layer reads the tokens; the experts' pairs follow their flattened tokens."""
    return FLAT if _experts_layer(name) else TokenRows()


def qwen2_moe_rows(name):
    """Qwen2-MoE: the block flattens the tokens before its shared expert and
    ``shared_expert_gate`` too (``Qwen2MoeSparseMoeBlock.forward``)."""
    return FLAT if _experts_layer(name) or ".mlp.shared_expert" in name else TokenRows()


def aria_rows(name):
    """Aria: the shared experts get the tokens back in (B, T, H) (``AriaTextMoELayer``)."""
    return FLAT if _experts_layer(name) else TokenRows()


def gpt_oss_rows(name):
    """GPT-OSS: the MLP flattens the tokens before routing; attention reads (B, T)."""
    return FLAT if _experts_layer(name) else TokenRows()


# -- the fused experts ---------------------------------------------------------------------------
def is_fused_experts(module):
    """A module of a class transformers' ``use_experts_implementation`` decorated: its declared
    layout attributes and ``num_experts`` are set."""
    return all(hasattr(module, a) for a in _LAYOUT) and hasattr(module, "num_experts")


def _projections(module):
    return ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")


def fused_layers(model, names):
    """{layer name: (experts module's name, parameter name)} for the names among ``names`` that
    are a fused experts module's projection (``<module>.gate_up_proj`` ...)."""
    out = {}
    for name in names:
        parent, _, param = name.rpartition(".")
        try:
            module = model.get_submodule(parent)
        except AttributeError:
            continue
        if is_fused_experts(module) and param in _projections(module):
            out[name] = (parent, param)
    return out


def expert_counts(top_k_index, num_experts):
    """Pairs routed to each expert, (E,) ints."""
    return torch.bincount(top_k_index.reshape(-1), minlength=num_experts)


def _inputs(args, kwargs):
    """(hidden_states, top_k_index, top_k_weights) of a call: how the four models' MoE blocks
    call their experts (positionally), or by those names (GPT-OSS's: router_indices,
    routing_weights)."""
    names = ("hidden_states", ("top_k_index", "router_indices"),
             ("top_k_weights", "routing_weights"))
    values = list(args[:3])
    for n in names[len(values):]:
        values += [kwargs[k] for k in ((n,) if isinstance(n, str) else n) if k in kwargs]
    assert len(values) == 3, f"an experts call with {len(args)} positional, {sorted(kwargs)}"
    return values


def _matmul(rows, weights, transposed):
    """Per-pair product: rows (S, d_in), weights (S, d_out, d_in), or (S, d_in, d_out) when
    transposed -> (S, d_out)."""
    return torch.einsum("si,sio->so" if transposed else "si,soi->so", rows, weights)


class RoutedCalls:
    """Records the calls of one fused experts module (forward pre-hook for its inputs, forward
    hook for ``retain_grad`` on its output, with ``current_batch()``, the batch of the forward)
    and recomputes their routed rows."""

    def __init__(self, module, current_batch):
        self.module, self.calls, self._pending = module, [], None
        self._current_batch = current_batch  # () -> the batch of the forward being run
        self._handles = [module.register_forward_pre_hook(self._pre, with_kwargs=True),
                         module.register_forward_hook(self._post)]

    def remove(self):
        for h in self._handles:
            h.remove()

    def _pre(self, module, args, kwargs):
        self._pending = None
        if module.training and torch.is_grad_enabled():
            x, index, weights = _inputs(args, kwargs)
            device = x.device.type
            autocast = (torch.get_autocast_dtype(device)
                        if torch.is_autocast_enabled(device) else None)
            self._pending = (x.detach().clone(), index.detach().clone(), weights.detach().clone(),
                             autocast)

    def _post(self, module, args, out):
        pending, self._pending = self._pending, None
        if pending is None or not (isinstance(out, torch.Tensor) and out.requires_grad):
            return
        out.retain_grad()
        self.calls.append((*pending, out, self._current_batch()))

    def rows(self, rule, name_of):
        """[{projection: (a, g, expert, keep, total)} per call whose output got a gradient]:
        the pairs' rows in (token, slot) order, each pair's expert, the mask of the pairs
        whose token is real (None: all), and the number of pairs; ``rule`` the case's rows
        rule (None: no masks), ``name_of`` {parameter: layer name} of the projections
        observed (both follow their tokens' mask). Forgets the calls."""
        m = self.module
        out = []
        for x, index, weights, autocast, y_out, batch in self.calls:
            if y_out.grad is None:  # the loss does not reach this call
                continue
            T, k = index.shape
            token = torch.arange(T).repeat_interleave(k)
            expert = index.reshape(-1)
            w = weights.reshape(-1, 1)
            up_name, down_name = _projections(m)
            W_up, W_down = getattr(m, up_name).detach(), getattr(m, down_name).detach()
            a_up = x[token]
            # the products in the precision the forward ran them in (autocast's, if on)
            with torch.enable_grad(), torch.autocast(x.device.type, dtype=autocast,
                                                     enabled=autocast is not None,
                                                     cache_enabled=False):
                # the gradient rows of a weight are those of its *product* (before a bias:
                # a bf16 product plus a float32 bias reaches the product's gradient in bf16)
                p_up = _matmul(a_up, W_up[expert], m.is_transposed).requires_grad_()
                h = p_up
                if m.has_bias:
                    h = h + getattr(m, up_name + "_bias").detach()[expert]
                a_down = m._apply_gate(h) if m.has_gate else m.act_fn(h)
                p_down = _matmul(a_down, W_down[expert], m.is_transposed)
                y = p_down
                if m.has_bias:
                    y = y + getattr(m, down_name + "_bias").detach()[expert]
                z = m.post_expert_norm(y) if m.has_post_expert_norm else y
                # the eager loop's z * w, in their promoted dtype (bf16 under autocast when the
                # router's weights are bf16): its gradient is the output's rounded to it
                weighted = torch.promote_types(z.dtype, w.dtype)
                g_z = w.to(weighted) * y_out.grad.detach()[token].to(weighted)
                # dL/dh through the down projection and the module's own gate; dL/dy through
                # the post-expert norm (without one, dL/dy = w dL/dout_t)
                g_h, g_y = torch.autograd.grad(z, (p_up, p_down), g_z)
            self._check_output(z.detach(), w, token, y_out, autocast)
            keep = None
            if rule is not None and batch is not None and "attention_mask" in batch:
                flat = token_mask(rule, batch, next(iter(name_of.values())), (T,))
                keep = None if flat is None else flat[token]
            total = token.numel()
            out.append({up_name: (a_up, g_h.detach(), expert, keep, total),
                        down_name: (a_down.detach(), g_y.detach(), expert, keep, total)})
        self.calls.clear()
        return out

    def _check_output(self, z, w, token, y_out, autocast):
        """The recomputed pairs, weighted and summed per token, are the module's output, to
        1e-12 of its largest entry in float64 (the same products summed in another order),
        1e-5 in float32, 2e-2 under a 16-bit autocast (a few of its ulps); a misread layout
        is off by O(1)."""
        rebuilt = torch.zeros_like(y_out.detach()).index_add_(0, token, w * z.to(y_out.dtype))
        scale = float(y_out.detach().abs().max())
        err = float((rebuilt - y_out.detach()).abs().max()) / max(scale, 1e-300)
        tol = 2e-2 if autocast is not None else 1e-12 if y_out.dtype == f64 else 1e-5
        assert err <= tol, (f"{type(self.module).__name__}: the recomputed experts' output "
                            f"differs from the module's by {err:.2e}: the layout is misread")

