"""K-FAC (oracle, port, robustness, kfac-pytorch's conventions) and LAMB."""
