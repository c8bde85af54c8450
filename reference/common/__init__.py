"""What both families share: matrix functions (Newton-Schulz, SVD orthogonalisation), the
small test problems the oracles and figures run on (``problems``), and the fused
mixture-of-experts forward model whose rows MKOR's and K-FAC's per-expert equations take
(``moe``)."""
