"""torchtitan pieces for the tests: its llama3 debug model, our container's configs, a step.

The debug model is torchtitan's own (``model_registry("debugmodel")``: dim 256, 6 layers,
vocab 2048, fused QKV, ``nn.Linear`` subclasses) with one change: its ``FlexAttention`` is
replaced by torchtitan's ``ScaledDotProductAttention`` (both torchtitan's inner-attention
modules), because FlexAttention has no backward on CPU in torch 2.13 ("FlexAttention does not
support backward on CPU"). No parameter changes: the attention kernel has none.
"""
import copy
import io

import torch
from torchtitan.components.optimizer import ParamGroupConfig

from theory_tests.support.torchtitan_ep import _build, ep_model, lm_step  # noqa: F401
from torch_impl.integrations.torchtitan import Optimizers

SEQ = 16

# name -> (group kwargs, factory kwargs): every optimizer the container adds, with its own
# hyperparameters (not the defaults), and torchtitan's AdamW
CONFIGS = {
    "MARS": ({"lr": 3e-3, "betas": (0.9, 0.99), "gamma": 0.02, "weight_decay": 0.1}, {}),
    "MARSM": ({"lr": 2e-2, "weight_decay": 0.1, "momentum": 0.9, "gamma": 0.02}, {}),
    "LAMB": ({"lr": 1e-2, "weight_decay": 0.01}, {}),
    "MKOR": ({"lr": 1e-3, "weight_decay": 0.1}, {"backbone": "AdamW", "inv_freq": 2}),
    "MKOR-MARS": ({"lr": 1e-3}, {"backbone": "MARS", "inv_freq": 2, "stat_decay": 0.9}),
    "MKOR-H": ({"lr": 1e-3}, {"backbone": "AdamW", "inv_freq": 2, "switch_step": 3}),
    "KFAC": ({"lr": 1e-3, "weight_decay": 0.1}, {"backbone": "AdamW", "inv_freq": 2,
                                                  "damping": 1e-2, "max_factor_dim": 1024}),
    "AdamW": ({"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}, {}),
}


def optimizer_name(case):
    return case.split("-")[0] if case.startswith(("MKOR", "KFAC")) else case


def config(case, implementation="foreach", pattern=r".*"):
    group_kwargs, factory_kwargs = CONFIGS[case]
    name = optimizer_name(case)
    return Optimizers.Config(
        implementation=implementation,
        param_groups=[ParamGroupConfig(pattern=pattern, optimizer_name=name,
                                       optimizer_kwargs=dict(group_kwargs))],
        optimizer_factory_kwargs_by_name={name: copy.deepcopy(factory_kwargs)})


# (seed, dtype) -> (the model as built, the global RNG state its build left)
_DEBUG_MODELS = {}


def debug_model(seed=0, dtype=torch.float64):
    """torchtitan's llama3 debug model (module docstring), initialised from ``seed``: a copy of
    the one this process built first for ``(seed, dtype)`` (a build costs ~0.5 s of CPU, its
    initialisation mostly, a copy ~0.03 s; the torchtitan tests build ~30), with the global
    RNG left where that build left it, so a caller sees what a fresh build gives it."""
    key = (seed, dtype)
    if key not in _DEBUG_MODELS:
        from torchtitan.models.llama3 import model_registry
        spec = model_registry("debugmodel")
        model = _build(spec.model, seed, dtype)
        _DEBUG_MODELS[key] = (model, torch.get_rng_state())
    model, rng = _DEBUG_MODELS[key]
    torch.set_rng_state(rng)
    return copy.deepcopy(model)


def tokens(step, batch, vocab=2048):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (batch, SEQ + 1), generator=g)


def moe_model(seed=0, dtype=torch.float64, dim=32, layers=2, experts=4, top_k=2, hidden=16,
              vocab=64, load_balance=True):
    """A small torchtitan qwen3 MoE model: ``debugmodel_moe``'s construction (qwen3's own
    config builders: RMSNorm, fused QKV with qk-norm, CosSin RoPE, a token-choice softmax
    router with route_norm, ``GroupedExperts`` behind the local token dispatcher, the expert
    bias of auxiliary-loss-free load balancing) at a test's size, with SDPA attention as
    :func:`debug_model` (module docstring); ``load_balance=False`` drops the expert bias."""
    return ep_model("qwen3", 1, seed, dtype, vocab, dim, layers, experts, top_k, hidden,
                    load_balance)


class OneProcess:
    """The ``ParallelDims`` of one process, as torchtitan's MoE load-balancing hook reads it
    (``register_moe_load_balancing_hook``: no loss mesh, no EP, no TP)."""

    ep_enabled, tp = False, 1

    def get_optional_mesh(self, dims, **kwargs):
        return None


def moe_optimizers(case, model):
    """Our container for ``case`` on a :func:`moe_model`, with torchtitan's load-balancing
    hook (qwen3's ``post_optimizer_build_fn``) registered as its trainer does."""
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    optimizers = config(case).build(model_parts=[model])
    register_moe_load_balancing_hook(optimizers, [model], OneProcess())
    return optimizers


def saved(obj):
    """``obj`` through a ``torch.save`` / ``torch.load`` round trip (what a checkpoint keeps)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)
