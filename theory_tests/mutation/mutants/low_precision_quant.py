"""Mutants of the block-wise 8-bit quantizer of optimizer state (issue 47 item 4, LP4): its
oracle (row LP4) and its port (row QUANT8-PORT), keyed by the ``paper_notes/claims.md`` row
whose tests must kill them."""
from ..mutant import Mutant

__all__ = ["MUTANTS"]

R_BLOCKWISE = "reference/common/blockwise.py"
T_BLOCKWISE = "torch_impl/common/blockwise.py"

MUTANTS = {
    "LP4": [
        # the block scale is the mean |x| instead of the absmax
        Mutant(R_BLOCKWISE, "    s = padded.reshape(n_blocks, block_size).max(axis=1)",
               "    s = np.abs(padded.reshape(n_blocks, block_size)).mean(axis=1)"),
        # each value divided by the previous block's scale (off-by-one block index)
        Mutant(R_BLOCKWISE, "y = (flat / safe[block]).astype(np.float32)",
               "y = (flat / safe[np.maximum(block - 1, 0)]).astype(np.float32)"),
        # floor instead of nearest: the largest entry <= y
        Mutant(R_BLOCKWISE,
               "d = np.abs(y.astype(np.float64)[:, None] - code.astype(np.float64)[None, :])",
               "d = np.where(code[None, :] <= y[:, None], y.astype(np.float64)[:, None] - "
               "code[None, :], np.inf)"),
        # a tie goes to the entry of larger magnitude
        Mutant(R_BLOCKWISE, "magnitude = np.where(ties, np.abs(code.astype(np.float64))[None, :]",
               "magnitude = np.where(ties, -np.abs(code.astype(np.float64))[None, :]"),
        # the unsigned map (second moments) is the signed one
        Mutant(R_BLOCKWISE, "    code = np.concatenate([[0.0], _tree(8)])",
               "    code = np.sort(np.concatenate([-_tree(7), [0.0, 1e-7], _tree(7)]))"),
        # the tree's decades spaced over (0, 10^-z] instead of (10^-(z+1), 10^-z]
        Mutant(R_BLOCKWISE, "values.append((n + 9.0 * k) / (n * 10.0 ** (z + 1)))",
               "values.append((10.0 * k) / (n * 10.0 ** (z + 1)))"),
        # a non-finite block's values keep their quotient instead of the code of 0
        Mutant(R_BLOCKWISE, "    y[np.isnan(s)[block]] = 0.0\n", "\n"),
    ],
    "QUANT8-PORT": [
        # the block scale is the mean |x| instead of the absmax
        Mutant(T_BLOCKWISE, "    s = body.amax(dim=1)", "    s = body.mean(dim=1)"),
        # the shorter last block divided by the previous block's scale
        Mutant(T_BLOCKWISE, "torch.div(tail, safe[full:], out=y_tail)",
               "torch.div(tail, safe[full - 1:full], out=y_tail)"),
        # dequantized with the previous block's scale (off-by-one block index)
        Mutant(T_BLOCKWISE, "body.mul_(absmax[:full, None])",
               "body.mul_(absmax.roll(1)[:full, None])"),
        # floor instead of nearest: the largest entry <= y
        Mutant(T_BLOCKWISE, "q = torch.bucketize(y, mid, out_int32=True)",
               "q = torch.bucketize(y, code[1:], right=True, out_int32=True)"),
        # a tie on the negative side goes away from zero (the tie rule dropped)
        Mutant(T_BLOCKWISE, "y = torch.where(y < 0, torch.nextafter(",
               "y = torch.where(y < -2, torch.nextafter("),
        # the unsigned map (second moments) is the signed one
        Mutant(T_BLOCKWISE, "    return _code(False, device)", "    return _code(True, device)"),
        # the entries rounded to 15 bits, not the oracle's 16
        Mutant(T_BLOCKWISE, "torch.round(m * float(2 ** bits))",
               "torch.round(m * float(2 ** (bits - 1)))"),
        # an infinite value's block keeps scale inf instead of NaN
        Mutant(T_BLOCKWISE, '    return s.masked_fill(~torch.isfinite(s), float("nan"))',
               "    return s"),
        # a non-finite block's values keep their quotient instead of the code of 0
        Mutant(T_BLOCKWISE, "y_body.masked_fill_(bad[:full, None], 0.0)",
               "y_body.masked_fill_(bad[:full, None] & False, 0.0)"),
    ],
}
