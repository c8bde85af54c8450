"""What every benchmark script shares: the interleaved timer, the GPT-like parameter list,
torch's recipe for a compiled step, and the JSON line a script ends with."""
import json
import statistics
import time

import torch

__all__ = ["gpt_like_params", "interleaved", "compile_step", "compiled_muon", "emit_json"]


def gpt_like_params(device, dtype=torch.float32, vocab=8192, d=512, layers=8, ctx=1024):
    """~30.5M parameters in 99 tensors, shaped like a small GPT."""
    g = torch.Generator().manual_seed(0)
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,),
                   (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    shapes += [(d,)]
    params = [torch.nn.Parameter(0.02 * torch.randn(s, generator=g, dtype=dtype).to(device))
              for s in shapes]
    for p in params:
        p.grad = 0.01 * torch.randn(p.shape, generator=g, dtype=dtype).to(device)
    return params


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(contenders, repeats, device, warmup=2):
    """{name: median seconds} of ``fn()`` over ``repeats`` interleaved rounds."""
    for fn in contenders.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, fn in contenders.items():
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def compile_step(opt):
    """torch's recipe for a compiled optimizer step: torch.compile around ``opt.step``."""
    eager_step = opt.step

    @torch.compile(fullgraph=False)
    def step():
        eager_step()
    opt.step = step
    return opt


def compiled_muon(params, muon_class=torch.optim.Muon, **kw):
    """Muon's step compiled (its lr is a float: a schedule would recompile, which a fixed-lr
    benchmark never triggers)."""
    return compile_step(muon_class(params, **kw))


def emit_json(report, path=None):
    """Print the report as one JSON line (the last line a script prints) and, with ``path``,
    write it there too."""
    text = json.dumps(report)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text)
