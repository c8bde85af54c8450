"""Fused mixture-of-experts modules as stacks of expert linear layers, one adapter per layout
(kfac-pytorch's layer-adapter pattern; ``torch_impl/kronecker/experts/README.md``):

* :mod:`.layout` -- a projection as a layer (:class:`ExpertProjection`, its
  :class:`FusedExpertsType`) and the adapter protocol (:class:`ExpertsLayout`);
* :mod:`.transformers` -- transformers 5's ``use_experts_implementation`` classes, their
  rows recomputed (:mod:`.recompute`) with the arithmetic read from their forward
  (:mod:`.arithmetic`), under transformers' own expert parallelism through its all-to-all
  dispatch (:mod:`.transformers_ep`);
* :mod:`.torchtitan` -- torchtitan's ``GroupedExperts``.

Discovery asks :func:`experts_layout` which adapter, if any, describes a module.
"""
from .layout import ExpertProjection, ExpertsLayout, FusedExpertsType, product_dtype
from .torchtitan import TITAN
from .transformers import TRANSFORMERS

__all__ = ["ExpertProjection", "ExpertsLayout", "FusedExpertsType", "product_dtype",
           "EXPERTS", "LAYOUTS", "experts_layout"]

#: the layer type of every fused-experts projection
EXPERTS = FusedExpertsType()
#: the fused-experts layouts (:class:`ExpertsLayout` adapters), first match wins
LAYOUTS = (TRANSFORMERS, TITAN)


def experts_layout(module):
    """The :class:`ExpertsLayout` of a fused experts ``module``, or None."""
    return next((layout for layout in LAYOUTS if layout.matches(module)), None)
