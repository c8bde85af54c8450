"""MKOR and MKOR-H in NumPy float64 (spec MKOR.md): rank-1 statistics (``vectors``), factor
inverses and the stabiliser (``factors``), rank-k group means and Woodbury updates (``rank_k``:
KC7, KC8), preconditioning and the whole step (``preconditioner``), the hybrid switch
(``hybrid``), and the per-expert equations on fused mixture-of-experts modules, each expert its
own layer (``experts``; the forward model and its rows are ``reference.common.moe``)."""
