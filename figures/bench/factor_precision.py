"""MKOR's inverse factors in float32, bf16 round-to-nearest and bf16 stochastic rounding against
the float64 oracle (issue 47 item 3, LP5): per step the kept inverse's errors and the bound.

    python -m figures.bench.factor_precision [--dims 64 128 256] [--steps 400]
        [--streams activations gradients large mlp-a mlp-g] [--variant paper] [--json out.json]

For each stream, width d and mode, the port's factor recursion
(:func:`theory_tests.support.factor_precision.run_recursion`: MKOR's ``update_layer_factors``
with its seeds, the stabiliser at MKOR's defaults) runs ``--steps`` factor updates beside the
float64 oracle's explicit factor L_t (``reference/mkor/factor_precision.py``) and reports:

* e_t = ||J_hat L - I||_2 and epsilon_t = ||L^1/2 J_hat L^1/2 - I||_2: median, 90th percentile,
  maximum;
* the stabiliser's firings, and the steps where the exact inverse would have decided the
  other way (the oracle follows the run's decisions);
* max epsilon_t / B_t (the LP5 bound; <= 1 where it holds) and B_t's median;
* drift: the last quarter's mean epsilon over the second quarter's.

Streams: ``activations`` (a_bar: the mean of a batch of 32 ReLU rows, with the bias's 1),
``gradients`` (g_bar: small zero-mean vectors), ``large`` (vectors of norm ~ 3 sqrt(d): the
factor's condition number in the hundreds, where one write's error dominates), ``mlp-a`` /
``mlp-g`` (the a_bar, d + 1
entries, and the g_bar of the hidden Linear(d, d) of a ReLU MLP trained by MKOR on a synthetic
regression, recorded step by step: a real run's vectors). Prints a Markdown table and a JSON
line.
"""
import argparse
import time

import torch

from figures.bench.timing import emit_json
from theory_tests.support.factor_precision import (MODES, layer_vectors, mlp_run_vectors,
                                                   run_recursion, summary)

COLUMNS = ("eps_p50", "eps_p90", "eps_max", "e_p50", "e_max", "fired", "disagree",
           "eps_over_bound_max", "bound_p50", "drift")
SHOWN_MODES = ("float32", "bf16-nearest", "bf16-stochastic")
STREAMS = ("activations", "gradients", "large", "mlp-a", "mlp-g")


def _vectors(stream, d, steps, seed):
    if stream in ("mlp-a", "mlp-g"):  # a_bar has the bias's 1: d + 1 entries
        return mlp_run_vectors(d, steps, seed)[stream == "mlp-g"]
    return layer_vectors(stream, d, steps, seed)


def run(dims, steps, streams, variant="paper", seed=0):
    """{stream: {d: {mode: summary}}} (``summary`` of the support module, plus drift)."""
    out = {}
    for stream in streams:
        for d in dims:
            vectors = _vectors(stream, d, steps, seed)
            for mode in SHOWN_MODES:
                start = time.perf_counter()
                s = summary(run_recursion(vectors, mode, variant=variant, rounding_seed=seed))
                s["drift"] = s["last_quarter_eps"] / s["first_quarter_eps"]
                s["seconds"] = time.perf_counter() - start
                out.setdefault(stream, {}).setdefault(d, {})[mode] = s
    return out


def table(report):
    lines = ["| stream | d | mode | eps p50 / p90 / max | e p50 / max | fired | "
             "disagree | max eps/B | B p50 | drift |", "|---" * 10 + "|"]
    for stream, by_d in report.items():
        for d, by_mode in by_d.items():
            for mode, s in by_mode.items():
                lines.append(
                    f"| {stream} | {d} | {mode} | {s['eps_p50']:.2e} / {s['eps_p90']:.2e} / "
                    f"{s['eps_max']:.2e} | {s['e_p50']:.2e} / {s['e_max']:.2e} | {s['fired']} | "
                    f"{s['disagree']} | {s['eps_over_bound_max']:.2f} | {s['bound_p50']:.2e} | "
                    f"{s['drift']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m figures.bench.factor_precision",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--streams", nargs="+", choices=STREAMS,
                        default=list(STREAMS))
    parser.add_argument("--variant", default="paper", choices=["paper", "released"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the JSON document here")
    args = parser.parse_args(argv)
    report = run(args.dims, args.steps, args.streams, args.variant, args.seed)
    print(f"MKOR factor recursion, variant {args.variant!r}, {args.steps} factor updates, "
          f"seed {args.seed}, against the float64 oracle (modes: {', '.join(SHOWN_MODES)}; "
          f"torch {torch.__version__})")
    print(table(report))
    emit_json({"steps": args.steps, "variant": args.variant, "seed": args.seed,
               "modes": {m: str(MODES[m]) for m in SHOWN_MODES},
               "results": {s: {str(d): r for d, r in by_d.items()}
                           for s, by_d in report.items()}}, args.json)
    return report


if __name__ == "__main__":
    main()
