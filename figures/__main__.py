"""``python -m figures``: the project's main job.

The convergence figures are not built yet; until they are, this runs the training demo
(``figures/demo.py``) and says so.
"""
import sys

from .demo import main

print("python -m figures: the convergence figures are not built yet; running the MARS demo.")
main(sys.argv[1:])
