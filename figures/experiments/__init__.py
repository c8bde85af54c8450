"""One module per figure: its experiment (``SPECS``, ``run``) and its plot; ``figures.cli``
runs them and writes to ``figures/out/``."""
