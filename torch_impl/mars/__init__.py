"""MARS and MARS-M in PyTorch (spec MARS.md).

* :class:`MARS` (``mars.py``) and :class:`MARSM` (``mars_m.py``) -- the optimizers;
* ``mars_equations.py``, ``mars_m_equations.py`` -- the equations, twins of the oracle's
  ``reference/mars/mars_equations.py`` and ``mars_m_equations.py``;
* ``mars_compiled.py``, ``mars_m_compiled.py`` -- the compiled step;
* ``functional.py`` -- the list API (``torch_impl.mars.functional.mars(params, grads, ...)``,
  also ``from torch_impl import functional``);
* ``exact_mode.py`` -- exact MARS's second gradient (the state's storage and rounding:
  ``common/state_storage.py``).
"""
from .mars import MARS
from .mars_m import MARS_M, MARS_M_Efficient, MARSM

__all__ = ["MARS", "MARSM", "MARS_M", "MARS_M_Efficient"]
