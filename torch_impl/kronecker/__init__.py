"""The engine both Kronecker-factored preconditioners stand on: MKOR (:mod:`torch_impl.mkor`)
and K-FAC (:mod:`torch_impl.baselines.kfac`) are siblings here, each keeping its own math.

* :mod:`.optimizer` -- :class:`PreconditionedOptimizer`, the ``torch.optim.Optimizer`` that
  wraps a backbone (GradScaler, schedulers, checkpoints, the capture report);
* :mod:`.discovery` -- which modules are preconditioned and why the others are not;
* :mod:`.layers` -- :class:`LayerType` and :func:`register_layer_type`, how a layer's rows
  and gradient matrix are read;
* :mod:`.capture` -- the hooks that pair every forward with its gradient and sum each
  layer's statistics (token masks, checkpointing, the self-check);
* :mod:`.experts` -- fused mixture-of-experts modules as stacks of expert layers;
* :mod:`.placement` -- FSDP2: supported shardings, replicated or owner-per-layer factors;
* :mod:`.exchange` -- the statistics' flat-buffer collectives;
* :mod:`.factor_storage` -- factors kept in 16 bits: the write (nearest or stochastic) and its
  seed;
* :mod:`.state_layout`, :mod:`.report` -- the checkpoint layout on the parameters, and the
  capture report's table.
"""
from .capture import CaptureError
from .discovery import DEFAULT_MAX_FACTOR_DIM, Discovery, Layer, discover
from .layers import (Conv2dType, HFConv1DType, LayerType, LinearType, layer_type_for,
                     layer_types, register_layer_type, unregister_layer_type)
from .optimizer import PreconditionedOptimizer
from .report import CaptureReport

__all__ = [
    "PreconditionedOptimizer", "CaptureReport", "CaptureError", "discover", "Discovery",
    "Layer", "DEFAULT_MAX_FACTOR_DIM", "LayerType", "LinearType", "Conv2dType",
    "HFConv1DType", "register_layer_type", "unregister_layer_type", "layer_types",
    "layer_type_for",
]
