"""MARS and MARS-M in NumPy float64 (spec MARS.md): the equations, the oracle optimizers that
string them together, and the variance-reduction theory behind the figures."""
