"""PyTorch implementations of MARS and MKOR (mirrors ``reference/`` function for function)."""
from . import functional
from .mars import MARS
from .mkor import KFAC, LAMB, MKOR, LossRateSwitch, MKOROptions

__all__ = ["functional", "MARS", "MKOR", "KFAC", "LAMB", "LossRateSwitch", "MKOROptions"]
