"""The project's own rules: the claim index, the mutant list, the mirror, no import circles,
the wheel, the README."""
