"""The baselines in NumPy float64: torch.optim's first-order rules and LAMB (``first_order``,
also MKOR's backbones) and K-FAC in its KAISA form, per expert too (``kfac``)."""
