"""The figures ``python -m figures`` builds, by name (each one module of
``figures.experiments``), in the order ``summary.md`` lists them.

A module of its own, apart from ``figures.cli``: the command line imports every experiment
(``importlib.import_module``), and an experiment that needs the list (``budget_scan``'s
``--redraw`` rewrites ``summary.md``) reads it here, so no experiment imports the command
line back (``theory_tests/project/test_import_graph.py`` checks that no such circle exists).
"""
FIGURES = ("noisy_quadratic", "variance_reduction", "mnist1d_mlp", "digits_cnn",
           "shakespeare_gpt", "cost", "bert_mlm", "rank1_approximation", "budget_scan",
           "orthogonalisers", "curvature_distance", "low_precision")
