"""The proofs: differential, property, symbolic, statistical, distributed and real-library tests."""
