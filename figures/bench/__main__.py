"""python -m figures.bench [...]: see :mod:`figures.bench.optimizer_step`."""
from figures.bench.optimizer_step import main

if __name__ == "__main__":
    main()
