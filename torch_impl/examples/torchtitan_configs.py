r"""torchtitan job configs that train with MARS, MARS-M, MKOR or K-FAC: torchtitan's own llama3
configs with the optimizer swapped for :class:`torch_impl.integrations.torchtitan.Optimizers`.
torchtitan finds a config by its module path and function name::

    torchrun --nproc_per_node 8 -m torchtitan.train \
        --module torch_impl.examples.torchtitan_configs --config llama3_8b_mkor

and its command line overrides any field, e.g. ``--optimizer.implementation for-loop``.

Needs torchtitan (0.3), which the library does not bring (``pip install torchtitan==0.3.0``
with its requirements; the clone's README installs it with the test extras).

What each optimizer takes from the config (``torch_impl/integrations/README.md``):

* MARS, MARSM, LAMB: ``optimizer_kwargs`` are the optimizer's own keywords. MARS-M splits its
  parameters as Muon does: the transformer blocks' matrices take the MARS-M rule, the
  embedding, the output head and the norms AdamW's (``rule="adamw"``).
* MKOR, KFAC: ``optimizer_kwargs`` are the backbone's (torchtitan's AdamW here);
  ``optimizer_factory_kwargs_by_name`` names the backbone and carries the preconditioner's
  own options (``inv_freq``, ``damping``, ...). Layers it cannot precondition (embeddings,
  norms) are stepped by the backbone unchanged.
* ``implementation``: ``"foreach"`` or ``"for-loop"``; torchtitan's default ``"fused"`` is
  refused for ours (no fused kernel).
"""
from torchtitan.components.optimizer import ParamGroupConfig
from torchtitan.models.llama3.config_registry import llama3_8b, llama3_debugmodel
from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

from torch_impl.integrations.torchtitan import Optimizers

__all__ = ["with_optimizer", "mars", "mars_m", "mkor", "kfac",
           "llama3_debugmodel_mars", "llama3_debugmodel_mars_m", "llama3_debugmodel_mkor",
           "llama3_debugmodel_kfac", "llama3_8b_mars_m", "llama3_8b_mkor",
           "qwen3_moe_debug_ep_mkor", "qwen3_moe_debug_ep_kfac", "qwen3_moe_debug_ep_mars_m"]

# The transformer blocks' matrices (torchtitan's llama3 FQNs: layers.N.attention.*.weight,
# layers.N.feed_forward.w*.weight); everything else is an embedding, the head or a norm.
BLOCK_MATRICES = r"^layers\.\d+\.(attention|feed_forward)\..*\.weight$"


def with_optimizer(config, optimizer):
    """``config`` (a torchtitan ``Trainer.Config``) training with ``optimizer``."""
    config.optimizer = optimizer
    return config


def mars(lr=3e-3, weight_decay=0.1, **kwargs):
    """MARS (MARS-AdamW by default) on every parameter."""
    return Optimizers.Config(implementation="foreach", param_groups=[ParamGroupConfig(
        pattern=r".*", optimizer_name="MARS",
        optimizer_kwargs={"lr": lr, "weight_decay": weight_decay, **kwargs})])


def mars_m(lr=6e-3, adamw_lr=3e-3, weight_decay=0.1, **kwargs):
    """MARS-M on the blocks' matrices, AdamW's rule on the rest (one MARSM optimizer)."""
    return Optimizers.Config(implementation="foreach", param_groups=[
        ParamGroupConfig(pattern=BLOCK_MATRICES, optimizer_name="MARSM",
                         optimizer_kwargs={"rule": "mars_m", "lr": lr,
                                           "weight_decay": weight_decay, **kwargs}),
        ParamGroupConfig(pattern=r".*", optimizer_name="MARSM",
                         optimizer_kwargs={"rule": "adamw", "lr": adamw_lr,
                                           "weight_decay": weight_decay}),
    ])


def _preconditioned(name, lr, weight_decay, backbone, options):
    return Optimizers.Config(
        implementation="foreach",
        param_groups=[ParamGroupConfig(
            pattern=r".*", optimizer_name=name,
            optimizer_kwargs={"lr": lr, "betas": (0.9, 0.95), "weight_decay": weight_decay})],
        optimizer_factory_kwargs_by_name={name: {"backbone": backbone, **options}})


def mkor(lr=8e-4, weight_decay=0.1, backbone="AdamW", **options):
    """MKOR over ``backbone`` (its keywords: ``lr``, ``betas``, ``weight_decay``)."""
    return _preconditioned("MKOR", lr, weight_decay, backbone, {"inv_freq": 10, **options})


def kfac(lr=8e-4, weight_decay=0.1, backbone="AdamW", **options):
    """K-FAC over ``backbone``."""
    return _preconditioned("KFAC", lr, weight_decay, backbone,
                           {"inv_freq": 10, "damping": 1e-3, **options})


def llama3_debugmodel_mars():
    return with_optimizer(llama3_debugmodel(), mars())


def llama3_debugmodel_mars_m():
    return with_optimizer(llama3_debugmodel(), mars_m())


def llama3_debugmodel_mkor():
    return with_optimizer(llama3_debugmodel(), mkor())


def llama3_debugmodel_kfac():
    return with_optimizer(llama3_debugmodel(), kfac())


def llama3_8b_mars_m():
    return with_optimizer(llama3_8b(), mars_m(lr=2e-3, adamw_lr=3e-4))


def llama3_8b_mkor():
    # max_factor_dim=16384 keeps the 14336-wide feed-forward factors (the default, 8192, leaves
    # those layers to the backbone); each such factor is 14336^2 floats (0.8 GB in float32)
    # per layer, placed on one rank each by factor_placement="owner".
    return with_optimizer(llama3_8b(), mkor(lr=3e-4, max_factor_dim=16384,
                                            factor_placement="owner"))


# torchtitan's qwen3 MoE FQNs: the routed experts' stacks (layers.N.moe.routed_experts.
# inner_experts.w1_EFD, ...), 3-D: MARS-M orthogonalises each expert (matrix_batch_dims=1)
EXPERT_STACKS = r"^layers\.\d+\.moe\.routed_experts\.inner_experts\.w\d_E..$"
# the other matrices of its blocks: attention projections, the router's gate, shared experts
# (not the 1-D q/k norms beside them)
QWEN3_MATRICES = (r"^layers\.\d+\.(attention\.(qkv_linear\.)?w\w*|moe\.router\.gate"
                  r"|moe\.shared_experts\.w\d)\.weight$")


def with_expert_parallelism(config, optimizer, ep=2):
    """``config`` with ``optimizer`` and expert parallelism of degree ``ep``: each rank holds
    E / ep experts of every MoE layer (torchtitan's all-to-all dispatch); MKOR and K-FAC
    keep each expert's factors on the rank holding it and send nothing for them, MARS-M
    orthogonalises each expert there (issue 48). Expert tensor parallelism is refused by name."""
    config = with_optimizer(config, optimizer)
    config.parallelism.expert_parallel_degree = ep
    # torchtitan's all-to-all dispatcher reads its split sizes on the host, which a CUDA graph
    # cannot capture: torchtitan refuses the config unless its graphs are off
    config.training.disable_cuda_graphs = True
    return config


def qwen3_moe_debug_ep_mkor():
    return with_expert_parallelism(qwen3_moe_debug(), mkor())


def qwen3_moe_debug_ep_kfac():
    return with_expert_parallelism(qwen3_moe_debug(), kfac())


def qwen3_moe_debug_ep_mars_m(lr=6e-3, adamw_lr=3e-3, weight_decay=0.1):
    optimizer = Optimizers.Config(implementation="foreach", param_groups=[
        ParamGroupConfig(pattern=EXPERT_STACKS, optimizer_name="MARSM",
                         optimizer_kwargs={"rule": "mars_m", "lr": lr, "matrix_batch_dims": 1,
                                           "weight_decay": weight_decay}),
        ParamGroupConfig(pattern=QWEN3_MATRICES, optimizer_name="MARSM",
                         optimizer_kwargs={"rule": "mars_m", "lr": lr,
                                           "weight_decay": weight_decay}),
        ParamGroupConfig(pattern=r".*", optimizer_name="MARSM",
                         optimizer_kwargs={"rule": "adamw", "lr": adamw_lr,
                                           "weight_decay": weight_decay}),
    ])
    return with_expert_parallelism(qwen3_moe_debug(), optimizer)


CONFIGS = [name for name in __all__ if name.startswith(("llama3_", "qwen3_"))]


def parse(argv=None):
    """``python -m torch_impl.examples.torchtitan_configs``: this module trains nothing
    itself, torchtitan does; run alone (or with ``--help``) it prints how, and its configs."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m torch_impl.examples.torchtitan_configs",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="The configs (each a --config of the command above):\n"
                                       + "".join(f"  {name}\n" for name in CONFIGS))
    p.parse_args(argv)
    return p


if __name__ == "__main__":
    parse().print_help()
