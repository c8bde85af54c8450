"""Mutants of issue 32's orthogonalisers (coefficient schedules M13a, Gram Newton-Schulz M13b,
Polar Express M13c, batching by shape), keyed by the ``paper_notes/claims.md`` row whose
tests must kill them (``mutant.Mutant``'s format)."""
from .mutant import Mutant

__all__ = ["ORTHOGONALISER_MUTANTS"]

R_MF, T_MF = "reference/common/matrix_functions.py", "torch_impl/common/matrix_functions.py"
T_FN, T_MC = "torch_impl/mars/functional.py", "torch_impl/mars/mars_m_compiled.py"
T_SH = "torch_impl/common/sharding.py"
OWNER = ("theory_tests/distributed/test_owner_orthogonalisation.py::"
         "test_an_owner_orthogonalises_its_same_shape_matrices_in_one_call",)

ORTHOGONALISER_MUTANTS = {
    "ORTH-SCHEDULE": [
        # the oracle ignores the schedule: the authors' triple at every step
        Mutant(R_MF, "    for a, b, c in ns_schedule(coefficients, steps):",
               "    for a, b, c in (NS_COEFFICIENTS,) * steps:"),
        # the port runs the first triple at every step
        Mutant(T_MF, "    for a, b, c in schedule:  # b Q X",
               "    for a, b, c in schedule[:1] * len(schedule):  # b Q X"),
        # a sequence cycles instead of repeating its last triple (oracle, port)
        Mutant(R_MF, "    return tuple(triples[min(k, len(triples) - 1)] for k in range(steps))",
               "    return tuple(triples[k % len(triples)] for k in range(steps))"),
        Mutant(T_MF, "    return tuple(triples[min(k, len(triples) - 1)] for k in range(steps))",
               "    return tuple(triples[k % len(triples)] for k in range(steps))"),
        # the port's first Polar Express step without the folded 1.01 normalisation
        Mutant(T_MF, "    t = PE_SAFETY * (PE_SAFETY if k == 0 else 1.0)", "    t = PE_SAFETY"),
    ],
    "ORTH-POLAR-EXPRESS": [
        # Remez's alternation signs wrong: not the minimax quintic
        Mutant(R_MF, "        system = np.column_stack([nodes, nodes**3, nodes**5, [1.0, -1.0, 1.0, -1.0]])",
               "        system = np.column_stack([nodes, nodes**3, nodes**5, [1.0, 1.0, -1.0, -1.0]])"),
        # no recentring: the greedy image is not centred on 1
        Mutant(R_MF, "        t = 2 / (quintic(lo, (a, b, c)) + quintic(hi, (a, b, c)))",
               "        t = 1.0"),
        # no cushion: the early polynomials made on [l, u]
        Mutant(R_MF, "        a, b, c = optimal_quintic(max(lo, cushion * hi), hi)",
               "        a, b, c = optimal_quintic(lo, hi)"),
        # the port's table: one digit of the paper's first triple off
        Mutant(T_MF, "    (8.28721201814563, -23.595886519098837, 17.300387312530933),",
               "    (8.28721201814563, -23.595886519098837, 17.300387812530933),"),
    ],
    "ORTH-GRAM": [
        # the shift not relative to ||Y||_F (oracle)
        Mutant(R_MF, "    return Y + shift * lift * np.eye(len(Y))",
               "    return Y + shift * np.eye(len(Y))"),
        # a restart's Gram matrix lifted by the first block's worst case (oracle)
        Mutant(R_MF, "    lift = np.linalg.norm(Y) / (np.sqrt(len(Y)) if restart else 1.0)",
               "    lift = np.linalg.norm(Y)"),
        # a restart's Gram matrix not lifted (the port: Y_0 alone shifted)
        Mutant(T_MF, "    lift = torch.linalg.matrix_norm(Y) / (math.sqrt(Y.size(-1)) if restart else 1.0)",
               "    lift = torch.linalg.matrix_norm(Y) * (0.0 if restart else 1.0)"),
        # a restart that keeps the stale Gram matrix (oracle)
        Mutant(R_MF, "            Y, R = shifted_gram(X, shift, restart=True), eye", "            R = eye"),
        # the port drops its shift
        Mutant(T_MF, "    Y.diagonal(dim1=-2, dim2=-1).add_(shift * lift.unsqueeze(-1))",
               "    Y.diagonal(dim1=-2, dim2=-1).add_(0.0 * lift.unsqueeze(-1))"),
        # the port never restarts
        Mutant(T_MF, '    block of two steps, then blocks of three (2, 5, 8, ...)."""\n    return tuple(range(2, steps, 3))',
               '    block of two steps, then blocks of three (2, 5, 8, ...)."""\n    return ()'),
        # the port forgets the normalisation at the end of the last block
        Mutant(T_MF, "    X = (R * scale) @ X\n    if M.size(-2) > M.size(-1):",
               "    X = R @ X\n    if M.size(-2) > M.size(-1):"),
        # the Gram form taken where it costs as much (aspect 1.5)
        Mutant(R_MF, "    return min(rows, cols) > 0 and gram < standard",
               "    return min(rows, cols) > 0 and gram <= standard"),
        # a block's count off by one step's Y <- H Y H
        Mutant(T_MF, "    return steps * (2 * alpha + 1), sum(2 * alpha + 4 * r - 3 for r in blocks)",
               "    return steps * (2 * alpha + 1), sum(2 * alpha + 4 * r - 1 for r in blocks)"),
    ],
    "ORTH-BATCH": [
        # results split back in the wrong order
        Mutant(T_SH, "            for i, r in zip(batch, results):",
               "            for i, r in zip(batch[::-1], results):"),
        # no bound on a batch's size
        Mutant(T_SH, "            if batches[-1] and size + matrices[i].numel() > max_numel:",
               "            if False:"),
        # MARS-Shampoo's directions assigned to the wrong matrices
        Mutant(T_FN, "    for i, d in zip(rest, orthogonalize_by_shape(direction, [ms[i] for i in rest])):",
               "    for i, d in zip(rest[::-1], orthogonalize_by_shape(direction, [ms[i] for i in rest])):"),
        # the owner rank back to one call per matrix
        Mutant(T_SH, "    for j, out in zip(mine, orthogonalize_by_shape(fn, fulls)):",
               "    for j, out in zip(mine, [fn(f) for f in fulls]):", tests=OWNER),
        # the compiled kernel steps every matrix of a group with the first one's direction
        Mutant(T_MC, "        mars_m_equations.mars_m_step_(p, o[i], h, COMPILED)",
               "        mars_m_equations.mars_m_step_(p, o[0], h, COMPILED)"),
        # the compiled path drops the schedule
        Mutant(T_MC, '                ns["ns_coefficients"], ns["orthogonalizer"])',
               '                "authors", ns["orthogonalizer"])'),
    ],
}
