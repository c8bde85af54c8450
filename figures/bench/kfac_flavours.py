"""python -m figures.bench.kfac_flavours: what K-FAC's "mc" and "type-2" flavours cost per step.

Times a K-FAC training step (forward, ``curvature_backward``, backward, ``step``) on a tiny
transformers Llama built from its config (vocab 64, so type-2's 64 column backward passes stay
bounded; hidden 64, 2 layers, batch 4 x 32 tokens), ``factor_freq=1`` (every step a factor
update: the flavours' worst case) and ``inv_freq=10``, for fisher_type "empirical", "mc"
(M = 1 and 4) and "type-2", each divided by the empirical step measured in the same run (median
of interleaved rounds, one process). Measurements belong in ``figures/bench/README.md``.
"""
import argparse
import statistics
import time

import torch
import torch.nn as nn
import transformers as tf

from torch_impl import KFAC

CONTENDERS = {"empirical": dict(fisher_type="empirical"),
              "mc, M=1": dict(fisher_type="mc"),
              "mc, M=4": dict(fisher_type="mc", mc_samples=4),
              "type-2": dict(fisher_type="type-2")}


class _Logits(nn.Module):
    """The model's logits as the (tokens, vocab) tensor CrossEntropyLoss takes."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits.flatten(0, 1)


def _stepper(options, vocab, hidden, layers, batch, seq):
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=4,
                            intermediate_size=2 * hidden, max_position_embeddings=seq)
    model = _Logits(tf.LlamaForCausalLM(config))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    kwargs = dict(options)
    if kwargs.get("fisher_type") == "mc":
        kwargs["generator"] = torch.Generator().manual_seed(0)
    kfac = KFAC(model, opt, factor_freq=1, inv_freq=10, **kwargs)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    targets = torch.roll(ids, -1, dims=1).flatten()
    loss_func = nn.CrossEntropyLoss()

    def step():
        out = model(ids)
        kfac.curvature_backward(out, targets, loss_func)
        loss_func(out, targets).backward()
        kfac.step()
        kfac.zero_grad()
    return step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    steps = {name: _stepper(options, args.vocab, args.hidden, args.layers, args.batch,
                            args.seq) for name, options in CONTENDERS.items()}
    times = {name: [] for name in steps}
    for step in steps.values():
        step()  # warm-up: the first factor update and decomposition
    for _ in range(args.repeats):
        for name, step in steps.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[name].append((time.perf_counter() - t0) / args.steps)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    ratios = {name: medians[name] / medians["empirical"] for name in medians}
    print(f"torch {torch.__version__}, transformers {tf.__version__}, 2 threads, Llama vocab "
          f"{args.vocab} hidden {args.hidden} x {args.layers} layers, batch {args.batch} x "
          f"{args.seq}, factor_freq=1, median of {args.repeats} rounds of {args.steps} steps")
    print("| fisher_type | ms per step | / empirical |")
    print("|---|---|---|")
    for name in steps:
        print(f"| {name} | {medians[name] * 1e3:.1f} | {ratios[name]:.2f} |")
    return ratios


if __name__ == "__main__":
    main()
