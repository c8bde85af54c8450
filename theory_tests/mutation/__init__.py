"""The mutation harness (``harness``) and its curated mutants (``mutants/``, one module per code
area they mutate, keyed by claims row): ``python -m theory_tests.mutation``."""
