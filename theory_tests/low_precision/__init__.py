"""Low-precision optimizer state (issue 47): stochastic rounding, Kahan-compensated
parameters, 8-bit block-wise state, factors in 16 bits."""
