"""Low-precision optimizer state: stochastic rounding, Kahan-compensated parameters, 8-bit block-wise state, 16-bit Kronecker factors."""
