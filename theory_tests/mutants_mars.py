"""Curated mutants of the MARS family (MARS-AdamW, -Lion, -Shampoo, MARS-M): one-line bugs
in the math, keyed by the ``paper_notes/claims.md`` row whose tests must kill them. The
format is ``mutants.Mutant``'s; ``mutants.py`` merges this list into ``MUTANTS``.
"""
from mutant import Mutant

R_MARS, R_NS = "reference/mars.py", "reference/matrix_functions.py"

MARS_MUTANTS = {
    # -- the oracle's equations --
    "M1": [Mutant(R_MARS, "    return g + correction_coefficient(gamma, beta1) * (g - g_prev)",
                  "    return g + correction_coefficient(gamma, beta1) * (g - 2 * g_prev)")],
    "M2": [Mutant(R_MARS, "    return gamma * beta1 / (1.0 - beta1)", "    return gamma * beta1 / (1.0 + beta1)")],
    "M3": [Mutant(R_MARS, "    return c / norm if norm > 1.0 else c", "    return c / norm if norm > 2.0 else c")],
    "M4": [Mutant(R_MARS, "    return beta1 * m + (1.0 - beta1) * c", "    return beta1 * m + c")],
    "M6": [Mutant(R_MARS, "    return beta2 * v + (1.0 - beta2) * c * c", "    return beta2 * v + (1.0 - beta2) * c * abs(c) ** 0.5")],
    "M7": [Mutant(R_MARS, "    return m / ((np.sqrt(v) / np.sqrt(bc2) + eps) * bc1)",
                  "    return m / ((np.sqrt(v) + eps) * bc1)")],
    "M8": [Mutant(R_MARS, "    return p - lr * (u + weight_decay * p)", "    return p - lr * u - weight_decay * p")],
    "M9": [Mutant(R_MARS, "    return np.maximum(v_max, v)", "    return np.minimum(v_max, v)")],
    "M10": [Mutant(R_MARS, "    return np.sign(m)", "    return np.sign(m) * 0.5")],
    "M12": [
        # Not equivalent: NS divides by ||M|| + eps, so the prescale moves O by ~eps / ||m||.
        Mutant(R_MARS, "    scaled = m / (1.0 - beta1)", "    scaled = m"),
        Mutant(R_MARS, "    return max(1.0, rows / cols) ** 0.5 if cols else 1.0",
               "    return max(1.0, cols / rows) ** 0.5 if cols else 1.0"),
    ],
    "M13": [Mutant(R_NS, "        X = a * X + (b * Q + c * (Q @ Q)) @ X", "        X = a * X + (b * Q + c * Q) @ X")],
}
