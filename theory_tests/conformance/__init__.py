"""Every optimizer through torch.optim's behaviours (conformance) and the loop features of the
composition matrix."""
