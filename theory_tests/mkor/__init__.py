"""MKOR and MKOR-H: the oracle (vectors, factors, the step, the switch, sympy, per expert), the
port against it (differential, factors, the preconditioner, the hybrid, convergence, stacks of
experts). What MKOR shares with K-FAC (capture, discovery, the optimizer surface, real models
and loops) is tested in ``theory_tests/kronecker/``."""
