"""What both families share: matrix functions (Newton-Schulz, SVD orthogonalisation) and the
small test problems the oracles and figures run on."""
