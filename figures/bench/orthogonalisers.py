"""MARS-M's and MARS-Shampoo's orthogonalisers against ``torch.optim.Muon`` (issue 32, item 4).

    python -m figures.bench.orthogonalisers [--width 256] [--layers 6] [--repeats 15]
        [--no-compile] [--no-svd] [--device cpu] [--json PATH]

The list is the block matrices of the GPT-like list (``timing.gpt_like_params``,
embeddings left out): per block qkv (3d x d), proj (d x d), fc (4d x d) and fc2 (d x 4d), so
three matrices in four are rectangular (aspect ratio 3 or 4) -- 24 matrices at d = 256 and 6
blocks.  Every contender steps its own copy (the same values and gradients), bf16
Newton-Schulz on both sides (torch's Muon always runs it in bf16).

Three tables, each interleaved (``timing.interleaved``: every round times every
contender once) with medians and ratios against the reference measured in the same run:

* **MARS-M** (``MARSM``, lr 0.02, wd 0.1) under each option -- ``ns_coefficients`` "authors" /
  "polar_express" x ``orthogonalizer`` "newton_schulz" / "gram_newton_schulz" -- eager and
  ``compiled=True``, against ``torch.optim.Muon(adjust_lr_fn="match_rms_adamw")`` eager (the
  reference) and torch-compiled (``timing.compiled_muon``; same hyperparameters as
  ``bench_mars_m``).
* **MARS-Shampoo** (``MARS(mars_type="mars-shampoo")``) under the same four options, plus
  the SVD and one ``compiled=True`` row, against Muon eager.  ``compiled=True`` compiles
  MARS's elementwise routes only: Shampoo matrices stay eager (``functional.mars``: "matmul-
  bound: stays eager"), so on a list of matrices it runs the eager step.
* **Newton-Schulz alone** on the same matrices (the gradients, cast to bf16 as MARS-M casts
  its momentum): torch's ``_zeropower_via_newtonschulz`` per matrix (what Muon's step calls)
  against MARS-M's direction (``mars_m_direction``) per matrix and batched by shape
  (``sharding.orthogonalize_by_shape``, what the eager step does), with each option's flops
  (2 x ``gram_flops``' multiply-adds) and its distance to the exact polar factor on these
  matrices, ||O - U V^T||_F / ||U V^T||_F (U V^T in float64; Gaussian matrices are well
  conditioned, so this is a sanity check, not figure 10's accuracy on trained momenta).

The first step of each contender (state creation, and compilation) is timed on its own and
reported.  The compiled MARS-M path compiles one graph per matrix shape and option (4 x 4
here), above dynamo's default ``recompile_limit`` of 8, where ``fullgraph=True`` raises
``FailOnRecompileLimitHit``; the benchmark raises the limit while it runs (``RECOMPILE_LIMIT``).
"""
import argparse
import functools
import inspect
import time

import torch

from figures.experiments.orthogonalisers import option_flops
from figures.bench.timing import compiled_muon, emit_json, gpt_like_params, interleaved
from torch_impl import MARS, MARSM
from torch_impl.common.matrix_functions import orthogonalize_svd
from torch_impl.common.sharding import orthogonalize_by_shape
from torch_impl.mars.mars_m_equations import mars_m_direction

__all__ = ["OPTIONS", "block_matrices", "bench_mars_m_options", "bench_shampoo_options",
           "bench_newton_schulz", "run", "tables", "main"]

# (label, ns_coefficients, orthogonalizer); the first is MARS-M's default
OPTIONS = (("authors NS", "authors", "newton_schulz"),
           ("polar_express NS", "polar_express", "newton_schulz"),
           ("authors Gram", "authors", "gram_newton_schulz"),
           ("polar_express Gram", "polar_express", "gram_newton_schulz"))
REPEATS = 15
RECOMPILE_LIMIT = 64
NS_STEPS = 5
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw",
            nesterov=False)
MUON_REFERENCE = "Muon (torch) eager"


def block_matrices(device, width=256, layers=6):
    """The 2-D block matrices of ``gpt_like_params(d=width, layers=layers)``, gradients set:
    per block (3d, d), (d, d), (4d, d), (d, 4d)."""
    params = gpt_like_params(device, vocab=1, d=width, layers=layers, ctx=1)
    return [p for p in params[2:] if p.ndim == 2]  # [0], [1]: the embeddings


def _first_steps(makers, device, width, layers):
    """Each contender's step on its own copy of the matrices, after one first step (timed:
    state creation and, for the compiled ones, compilation)."""
    steps, first = {}, {}
    for name, make in makers.items():
        step = make(block_matrices(device, width, layers)).step
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        first[name] = time.perf_counter() - start
        steps[name] = step
    return steps, first


def _mars_m(coefficients, orthogonalizer, compiled):
    return lambda ps: MARSM(ps, lr=0.02, weight_decay=0.1, ns_dtype=torch.bfloat16,
                            ns_coefficients=coefficients, orthogonalizer=orthogonalizer,
                            compiled=compiled)


def bench_mars_m_options(repeats, device, width=256, layers=6, compiled=True):
    """{contender: median s}, {contender: first-step s}: Muon eager / compiled and MARS-M
    under each option, eager and (``compiled``) compiled."""
    makers = {MUON_REFERENCE: lambda ps: torch.optim.Muon(ps, **MUON)}
    if compiled:
        makers["Muon (torch) compiled"] = lambda ps: compiled_muon(ps, **MUON)
    for label, coefficients, orthogonalizer in OPTIONS:
        makers[f"MARS-M {label} eager"] = _mars_m(coefficients, orthogonalizer, False)
        if compiled:
            makers[f"MARS-M {label} compiled"] = _mars_m(coefficients, orthogonalizer, True)
    with torch._dynamo.config.patch(recompile_limit=max(RECOMPILE_LIMIT,
                                                        torch._dynamo.config.recompile_limit)):
        steps, first = _first_steps(makers, device, width, layers)
        return interleaved(steps, repeats, device, warmup=1), first


def _shampoo(orthogonalizer, coefficients="authors", compiled=False):
    return lambda ps: MARS(ps, lr=0.02, weight_decay=0.1, mars_type="mars-shampoo",
                           ns_dtype=torch.bfloat16, orthogonalizer=orthogonalizer,
                           ns_coefficients=coefficients, compiled=compiled)


def bench_shampoo_options(repeats, device, width=256, layers=6, svd=True):
    """{contender: median s}, {contender: first-step s}: Muon eager and MARS-Shampoo under
    each option (eager), its ``compiled=True`` with the default option, and (``svd``) the SVD."""
    makers = {MUON_REFERENCE: lambda ps: torch.optim.Muon(ps, **MUON)}
    for label, coefficients, orthogonalizer in OPTIONS:
        makers[f"MARS-Shampoo {label}"] = _shampoo(orthogonalizer, coefficients)
    makers["MARS-Shampoo authors NS, compiled=True"] = _shampoo("newton_schulz", compiled=True)
    if svd:
        makers["MARS-Shampoo SVD"] = _shampoo("svd")
    steps, first = _first_steps(makers, device, width, layers)
    return interleaved(steps, repeats, device, warmup=1), first


def _muon_newton_schulz():
    """torch's own iteration, as ``Muon.step`` calls it (private: the benchmark's only use)."""
    from torch.optim._muon import _zeropower_via_newtonschulz
    defaults = inspect.signature(torch.optim.Muon).parameters
    coefficients, eps = defaults["ns_coefficients"].default, defaults["eps"].default
    return lambda m: _zeropower_via_newtonschulz(m, coefficients, NS_STEPS, eps)


def _polar_distance(outs, exact):
    return sum((o.double() - u).norm() / u.norm() for o, u in zip(outs, exact)).item() / len(exact)


def bench_newton_schulz(repeats, device, width=256, layers=6):
    """The orthogonalisation alone, on the list's gradients: {contender: median s} and
    {contender: dict(gflop, polar_distance)}."""
    mats = [p.grad for p in block_matrices(device, width, layers)]
    shapes = [tuple(m.shape) for m in mats]
    muon_ns = _muon_newton_schulz()
    fns = {"Muon (torch) NS, per matrix": lambda: [muon_ns(m) for m in mats]}
    info = {"Muon (torch) NS, per matrix": option_flops(shapes, NS_STEPS, "newton_schulz")}
    for label, coefficients, orthogonalizer in OPTIONS:
        direction = functools.partial(mars_m_direction, ns_steps=NS_STEPS,
                                      ns_dtype=torch.bfloat16, ns_coefficients=coefficients,
                                      orthogonalizer=orthogonalizer)
        fns[f"MARS-M {label}, per matrix"] = (
            lambda d=direction: [d(m.to(torch.bfloat16)) for m in mats])
        fns[f"MARS-M {label}, batched by shape"] = (
            lambda d=direction: orthogonalize_by_shape(d, [m.to(torch.bfloat16) for m in mats]))
        for way in ("per matrix", "batched by shape"):
            info[f"MARS-M {label}, {way}"] = option_flops(shapes, NS_STEPS, orthogonalizer)
    exact = [orthogonalize_svd(m.double()) for m in mats]
    details = {name: dict(gflop=info[name] / 1e9, polar_distance=_polar_distance(fn(), exact))
               for name, fn in fns.items()}
    return interleaved(fns, repeats, device, warmup=1), details


def run(repeats=REPEATS, device=torch.device("cpu"), width=256, layers=6, compiled=True,
        svd=True):
    """All three tables' measurements, one JSON-ready dict."""
    start = time.perf_counter()
    shapes = [tuple(p.shape) for p in block_matrices(torch.device("cpu"), width, layers)]
    m_times, m_first = bench_mars_m_options(repeats, device, width, layers, compiled)
    s_times, s_first = bench_shampoo_options(repeats, device, width, layers, svd)
    ns_times, ns_details = bench_newton_schulz(repeats, device, width, layers)
    ref = m_times[MUON_REFERENCE]
    mars_m_ratios = {}
    for label, _, _ in OPTIONS:
        r = {"eager / Muon eager": m_times[f"MARS-M {label} eager"] / ref}
        if compiled:
            c = m_times[f"MARS-M {label} compiled"]
            r["compiled / Muon compiled"] = c / m_times["Muon (torch) compiled"]
            r["compiled / Muon eager"] = c / ref
        mars_m_ratios[label] = r
    shampoo_ratios = {name: t / s_times[MUON_REFERENCE] for name, t in s_times.items()
                      if name != MUON_REFERENCE}
    ns_ref = ns_times["Muon (torch) NS, per matrix"]
    return {
        "list": dict(width=width, layers=layers, matrices=len(shapes),
                     shapes=sorted(set(shapes)), entries=sum(a * b for a, b in shapes),
                     ns_dtype="bfloat16", ns_steps=NS_STEPS),
        "repeats": repeats,
        "mars_m_step_seconds": m_times, "mars_m_first_step_seconds": m_first,
        "mars_m_ratios": mars_m_ratios,
        "shampoo_step_seconds": s_times, "shampoo_first_step_seconds": s_first,
        "shampoo_ratios_vs_muon_eager": shampoo_ratios,
        "ns_seconds": ns_times, "ns_details": ns_details,
        "ns_ratios_vs_muon_ns": {name: t / ns_ref for name, t in ns_times.items()},
        "wall_seconds": time.perf_counter() - start,
    }


def tables(report):
    """The three Markdown tables of ``run``'s report, one string."""
    lst = report["list"]
    head = (f"{lst['matrices']} block matrices of the GPT-like list (d = {lst['width']}, "
            f"{lst['layers']} blocks; shapes {', '.join('x'.join(map(str, s)) for s in lst['shapes'])}; "
            f"{lst['entries'] / 1e6:.2f}M entries), bf16 Newton-Schulz ({lst['ns_steps']} steps), "
            f"median of {report['repeats']} interleaved rounds")
    m = report["mars_m_step_seconds"]
    ref, comp = m[MUON_REFERENCE], m.get("Muon (torch) compiled")
    lines = [f"\nMARS-M options vs torch Muon, {head}",
             "| contender | median (ms) | / Muon eager | / Muon compiled | first step (s) |",
             "|---|---|---|---|---|"]
    for name, t in m.items():
        vs_compiled = f"{t / comp:.2f}" if comp else "-"
        lines.append(f"| {name} | {t * 1e3:.2f} | {t / ref:.2f} | {vs_compiled} | "
                     f"{report['mars_m_first_step_seconds'][name]:.1f} |")
    s = report["shampoo_step_seconds"]
    lines += [f"\nMARS-Shampoo options vs torch Muon (eager), {head}",
              "| contender | median (ms) | / Muon eager | first step (s) |", "|---|---|---|---|"]
    for name, t in s.items():
        lines.append(f"| {name} | {t * 1e3:.2f} | {t / s[MUON_REFERENCE]:.2f} | "
                     f"{report['shampoo_first_step_seconds'][name]:.1f} |")
    ns = report["ns_seconds"]
    ns_ref = ns["Muon (torch) NS, per matrix"]
    lines += [f"\nNewton-Schulz alone (the gradients, bf16), {head}",
              "| orthogonalisation | median (ms) | / Muon NS | GFLOP | GFLOP/s "
              "| rel. distance to U V^T |", "|---|---|---|---|---|---|"]
    for name, t in ns.items():
        d = report["ns_details"][name]
        lines.append(f"| {name} | {t * 1e3:.2f} | {t / ns_ref:.2f} | {d['gflop']:.2f} | "
                     f"{d['gflop'] / t:.0f} | {d['polar_distance']:.3f} |")
    lines.append("\nstep minus its orthogonalisation (eager; the elementwise passes and "
                 "dispatch), ms: Muon "
                 f"{(ref - ns_ref) * 1e3:.1f}; " + "; ".join(
                     f"MARS-M {label} {(m[f'MARS-M {label} eager'] - ns[f'MARS-M {label}, batched by shape']) * 1e3:.1f}"
                     for label, _, _ in OPTIONS))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m figures.bench.orthogonalisers",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256,
                        help="the blocks' d (matrices 3d x d, d x d, 4d x d, d x 4d)")
    parser.add_argument("--layers", type=int, default=6, help="blocks of matrices")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-compile", action="store_true", help="eager paths only")
    parser.add_argument("--no-svd", action="store_true", help="leave out MARS-Shampoo's SVD")
    parser.add_argument("--json", help="also write the JSON document here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    print(f"device {device}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"median of {args.repeats} interleaved rounds")
    report = {"device": str(device), "threads": torch.get_num_threads(),
              "torch": torch.__version__,
              **run(args.repeats, device, args.width, args.layers, not args.no_compile,
                    not args.no_svd)}
    print(tables(report))
    emit_json(report, args.json)
    return report


if __name__ == "__main__":
    main()
