"""Rank-k MKOR's factor update (KC8, Woodbury) against the rank-1 update (K8), at one width.

    python -m figures.bench.rank_k [--d 1024] [--ranks 1 2 4 8 16] [--repeats 15] [--device cpu]

Times, on one d x d inverse factor in float32 (the port's functions alone, each writing into a
reused output buffer as :func:`torch_impl.mkor.layer_state.update_layer_factors` does):

* ``rank1``: ``torch_impl.mkor.factors.factor_update``, variant "paper" (what ``rank=1`` runs);
* ``rank k``: ``torch_impl.mkor.rank_k.rank_k_factor_update`` with k group means, variant
  "paper", for each k (k = 1 is the Woodbury code on one vector).

Every contender runs interleaved with the others in each repeat, and the median is kept
(``figures.bench.timing.interleaved``). Prints a Markdown table of the ratios rank-k / rank-1
and a JSON line. The cost model: O(d^2) passes over J (the same as rank 1) plus V J, a
k x d by d x d product (2 k d^2 flops) and Z^T Z (k d^2 more): for small k memory-bound like
rank 1, for large k the two GEMMs dominate.
"""
import argparse

import torch

from figures.bench.timing import emit_json, interleaved
from torch_impl.mkor.factors import factor_update
from torch_impl.mkor.rank_k import rank_k_factor_update

OPTIONS = dict(variant="paper", stat_decay=0.95, zeta=0.9, threshold=2.0)


def contenders(d, ranks, device, dtype=torch.float32):
    """{name: fn} timing the rank-1 update and each rank k on the same J."""
    g = torch.Generator().manual_seed(d)
    X = torch.randn(d, d, generator=g, dtype=dtype) / d ** 0.5
    J = ((X @ X.T + 0.5 * torch.eye(d, dtype=dtype)) / d).to(device)  # max entry well under 2
    V = torch.randn(max(ranks), d, generator=g, dtype=dtype).to(device)
    out = torch.empty_like(J)
    fns = {"rank1": lambda: factor_update(J, V[0], out=out, **OPTIONS)}
    for k in ranks:
        fns[f"rank {k}"] = lambda k=k: rank_k_factor_update(J, V[:k], out=out, **OPTIONS)
    return fns


def run(d, ranks, repeats, device):
    """{"seconds": {name: median s}, "ratios": {k: rank-k / rank-1}}."""
    seconds = interleaved(contenders(d, ranks, device), repeats, device)
    return {"seconds": seconds,
            "ratios": {k: seconds[f"rank {k}"] / seconds["rank1"] for k in ranks}}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m figures.bench.rank_k",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    report = run(args.d, args.ranks, args.repeats, device)
    print(f"rank-k factor update / rank-1, d = {args.d}, float32, {device}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, median of "
          f"{args.repeats} interleaved rounds; rank-1: {report['seconds']['rank1'] * 1e3:.3f} ms")
    print("| k | " + " | ".join(str(k) for k in args.ranks) + " |")
    print("|---" * (len(args.ranks) + 1) + "|")
    print("| time (ms) | " + " | ".join(f"{report['seconds'][f'rank {k}'] * 1e3:.3f}"
                                       for k in args.ranks) + " |")
    print("| rank-k / rank-1 | " + " | ".join(f"{report['ratios'][k]:.2f}"
                                             for k in args.ranks) + " |")
    emit_json({"device": str(device), "threads": torch.get_num_threads(), "d": args.d,
               **report})
    return report


if __name__ == "__main__":
    main()
