"""The figures' command, experiments and parts, and the benchmark scripts."""
