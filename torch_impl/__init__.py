"""PyTorch implementations of MARS and MKOR (mirrors ``reference/`` function for function)."""
from .mars import MARS

__all__ = ["MARS"]
