"""Convergence and cost figures.  ``python -m figures`` (the project's main job) regenerates
them; one module per figure, shared pieces in ``common.py``, data in ``data.py``."""
