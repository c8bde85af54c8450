"""Figures and demos.  ``python -m figures`` is the project's main job."""
