"""PyTorch implementations of MARS and MKOR (mirrors ``reference/`` function for function)."""
from . import functional
from .mars import MARS
from .mars_m import MARS_M, MARS_M_Efficient, MARSM
from .mkor import KFAC, LAMB, MKOR, LossRateSwitch, MKOROptions, from_kfac_pytorch

__all__ = ["functional", "MARS", "MARSM", "MARS_M", "MARS_M_Efficient", "MKOR", "KFAC", "LAMB", "LossRateSwitch", "MKOROptions", "from_kfac_pytorch"]
