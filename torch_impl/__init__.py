"""PyTorch implementations of MARS and MKOR (mirrors ``reference/`` function for function)."""
from .mars import functional
from .mars import MARS, MARS_M, MARSM, MARS_M_Efficient
from .baselines import KFAC, LAMB, from_kfac_pytorch
from .baselines import kfac_factors
from .mkor import MKOR, LossRateSwitch, MKOROptions

__all__ = ["functional", "MARS", "MARSM", "MARS_M", "MARS_M_Efficient", "MKOR", "KFAC", "LAMB", "LossRateSwitch", "MKOROptions", "from_kfac_pytorch", "kfac_factors"]
