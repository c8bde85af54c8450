"""MARS and MARS-M: the oracle's properties, the port against the oracle, options, exact mode,
compiled and fast paths, the torch.optim surface."""
