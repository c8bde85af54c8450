"""The mutation harness (``harness``) and its curated mutants (``mutants``: MKOR, K-FAC and LAMB;
``mutants_mars``, ``mutants_mars_properties``): ``python -m theory_tests.mutation``."""
