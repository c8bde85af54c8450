"""Fused experts (issue 31, item 2): what stepping a stack of matrices costs against the same
matrices as separate 2-D parameters, for MARS-M and MARS-Shampoo.

    python -m figures.bench.moe_mars_m [--experts 8] [--rows 64] [--cols 256] [--repeats 9]
        [--device cpu] [--ns-dtype float32|bfloat16] [--json PATH]

Two stacks shaped like one layer's experts, (E, rows, cols) and (E, cols, rows) -- a wide and
a tall matrix per expert -- are stepped as two parameters in a ``matrix_batch_dims=1`` group
("stacked": one batched Newton-Schulz and one clip-norm reduction per stack) and as 2E
separate 2-D parameters with the same values and gradients ("separate": one Newton-Schulz per
matrix), by MARS-M (loop and foreach) and MARS-Shampoo (loop).  The two do the same
arithmetic (the twin tests: equal to 4.4e-16 in float64); the ratio stacked / separate is the
cost, or the gain, of batching.  Contenders are interleaved and the median kept
(``timing.interleaved``): absolute times compare only within one run.

The Newton-Schulz dtype defaults to bfloat16 on CUDA (the authors') and float32 on the CPU,
where a bf16 matmul without bf16 matrix units is emulated many times slower and both sides
would time the emulation.
"""
import argparse

import torch

from figures.bench.timing import emit_json, interleaved
from torch_impl import MARS, MARSM

__all__ = ["stacks", "bench", "main"]

OPTIMIZERS = {
    "MARS-M loop": lambda groups, ns: MARSM(groups, lr=0.02, ns_dtype=ns, foreach=False),
    "MARS-M foreach": lambda groups, ns: MARSM(groups, lr=0.02, ns_dtype=ns, foreach=True),
    "MARS-Shampoo loop": lambda groups, ns: MARS(groups, lr=0.02, mars_type="mars-shampoo",
                                                 ns_dtype=ns, foreach=False),
}


def stacks(experts, rows, cols, device, seed=0):
    """The two expert stacks (E, rows, cols), (E, cols, rows), with gradients set."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in ((experts, rows, cols), (experts, cols, rows)):
        p = torch.nn.Parameter((0.02 * torch.randn(shape, generator=g)).to(device))
        p.grad = (0.01 * torch.randn(shape, generator=g)).to(device)
        out.append(p)
    return out


def _separate(stacked):
    """The same matrices as 2-D parameters, with the same values and gradient slices."""
    out = []
    for s in stacked:
        for value, grad in zip(s.detach(), s.grad):
            p = torch.nn.Parameter(value.clone())
            p.grad = grad.clone()
            out.append(p)
    return out


def bench(repeats, device, experts=8, rows=64, cols=256, ns_dtype=torch.float32):
    """{contender: median seconds per step} and {optimizer: stacked / separate}."""
    steps = {}
    for name, make in OPTIMIZERS.items():
        stacked = stacks(experts, rows, cols, device)
        steps[f"{name}, stacked"] = make([dict(params=stacked, matrix_batch_dims=1)],
                                         ns_dtype).step
        steps[f"{name}, separate"] = make(_separate(stacked), ns_dtype).step
    for step in steps.values():  # state creation
        step()
    times = interleaved(steps, repeats, device, warmup=1)
    ratios = {name: times[f"{name}, stacked"] / times[f"{name}, separate"] for name in OPTIMIZERS}
    return times, ratios


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m figures.bench.moe_mars_m",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--cols", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ns-dtype", choices=["bfloat16", "float32"], default=None,
                        help="Newton-Schulz dtype (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--json", help="also write the JSON document here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    ns_name = args.ns_dtype or ("bfloat16" if device.type == "cuda" else "float32")
    times, ratios = bench(args.repeats, device, args.experts, args.rows, args.cols,
                          getattr(torch, ns_name))
    shapes = f"E={args.experts}: ({args.rows}, {args.cols}) and ({args.cols}, {args.rows})"
    print(f"device {device}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"{ns_name} Newton-Schulz, median of {args.repeats} interleaved rounds; {shapes}")
    print("\n| optimizer | stacked (ms) | separate (ms) | stacked / separate |\n|---|---|---|---|")
    for name, ratio in ratios.items():
        print(f"| {name} | {times[f'{name}, stacked'] * 1e3:.2f} | "
              f"{times[f'{name}, separate'] * 1e3:.2f} | {ratio:.2f} |")
    report = {"device": str(device), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "repeats": args.repeats, "experts": args.experts,
              "rows": args.rows, "cols": args.cols, "ns_dtype": ns_name,
              "step_seconds": times, "stacked_over_separate": ratios}
    emit_json(report, args.json)
    return report


if __name__ == "__main__":
    main()
