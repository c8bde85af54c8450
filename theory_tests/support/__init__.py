"""Shared harnesses and case lists of the tests (not tests themselves)."""
