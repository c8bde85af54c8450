"""MKOR and MKOR-H in NumPy float64 (spec MKOR.md): rank-1 statistics (``vectors``), factor
inverses and the stabiliser (``factors``), preconditioning and the whole step
(``preconditioner``), the hybrid switch (``hybrid``), and fused mixture-of-experts modules as
stacks of independent layers (``experts``)."""
