"""MKOR and MKOR-H: the oracle (vectors, factors, the step, the switch, sympy), the port against
it, capture and compile routing, Hugging Face models and training loops."""
