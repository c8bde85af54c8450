"""MKOR and MKOR-H in PyTorch (spec MKOR.md): MKOR's own math and options, on the Kronecker
engine it shares with K-FAC (:mod:`torch_impl.kronecker`); K-FAC and LAMB are in
:mod:`torch_impl.baselines`.

* :class:`MKOR` (``preconditioner.py``) -- the preconditioner (hooks + O(d^2) rank-1 inverse
  updates), wrapping any ``torch.optim`` optimizer; MKOR-H via ``hybrid_switch`` /
  ``switch_step`` (``hybrid.py``);
* ``config.py`` -- :class:`MKOROptions`, the variant columns, and each consumer's record;
* ``factors.py``, ``vectors.py`` -- the pure tensor functions (mirroring the NumPy oracle
  ``reference/``), e.g. :func:`factor_update` for timing the factor update alone;
* ``layer_state.py`` -- one layer's state, its factor update and its preconditioning;
* ``vector_exchange.py`` -- the O(d) all-reduce of the rank-1 vectors.

The engine's extension point is re-exported here as it always was: :class:`LayerType`,
:func:`register_layer_type`, :func:`discover`.
"""
from ..kronecker.discovery import DEFAULT_MAX_FACTOR_DIM, Discovery, Layer, discover
from ..kronecker.layers import (Conv2dType, HFConv1DType, LayerType, LinearType,
                                layer_type_for, layer_types, register_layer_type,
                                unregister_layer_type)
from .config import MKOROptions
from .factors import (
    ema_inverse_update, factor_update, max_entry_norm, needs_stabilising, precondition,
    rank1_inverse_update, released_inverse_update, rescale, reset_factor, sherman_morrison,
    stabilise, symmetrise)
from .hybrid import LossRateSwitch
from .preconditioner import MKOR
from .vectors import conv2d_rank1_vectors, linear_rank1_vectors, unfold2d

__all__ = [
    "MKOR", "LossRateSwitch", "MKOROptions", "discover", "Discovery", "Layer",
    "DEFAULT_MAX_FACTOR_DIM", "LayerType", "LinearType", "Conv2dType", "HFConv1DType",
    "register_layer_type", "unregister_layer_type", "layer_types", "layer_type_for",
    "sherman_morrison", "ema_inverse_update", "released_inverse_update",
    "rank1_inverse_update", "max_entry_norm", "needs_stabilising", "stabilise",
    "reset_factor", "symmetrise", "factor_update", "precondition", "rescale",
    "linear_rank1_vectors", "conv2d_rank1_vectors", "unfold2d",
]
