"""PyTorch implementations of MARS and MKOR (mirrors ``reference/`` function for function)."""
from .mars import MARS
from .mkor import KFAC, LAMB, MKOR, LossRateSwitch, MKOROptions

__all__ = ["MARS", "MKOR", "KFAC", "LAMB", "LossRateSwitch", "MKOROptions"]
