"""What the families share: matrix functions (Newton-Schulz, SVD orthogonalisation), the
first-order rules (torch.optim's SGD / Adam / AdamW, Lion and LAMB: MKOR's backbones and the
oracles of MARS's reductions; ``first_order``), the small test problems the oracles and
figures run on (``problems``), and the fused mixture-of-experts forward model whose rows
MKOR's and K-FAC's per-expert equations take (``moe``)."""
