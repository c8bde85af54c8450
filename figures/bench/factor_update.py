"""MKOR's O(d^2) factor update against K-FAC's O(d^3) factor inverse, timed over layer width d.

    python -m figures.bench.factor_update [--sizes 256 512 1024 2048 4096] [--repeats 7] [--device cpu]

For each d it times, on one SPD d x d factor:

* ``mkor_paper``: one MKOR factor update, variant "paper" (stabiliser test + exact
  Sherman-Morrison inverse of the EMA factor, K8/K11) -- ``torch_impl.mkor.factor_update``;
* ``mkor_released``: the same for the released variant (K10);
* ``kfac_inverse``: K-FAC's damped inverse ``torch.linalg.inv(F + damping I)``;
* ``kfac_eigh``: K-FAC's eigendecomposition ``torch.linalg.eigh(F)`` (the KAISA default).

Runs are interleaved (each repeat times every method once, in turn) and the median is kept,
because these machines are noisy; the slope of log(time) against log(d) is fitted by least
squares over the sizes.  Prints a Markdown table and a JSON line; absolute times are only
comparable within one run, the ratios and slopes are the result.
"""
import argparse
import json
import math

import torch

from figures.bench.timing import interleaved
from torch_impl.mkor.factors import factor_update


def _spd(d, device, dtype):
    g = torch.Generator().manual_seed(d)
    X = torch.randn(d, d, generator=g, dtype=dtype) / d**0.5
    return (X @ X.T + 0.5 * torch.eye(d, dtype=dtype)).to(device)


def methods(d, device, dtype=torch.float32):
    J = _spd(d, device, dtype) / d  # a stored inverse factor, max entry well under 2
    v = torch.randn(d, generator=torch.Generator().manual_seed(d + 1), dtype=dtype).to(device)
    eye = torch.eye(d, dtype=dtype, device=device)
    F = _spd(d, device, dtype)
    return {
        "mkor_paper": lambda: factor_update(J, v, variant="paper", stat_decay=0.95, zeta=0.9,
                                            threshold=2.0),
        "mkor_released": lambda: factor_update(J, v, variant="released", stat_decay=0.95,
                                               zeta=0.9, threshold=2.0),
        "kfac_inverse": lambda: torch.linalg.inv(F + 1e-3 * eye),
        "kfac_eigh": lambda: torch.linalg.eigh(F),
    }


def time_sizes(sizes, repeats, device):
    """{d: {method: median seconds}}, the methods interleaved within each size."""
    return {d: interleaved(methods(d, device), repeats, device, warmup=1) for d in sizes}


def slope(sizes, seconds):
    """Least-squares slope of log(seconds) on log(d)."""
    xs, ys = [math.log(d) for d in sizes], [math.log(s) for s in seconds]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m figures.bench.factor_update", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    table = time_sizes(args.sizes, args.repeats, device)
    names = list(next(iter(table.values())))
    slopes = {n: slope(args.sizes, [table[d][n] for d in args.sizes]) for n in names}
    print(f"factor update vs K-FAC inverse, float32, {device}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}")
    print("| d | " + " | ".join(f"{n} (ms)" for n in names) + " | inverse / mkor_paper |")
    print("|---" * (len(names) + 2) + "|")
    for d in args.sizes:
        row = table[d]
        ratio = row["kfac_inverse"] / row["mkor_paper"]
        print(f"| {d} | " + " | ".join(f"{row[n] * 1e3:.3f}" for n in names) + f" | {ratio:.1f} |")
    print("| slope | " + " | ".join(f"{slopes[n]:.2f}" for n in names) + " | |")
    print(json.dumps({"device": str(device), "threads": torch.get_num_threads(),
                      "seconds": table, "slopes": slopes}))


if __name__ == "__main__":
    main()
