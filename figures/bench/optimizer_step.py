"""Optimizer-step benchmarks against torch.optim, measured in the same run.

    python -m figures.bench [--only mars|mars_m|orthogonalisers|mkor|hf|memory|kfac_flavours|rank_k|factor_precision]
        [--repeats 9] [--device cpu] [--json PATH]
        [--layers 8 --vocab 8192 --ns-dtype bfloat16|float32 --no-compile]  (mars_m)

* ``mars``: one optimizer step (no forward/backward) on a GPT-like parameter list (~30M
  parameters in ~100 tensors: embeddings, attention and MLP matrices, biases, norms) for
  torch AdamW (loop, foreach, fused), MARS-AdamW (single-tensor, foreach, compiled), a Lion
  baseline vs MARS-Lion, and torch Muon vs MARS-Shampoo on the matrices.
* ``mars_m``: MARS-M (``MARSM``) against ``torch.optim.Muon(adjust_lr_fn="match_rms_adamw")``
  on the same list's matrices, eager against eager and compiled against compiled (torch's
  recipe, ``torch.compile`` around ``Muon.step``, against ``MARSM(compiled=True)``).
* ``orthogonalisers``: MARS-M and MARS-Shampoo under each ``ns_coefficients`` x
  ``orthogonalizer`` option against ``torch.optim.Muon``, and the Newton-Schulz alone, on 24
  GPT-like block matrices (:mod:`figures.bench.orthogonalisers`, whose own command takes
  ``--width`` and ``--layers``).
* ``mkor``: a training step (forward + backward + step) of an MLP of 4 x Linear(1024) at batch
  1024 with SGD(momentum) alone, under MKOR (inv_freq=10) and under K-FAC.
* ``hf``: training steps of a GPT-2-like and a ResNet-like transformers model at two batch
  sizes, backbone alone against MKOR and K-FAC (:mod:`figures.bench.hf`).
* ``memory``: optimizer-state bytes and peak step temporaries per parameter, vs AdamW.
* ``kfac_flavours``: K-FAC's "mc" / "type-2" training step over the empirical one on a tiny
  Llama (:mod:`figures.bench.kfac_flavours`).
* ``rank_k``: MKOR's rank-k factor update (Woodbury, KC8) over the rank-1 one at d = 1024,
  k = 1 ... 16 (:mod:`figures.bench.rank_k`).
* ``factor_precision``: MKOR's inverse factors in float32, bf16 round-to-nearest and bf16
  stochastic rounding against the float64 oracle, d = 64, 300 factor updates (LP5; not a
  timing: errors, stabiliser firings and the bound; :mod:`figures.bench.factor_precision`).

Runs are interleaved (every repeat times every contender once, in turn) and the median is
reported with its ratio to the reference contender of the same table: absolute times are not
comparable across runs on these noisy machines, the ratios are the result.  Prints Markdown
tables and one JSON document.
"""
import argparse
import time

import torch

from torch_impl import KFAC, MARS, MARSM, MKOR
from figures.bench.step_memory import StepMemory
from figures.bench.timing import compile_step, compiled_muon, emit_json, gpt_like_params, interleaved


class Lion(torch.optim.Optimizer):
    """A foreach Lion baseline (Chen et al. 2023): u = sign(b1 m + (1-b1) g),
    p <- p (1 - lr wd) - lr u, m <- b2 m + (1-b2) g.  torch has no Lion."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            gs = [p.grad for p in ps]
            ms = [self.state[p].setdefault("m", torch.zeros_like(p)) for p in ps]
            b1, b2 = group["betas"]
            u = torch._foreach_lerp(ms, gs, 1 - b1)
            torch._foreach_sign_(u)
            torch._foreach_mul_(ps, 1 - group["lr"] * group["weight_decay"])
            torch._foreach_add_(ps, u, alpha=-group["lr"])
            torch._foreach_lerp_(ms, gs, 1 - b2)


def _stepper(make, device):
    params = gpt_like_params(device)
    opt = make(params)
    return opt.step


def _compiled_adamw(params, **kw):
    """AdamW with the learning rate as a tensor (which needs capturable=True), so that a
    schedule does not recompile."""
    return compile_step(torch.optim.AdamW(params, lr=torch.tensor(1e-3), foreach=True,
                                           capturable=True, **kw))


def bench_mars(repeats, device):
    wd = 0.1
    steps = {
        "AdamW loop": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=wd, foreach=False),
        "AdamW foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=wd, foreach=True),
        "AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=wd, fused=True),
        "AdamW compiled": lambda ps: _compiled_adamw(ps, weight_decay=wd),
        "MARS-AdamW loop": lambda ps: MARS(ps, weight_decay=wd, foreach=False),
        "MARS-AdamW foreach": lambda ps: MARS(ps, weight_decay=wd, foreach=True),
        "MARS-AdamW compiled": lambda ps: MARS(ps, weight_decay=wd, compiled=True),
        "MARS-AdamW compiled group": lambda ps: MARS(ps, weight_decay=wd, compiled="group"),
        "Lion foreach": lambda ps: Lion(ps, weight_decay=wd),
        "MARS-Lion foreach": lambda ps: MARS(ps, mars_type="mars-lion", weight_decay=wd, foreach=True),
        "MARS-Lion compiled": lambda ps: MARS(ps, mars_type="mars-lion", weight_decay=wd, compiled=True),
    }
    contenders = {name: _stepper(make, device) for name, make in steps.items()}
    compile_seconds = {}
    for name, fn in contenders.items():  # first call: state creation (and compilation)
        start = time.perf_counter()
        fn()
        compile_seconds[name] = time.perf_counter() - start
    times = interleaved(contenders, repeats, device)
    matrices = lambda ps: [p for p in ps if p.ndim == 2]  # noqa: E731
    muon = {
        "Muon (torch)": lambda ps: torch.optim.Muon(matrices(ps), lr=0.02, weight_decay=wd),
        "MARS-Shampoo": lambda ps: MARS(matrices(ps), mars_type="mars-shampoo", weight_decay=wd),
    }
    times.update(interleaved({n: _stepper(m, device) for n, m in muon.items()},
                             max(3, repeats // 3), device, warmup=1))
    return times, {k: v for k, v in compile_seconds.items() if "compiled" in k}


def bench_mars_m(repeats, device, ns_dtype=torch.bfloat16, compiled=True, **shape):
    """MARS-M against torch's Muon on the GPT-like list's matrices (lr 0.02 with the
    match_rms_adamw scale, wd 0.1, momentum 0.95), both with their Newton-Schulz in
    ``ns_dtype``: bf16 is torch's and the authors'; float32 runs torch's Muon as the figures
    do (``figures.registry.Float32Muon``: torch's step with torch_impl's float32 iteration),
    for CPUs without bf16 matrix units, where a bf16 matmul is emulated, many times slower,
    and the comparison would time the emulation (measured: figures/bench/README.md)."""
    from ..registry import Float32Muon

    wd = 0.1
    muon_class = {torch.bfloat16: torch.optim.Muon, torch.float32: Float32Muon}[ns_dtype]
    matrices = lambda ps: [p for p in ps if p.ndim == 2]  # noqa: E731
    muon = dict(lr=0.02, weight_decay=wd, momentum=0.95, adjust_lr_fn="match_rms_adamw",
                nesterov=False)
    mars_m = dict(lr=0.02, weight_decay=wd, ns_dtype=ns_dtype)
    steps = {
        "Muon (torch) eager": lambda ps: muon_class(matrices(ps), **muon),
        "MARS-M loop": lambda ps: MARSM(matrices(ps), foreach=False, **mars_m),
        "MARS-M foreach": lambda ps: MARSM(matrices(ps), foreach=True, **mars_m),
    }
    if compiled:
        steps.update({
            "Muon (torch) compiled": lambda ps: compiled_muon(matrices(ps), muon_class, **muon),
            "MARS-M compiled": lambda ps: MARSM(matrices(ps), compiled=True, **mars_m),
        })
    contenders = {}
    compile_seconds = {}
    for name, make in steps.items():
        params = gpt_like_params(device, **shape)
        fn = make(params).step
        start = time.perf_counter()
        fn()  # state creation (and compilation)
        compile_seconds[name] = time.perf_counter() - start
        contenders[name] = fn
    times = interleaved(contenders, repeats, device, warmup=1)
    ratios = {"eager: best MARS-M eager / Muon eager":
              min(times["MARS-M loop"], times["MARS-M foreach"]) / times["Muon (torch) eager"]}
    if compiled:
        ratios["compiled: MARS-M compiled / Muon compiled"] = \
            times["MARS-M compiled"] / times["Muon (torch) compiled"]
    return times, ratios, {k: v for k, v in compile_seconds.items() if "compiled" in k}


def mlp(width=1024, depth=4):
    layers = []
    for i in range(depth):
        layers += [torch.nn.Linear(width, width)] + ([torch.nn.ReLU()] if i < depth - 1 else [])
    return torch.nn.Sequential(*layers)


def bench_mkor(repeats, device, width=1024, batch=1024):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, width, generator=g).to(device)
    y = torch.randn(batch, width, generator=g).to(device)

    def trainer(wrap):
        torch.manual_seed(0)
        model = mlp(width).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        stepper = wrap(model, opt)

        def step():
            torch.nn.functional.mse_loss(model(x), y).backward()
            stepper.step()
            opt.zero_grad(set_to_none=True)
        return step

    class GemmFloor:
        """SGD plus exactly the two preconditioning GEMMs per layer (fixed square matrices,
        results discarded): the measured floor of any Kronecker-factored method here."""

        def __init__(self, model, opt):
            self.opt, self.weights = opt, [m.weight for m in model if hasattr(m, "weight")]
            self.mats = [torch.eye(width, device=device) for _ in range(2)]

        def step(self):
            for w in self.weights:
                self.mats[0] @ w.grad @ self.mats[1]
            self.opt.step()

    # inv_freq = 10: time 10 consecutive steps per round, so each round holds one factor update
    contenders = {
        "SGD": trainer(lambda m, o: o),
        "SGD + 2 GEMMs per layer (floor)": trainer(GemmFloor),
        "MKOR": trainer(lambda m, o: MKOR(m, o, inv_freq=10)),
        "MKOR bf16 GEMMs": trainer(lambda m, o: MKOR(m, o, inv_freq=10,
                                                      precondition_dtype=torch.bfloat16)),
        "KFAC": trainer(lambda m, o: KFAC(m, o, inv_freq=10, factor_freq=10)),
    }
    tenfold = {n: (lambda fn=fn: [fn() for _ in range(10)]) for n, fn in contenders.items()}
    return {n: t / 10 for n, t in interleaved(tenfold, repeats, device, warmup=1).items()}


def bench_memory(device):
    """State bytes per parameter and peak live temporaries during one step, per optimizer."""
    out = {}
    makers = {
        "AdamW foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
        "AdamW loop": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False),
        "MARS-AdamW loop": lambda ps: MARS(ps, foreach=False),
        "MARS-AdamW foreach": lambda ps: MARS(ps, foreach=True),
        "MARS-Lion foreach": lambda ps: MARS(ps, mars_type="mars-lion", foreach=True),
    }
    for name, make in makers.items():
        params = gpt_like_params(device, layers=2, vocab=1024)
        opt = make(params)
        opt.step()  # state exists before the measured step
        with StepMemory() as mem:
            opt.step()
        n = sum(p.numel() for p in params)
        state = sum(t.numel() * t.element_size() for st in opt.state.values()
                    for t in st.values() if torch.is_tensor(t) and t.numel() > 1)
        largest = max(p.numel() * p.element_size() for p in params)
        out[name] = {"state_bytes_per_param": state / n,
                     "peak_temporary_bytes_per_param": mem.peak_bytes / n,
                     "peak_temporary_over_largest_param": mem.peak_bytes / largest}
    return out


def _table(title, times, reference):
    lines = [f"\n{title}", "| contender | median (ms) | / " + reference + " |", "|---|---|---|"]
    for name, t in times.items():
        lines.append(f"| {name} | {t * 1e3:.2f} | {t / times[reference]:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m figures.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["mars", "mars_m", "orthogonalisers", "mkor", "hf",
                                           "memory", "kfac_flavours", "rank_k",
                                           "factor_precision"])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=8,
                        help="mars_m only: blocks in the GPT-like list (8: 30.5M parameters)")
    parser.add_argument("--vocab", type=int, default=8192, help="mars_m only: embedding rows")
    parser.add_argument("--ns-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="mars_m only: Newton-Schulz dtype of both sides (float32 on a "
                             "CPU without bf16 matrix units)")
    parser.add_argument("--no-compile", action="store_true",
                        help="mars_m and orthogonalisers: eager paths only")
    parser.add_argument("--json", help="also write the JSON document here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    report = {"device": str(device), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "repeats": args.repeats}
    print(f"device {device}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"median of {args.repeats} interleaved rounds")
    if args.only in (None, "mars"):
        times, compile_s = bench_mars(args.repeats, device)
        report["mars_step_seconds"], report["compile_seconds"] = times, compile_s
        eager = min(("AdamW loop", "AdamW foreach"), key=times.get)
        ours = min(("MARS-AdamW loop", "MARS-AdamW foreach"), key=times.get)
        fused = min(("AdamW fused", "AdamW compiled"), key=times.get)
        default = "AdamW foreach" if device.type == "cuda" else "AdamW loop"
        best = min(("MARS-AdamW compiled", "MARS-AdamW compiled group"), key=times.get)
        ratios = {"eager: best MARS-AdamW eager / best AdamW eager": times[ours] / times[eager],
                  f"compiled: {best} / best AdamW fused-or-compiled": times[best] / times[fused],
                  "compiled per tensor: MARS-AdamW compiled / best AdamW fused-or-compiled":
                      times["MARS-AdamW compiled"] / times[fused],
                  "user-facing: MARS-AdamW compiled / torch default AdamW":
                      times["MARS-AdamW compiled"] / times[default]}
        report["ratios"] = ratios
        print(_table("Optimizer step, GPT-like 30.5M parameters in 99 tensors", times,
                     "AdamW loop"))
        for name, r in ratios.items():
            print(f"{name}: {r:.2f}")
        print("one-time compilation (first step): "
              + ", ".join(f"{k} {v:.1f} s" for k, v in compile_s.items()))
    if args.only in (None, "mars_m"):
        ns_dtype = getattr(torch, args.ns_dtype)
        times, ratios, compile_s = bench_mars_m(args.repeats, device, ns_dtype,
                                                not args.no_compile, layers=args.layers,
                                                vocab=args.vocab)
        report["mars_m_list"] = dict(layers=args.layers, vocab=args.vocab,
                                     ns_dtype=args.ns_dtype)
        report["mars_m_step_seconds"], report["mars_m_ratios"] = times, ratios
        report["mars_m_compile_seconds"] = compile_s
        print(_table(f"MARS-M vs Muon, the 2-D matrices of the GPT-like list ({args.layers} "
                     f"blocks, vocab {args.vocab}), {args.ns_dtype} Newton-Schulz", times,
                     "Muon (torch) eager"))
        for name, r in ratios.items():
            print(f"{name}: {r:.2f}")
    if args.only in (None, "orthogonalisers"):
        from figures.bench import orthogonalisers as bench_orthogonalisers
        report["orthogonalisers"] = bench_orthogonalisers.run(args.repeats, device,
                                                              compiled=not args.no_compile)
        print(bench_orthogonalisers.tables(report["orthogonalisers"]))
    if args.only in (None, "mkor"):
        times = bench_mkor(args.repeats, device)
        report["mkor_train_step_seconds"] = times
        print(_table("Training step, MLP 4 x Linear(1024), batch 1024, inv_freq 10", times, "SGD"))
        # GEMM floor: forward L, backward L (weights) + L - 1 (inputs; the data needs no
        # gradient); MKOR adds 2 per layer (L^-1 G R^-1) on every step
        layers = 4
        floor = (3 * layers - 1 + 2 * layers) / (3 * layers - 1)
        report["mkor_gemm_floor"] = floor
        measured = times["SGD + 2 GEMMs per layer (floor)"] / times["SGD"]
        report["mkor_measured_floor"] = measured
        report["mkor_over_floor"] = times["MKOR"] / times["SGD + 2 GEMMs per layer (floor)"]
        print(f"MKOR / SGD = {times['MKOR'] / times['SGD']:.2f}; the GEMM-count floor of this "
              f"model is {floor:.3f} ({5 * layers - 1} equal GEMMs against {3 * layers - 1}), "
              f"measured {measured:.3f}; MKOR / measured floor = "
              f"{report['mkor_over_floor']:.3f}")
    if args.only in (None, "hf"):
        from figures.bench import hf as bench_hf
        results = bench_hf.bench_models(args.repeats, device, interleaved)
        report["hf_train_step_seconds"] = {m: {str(b): t for b, t in r.items()}
                                           for m, r in results.items()}
        print("\nTraining step on transformers models (inv_freq 10), per step:\n"
              + bench_hf.table(results))
    if args.only in (None, "memory"):
        report["memory"] = bench_memory(device)
        print("\n| optimizer | state bytes / param | peak step temporaries / param "
              "| peak temporaries / largest param |\n|---|---|---|---|")
        for name, m in report["memory"].items():
            print(f"| {name} | {m['state_bytes_per_param']:.1f} | "
                  f"{m['peak_temporary_bytes_per_param']:.2f} | "
                  f"{m['peak_temporary_over_largest_param']:.2f} |")
    if args.only in (None, "kfac_flavours"):  # issue 46: MC / type-2 step / empirical
        from figures.bench import kfac_flavours as bench_kfac_flavours
        print("\nK-FAC flavours, training step on a tiny Llama (factor_freq 1):")
        report["kfac_flavours_over_empirical"] = bench_kfac_flavours.main(
            ["--repeats", str(min(args.repeats, 5))])
    if args.only in (None, "rank_k"):  # issue 46: rank-k factor update / rank-1, d = 1024
        from figures.bench import rank_k as bench_rank_k
        print("\nMKOR rank-k factor update over rank 1 (d = 1024):")
        report["rank_k_over_rank_1"] = bench_rank_k.main(
            ["--device", args.device, "--repeats", str(args.repeats)])
    if args.only in (None, "factor_precision"):  # issue 47: MKOR's factors in bf16 (LP5)
        from figures.bench import factor_precision as bench_factor_precision
        print("\nMKOR inverse factors in float32 / bf16 nearest / bf16 stochastic against "
              "the float64 oracle:")
        report["factor_precision"] = bench_factor_precision.main(
            ["--dims", "64", "--steps", "300"])
    emit_json(report, args.json)


if __name__ == "__main__":
    main()
