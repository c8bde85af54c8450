"""``python -m figures``: the command line is :mod:`figures.cli`. (The guard matters: each
``--jobs`` worker is spawned and re-imports this file as ``__mp_main__``.)"""
from .cli import main

if __name__ == "__main__":
    main()
