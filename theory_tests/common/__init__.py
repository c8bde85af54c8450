"""What spans the families: Newton-Schulz, symbolic equivalences, independent oracles."""
