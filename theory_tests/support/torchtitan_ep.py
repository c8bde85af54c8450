"""torchtitan's expert-parallel path on forked gloo CPU ranks (issue 48).

torchtitan 0.3 runs expert parallelism (EP) as its trainer does here, with three settings
made before anything is built (:func:`configure`):

* its device type set to ``"cpu"`` (``parallel_dims`` reads ``device_type`` when it builds
  the mesh; it would otherwise default to "cuda");
* the ``partial_dtensor`` SPMD backend (its default, ``spmd_types``, does not run with torch
  2.13's FSDP2);
* ``"float64"`` added to the precision table ``TORCH_DTYPE_MAP`` it reads for FSDP's
  mixed-precision policy, so the tests can run in float64.

The models are torchtitan's qwen3 MoE (:func:`theory_tests.support.torchtitan_cases.moe_model`:
softmax router, route_norm, load-balancing expert bias) and deepseek_v3 (MLA attention, a dense
first layer, shared experts, a softmax top-3 router), at a test's size, with their own sharding
configs (``set_qwen3_sharding_config`` / ``set_deepseek_v3_sharding_config``, EP on) and
sharded by their own ``parallelize_qwen3`` / ``parallelize_deepseekv3``: experts ``Shard(0)``
on the ``ep`` mesh dimension with the ``AllToAllTokenDispatcher``, FSDP on ``fsdp`` for the
dense parameters and on ``efsdp`` for the experts.
"""
import copy

import torch

__all__ = ["configure", "parallel_dims", "ep_model", "parallelize", "sum_reductions", "lm_step",
           "KINDS"]

KINDS = ("qwen3", "deepseek_v3")
SEQ = 16


def configure():
    """The three settings of the module docstring (idempotent; per process)."""
    import torchtitan.config as titan_config
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.distributed.utils import set_spmd_backend
    titan_config.TORCH_DTYPE_MAP.setdefault("float64", torch.float64)
    parallel_dims_module.device_type = "cpu"
    set_spmd_backend("partial_dtensor")


def parallel_dims(world, ep, dp_replicate=1):
    """torchtitan's ``ParallelDims`` of ``world`` ranks with EP degree ``ep`` (dp_shard the
    rest), its mesh built."""
    configure()
    from torchtitan.distributed import ParallelDims
    dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=world // dp_replicate, cp=1, tp=1,
                        pp=1, ep=ep, world_size=world, spmd_backend="partial_dtensor")
    dims.build_mesh()
    return dims


def _build(cfg, seed, dtype):
    """``cfg``'s model with SDPA for FlexAttention, initialised from ``seed`` in ``dtype``."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    for _, _, parent, attr in list(cfg.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # not model.to(dtype): RoPE's buffer is complex
    try:
        model = cfg.build()
        model.init_weights()
    finally:
        torch.set_default_dtype(default)
    return model


def _qwen3_config(vocab, dim, layers, experts, top_k, hidden, load_balance):
    from torchtitan.models import qwen3
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.rope import CosSinRoPE
    head_dim = 16
    cfg = qwen3.Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=qwen3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab,
                              param_init=qwen3._LINEAR_INIT),
        layers=qwen3._build_qwen3_moe_layers(
            fuse_qkv=True, n_layers=layers, dim=dim, n_heads=2, n_kv_heads=1,
            head_dim=head_dim, moe_hidden_dim=hidden, num_experts=experts, top_k=top_k,
            attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=64, theta=1e6)))
    if not load_balance:
        for layer in cfg.layers:
            layer.moe.load_balance_coeff = None
    return cfg


def _deepseek_config(vocab, dim, layers, experts, top_k, hidden, load_balance):
    from torchtitan.models import deepseek_v3 as ds
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.rope import ComplexRoPE
    rope_dim = 8
    cfg_layers = ds._build_dsv3_layers(
        n_layers=layers, n_dense_layers=1, dim=dim, n_heads=2, q_lora_rank=0,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=rope_dim, v_head_dim=8,
        mscale=0.70, dense_hidden_dim=2 * hidden, moe_hidden_dim=hidden,
        num_experts=experts, num_shared_experts=1, router_top_k=top_k,
        router_score_func="softmax", attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=64, theta=10000.0))
    cfg = ds.DeepSeekV3Model.Config(
        vocab_size=vocab, dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=ds._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=ds._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab,
                              param_init=ds._output_linear_init(dim)),
        layers=cfg_layers, mtp_layers=[])
    if not load_balance:
        for layer in cfg.layers:
            if layer.moe is not None:
                layer.moe.load_balance_coeff = None
    return cfg


def ep_model(kind="qwen3", ep=1, seed=0, dtype=torch.float64, vocab=64, dim=32, layers=2,
             experts=4, top_k=2, hidden=16, load_balance=False):
    """torchtitan's ``kind`` MoE model at a test's size (module docstring), its sharding
    configs set for EP degree ``ep`` (``ep == 1``: the one-process model), initialised from
    ``seed`` in ``dtype``: the same parameters whatever ``ep`` is."""
    build = {"qwen3": _qwen3_config, "deepseek_v3": _deepseek_config}[kind]
    cfg = build(vocab, dim, layers, experts, top_k, hidden, load_balance)
    if ep > 1:
        if kind == "qwen3":
            from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config as sharding
        else:
            from torchtitan.models.deepseek_v3.sharding import (
                set_deepseek_v3_sharding_config as sharding)
        sharding(cfg, enable_sp=False, enable_ep=True)
    return _build(cfg, seed, dtype)


def parallelize(model, kind, dims, dtype=torch.float64):
    """``model`` sharded by torchtitan's own ``parallelize_qwen3`` / ``parallelize_deepseekv3``
    on ``dims`` (FSDP in ``dtype``, no compile, no activation checkpointing)."""
    import tempfile

    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    name = {torch.float64: "float64", torch.float32: "float32"}[dtype]
    training = TrainingConfig(mixed_precision_param=name, mixed_precision_reduce=name)
    parallelism = ParallelismConfig(
        data_parallel_replicate_degree=dims.dp_replicate,
        data_parallel_shard_degree=dims.dp_shard, expert_parallel_degree=dims.ep,
        spmd_backend="partial_dtensor")
    if kind == "qwen3":
        from torchtitan.models.qwen3.parallelize import parallelize_qwen3 as fn
    else:
        from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3 as fn
    fn(model, parallel_dims=dims, training=training, parallelism=parallelism,
       compile_config=CompileConfig(), ac_config=None, dump_folder=tempfile.gettempdir())
    return model


def sum_reductions(model):
    """``model`` (sharded by :func:`parallelize`) with every FSDP unit's gradient reductions
    forced to plain SUM. In float32 FSDP scales its reduce-scatter by torchtitan's divide
    factor (1) with ``ReduceOp.PREMUL_SUM``, which gloo lacks (float64 avoids it: FSDP
    divides apart for dtypes at risk of overflow); the sums are the same."""
    from torch.distributed.fsdp import FSDPModule
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


def tokens(step, batch, vocab=64):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (batch, SEQ + 1), generator=g)


def lm_step(model, optimizers, batch_tokens, world=1):
    """One step of next-token loss, torchtitan's way: the local sum over tokens divided by
    the global token count (its FSDP sums gradients over the ranks, no division:
    ``disable_fsdp_gradient_division``), so the gradient is the global batch's mean;
    ``optimizers`` None: forward and backward only."""
    inputs, labels = batch_tokens[:, :-1], batch_tokens[:, 1:]
    positions = torch.arange(inputs.shape[1]).repeat(inputs.shape[0], 1)
    logits = model(inputs, positions=positions)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                             reduction="sum") / (labels.numel() * world)
    loss.backward()
    if optimizers is not None:
        optimizers.step()
        optimizers.zero_grad()
    return loss.detach()


def full_parameters(model):
    """{name: the whole parameter} (DTensors gathered; a collective on every rank)."""
    from torch.distributed.tensor import DTensor
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).clone()
    return out


def copy_model(model):
    return copy.deepcopy(model)
