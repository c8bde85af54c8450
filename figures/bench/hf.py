"""MKOR and K-FAC training steps on transformers models, relative to their backbone alone.

A GPT-2-like ``GPT2LMHeadModel`` (AdamW backbone) and a ResNet-like
``ResNetForImageClassification`` (SGD with momentum), both built from configs with random
weights, each at a small and a large batch. Every contender runs ``inv_freq`` = 10
consecutive training steps per round (forward, backward, step, zero_grad), so a round holds
exactly one factor update; rounds are interleaved and the median is reported per step.

Where preconditioning dominates: per step and layer, MKOR adds two GEMMs, L^-1 G R^-1, of
about 2 d_out d_in (d_out + d_in) flops, independent of the batch; forward and backward
cost about 6 N d_out d_in for N rows (tokens, or output positions of a convolution).
The added fraction is therefore about (d_out + d_in) / (3 N): it dominates when a batch has
fewer rows than about the layer width, and fades as N grows. K-FAC adds the same GEMMs
(in its eigenbasis, four per layer) plus its O(d^3) decompositions, amortised over
``inv_freq`` steps, and its O(N d^2) factor products on capturing steps.
"""
import torch

__all__ = ["gpt2_like", "resnet_like", "bench_models"]


def gpt2_like(width=256, layers=2, heads=4, vocab=2048, context=64):
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_embd=width, n_layer=layers, n_head=heads, vocab_size=vocab,
                        n_positions=context, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def resnet_like(widths=(32, 64, 128, 256), depths=(1, 1, 1, 1), classes=10):
    from transformers import ResNetConfig, ResNetForImageClassification
    config = ResNetConfig(embedding_size=widths[0], hidden_sizes=list(widths),
                          depths=list(depths), num_labels=classes)
    return ResNetForImageClassification(config)


def _gpt_batch(model, batch, context, device, g):
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=g)
    return {"input_ids": ids.to(device), "labels": ids.to(device)}


def _resnet_batch(model, batch, size, device, g):
    x = torch.randn(batch, 3, size, size, generator=g)
    y = torch.randint(0, model.config.num_labels, (batch,), generator=g)
    return {"pixel_values": x.to(device), "labels": y.to(device)}


def _trainer(make_model, make_backbone, wrap, inputs, device):
    torch.manual_seed(0)
    model = make_model().to(device).train()
    backbone = make_backbone(model.parameters())
    opt = wrap(model, backbone)

    def step():
        model(**inputs).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def bench_models(repeats, device, interleaved, gpt=None, resnet=None, gpt_batches=(2, 32),
                 resnet_batches=(4, 64), context=64, image=32):
    """{model: {batch: {contender: median seconds per step}}} and the rows per batch."""
    from torch_impl.baselines import KFAC
    from torch_impl.mkor import MKOR
    g = torch.Generator().manual_seed(0)
    gpt = gpt or (lambda: gpt2_like(context=context))
    resnet = resnet or resnet_like
    cases = {
        "GPT-2-like": (gpt, lambda ps: torch.optim.AdamW(ps, lr=1e-4), gpt_batches,
                       lambda m, b: _gpt_batch(m, b, context, device, g)),
        "ResNet-like": (resnet, lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
                        resnet_batches, lambda m, b: _resnet_batch(m, b, image, device, g)),
    }
    wraps = {"backbone": lambda m, o: o,
             "MKOR": lambda m, o: MKOR(m, o, inv_freq=10),
             "KFAC": lambda m, o: KFAC(m, o, inv_freq=10, factor_freq=10)}
    out = {}
    for name, (make_model, backbone, batches, make_inputs) in cases.items():
        out[name] = {}
        probe = make_model()
        for batch in batches:
            inputs = make_inputs(probe, batch)
            contenders = {c: _trainer(make_model, backbone, w, inputs, device)
                          for c, w in wraps.items()}
            tenfold = {c: (lambda fn=fn: [fn() for _ in range(10)])
                       for c, fn in contenders.items()}
            times = interleaved(tenfold, repeats, device, warmup=1)
            out[name][batch] = {c: t / 10 for c, t in times.items()}
    return out


def table(results):
    lines = ["| model | batch | backbone (ms) | MKOR / backbone | K-FAC / backbone |",
             "|---|---|---|---|---|"]
    for name, by_batch in results.items():
        for batch, t in by_batch.items():
            lines.append(f"| {name} | {batch} | {t['backbone'] * 1e3:.1f} | "
                         f"{t['MKOR'] / t['backbone']:.2f} | {t['KFAC'] / t['backbone']:.2f} |")
    return "\n".join(lines)
