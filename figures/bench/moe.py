"""Fused experts (issue 31): what MKOR and K-FAC cost on a Mixtral, and what batching buys.

    python -m figures.bench.moe [--repeats 7] [--experts 8] [--width 64] [--device cpu]

Two measurements, each printed as a Markdown table and a JSON line (absolute times compare
only within one run; the ratios are the result):

* **step**: one training step (forward, backward, step, zero_grad) of a small
  ``MixtralForCausalLM`` (eager experts, AdamW backbone) with MKOR and K-FAC, each over
  ``inv_freq`` = 10 steps so a round holds one factor update (and one capture, whose
  recompute of the routed rows is part of it), divided by the backbone's step;
* **factor update**: the experts' factor update batched (one ``update_layer_factors`` on the
  (E, d, d) stack: one product per shape) divided by a Python loop of E updates of
  (d, d) factors, for both projections' shapes.

Contenders are interleaved and the median kept, because these machines are noisy.
"""
import argparse
import json

import torch

from figures.bench.timing import interleaved

__all__ = ["mixtral", "bench_steps", "bench_factor_update", "main"]


def mixtral(width=64, experts=8, layers=2, vocab=512, context=64):
    from transformers import MixtralConfig, MixtralForCausalLM
    config = MixtralConfig(hidden_size=width, intermediate_size=2 * width,
                           num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=4, num_local_experts=experts,
                           num_experts_per_tok=2, vocab_size=vocab,
                           max_position_embeddings=context)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    return MixtralForCausalLM(config)


def bench_steps(repeats, device, make_model=mixtral, batch=4, context=32, inv_freq=10):
    """{contender: median seconds per step} and {contender: ratio to the backbone}."""
    from torch_impl import KFAC, MKOR
    g = torch.Generator().manual_seed(0)
    wraps = {"backbone": lambda m, o: o,
             "MKOR": lambda m, o: MKOR(m, o, inv_freq=inv_freq),
             "KFAC": lambda m, o: KFAC(m, o, inv_freq=inv_freq, factor_freq=inv_freq)}
    rounds = {}
    for name, wrap in wraps.items():
        model = make_model().to(device).train()
        opt = wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=g)
        ids = ids.to(device)

        def round_(model=model, opt=opt, ids=ids):
            for _ in range(inv_freq):
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        rounds[name] = round_
    times = {k: v / inv_freq for k, v in interleaved(rounds, repeats, device, 1).items()}
    return times, {k: times[k] / times["backbone"] for k in times}


def bench_factor_update(repeats, device, experts=8, shapes=((128, 64), (64, 64))):
    """{(d_out, d_in): {"batched": s, "loop": s, "ratio": batched / loop}}."""
    import types

    from torch_impl import MKOR
    from torch_impl.mkor.layer_state import initial_layer_state, update_layer_factors
    net = torch.nn.Linear(2, 2)
    with MKOR(net, torch.optim.SGD(net.parameters(), lr=0.1)) as mkor:
        rule = mkor.options.factor_rule  # what a factor update reads (K8-K12)
    g = torch.Generator().manual_seed(1)
    out = {}
    for d_out, d_in in shapes:
        def layer(stack):
            weight = torch.zeros(1, device=device)
            return types.SimpleNamespace(experts=stack, d_out=d_out, d_in=d_in,
                                         identity_L=False, identity_R=False,
                                         module=types.SimpleNamespace(weight=weight))
        stacked = initial_layer_state(layer(experts), rule.factor_dtype, device)
        singles = [initial_layer_state(layer(None), rule.factor_dtype, device)
                   for _ in range(experts)]
        a = torch.randn(experts, d_in, generator=g).to(device) * 0.1
        gv = torch.randn(experts, d_out, generator=g).to(device) * 0.1
        present = torch.ones(experts, dtype=torch.bool, device=device)
        times = interleaved({
            "batched": lambda: update_layer_factors(stacked, a, gv, present, rule),
            "loop": lambda: [update_layer_factors(s, a[e], gv[e], present[e], rule)
                             for e, s in enumerate(singles)],
        }, repeats, device)
        out[(d_out, d_in)] = dict(times, ratio=times["batched"] / times["loop"])
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    times, ratios = bench_steps(args.repeats, device,
                                lambda: mixtral(width=args.width, experts=args.experts))
    print("| contender | s / step | ÷ backbone |\n|---|---|---|")
    for name in times:
        print(f"| {name} | {times[name]:.4f} | {ratios[name]:.2f} |")
    w = args.width
    updates = bench_factor_update(args.repeats, device, args.experts,
                                  shapes=((4 * w, w), (w, 2 * w)))
    print("\n| factor shape (d_out, d_in') | batched s | loop s | batched ÷ loop |\n|---|---|---|---|")
    for shape, row in updates.items():
        print(f"| {shape} | {row['batched']:.2e} | {row['loop']:.2e} | {row['ratio']:.2f} |")
    print(json.dumps({"step": times, "step_ratio": ratios,
                      "factor_update": {str(k): v for k, v in updates.items()}}))


if __name__ == "__main__":
    main()
