"""The baselines in PyTorch: K-FAC (KAISA form, on MKOR's layer adapters and hooks), its
conversion from kfac-pytorch's hyperparameters, and LAMB (torch has none)."""
from .kfac import KFAC
from .kfac_flavours import kfac_factors
from .kfac_conventions import KFACPytorchConversion, from_kfac_pytorch, kfac_pytorch_scales
from .lamb import LAMB

__all__ = ["KFAC", "LAMB", "KFACPytorchConversion", "from_kfac_pytorch", "kfac_pytorch_scales",
           "kfac_factors"]
