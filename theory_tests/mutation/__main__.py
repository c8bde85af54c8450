"""python -m theory_tests.mutation [--jobs 2] [--only ID ...] [--list] [--json FILE]"""
import sys

from theory_tests.mutation.harness import main
from theory_tests.mutation.mutants import MUTANTS

if __name__ == "__main__":
    sys.exit(main(MUTANTS))
