"""python -m figures.bench.self_check_cost: what checking every capture step costs per step.

Times MKOR training steps at its defaults (``inv_freq=10``: one capture step in ten) on three
tiny transformers language models (BERT masked-LM with a padded ``attention_mask``, Llama,
Mixtral with fused experts; hidden 128, 2 layers, batch 8 x 64 tokens), with the default
``self_check`` and with ``self_check=None``, against SGD on the same model: median of
interleaved rounds of 20 steps (two capture steps each) in one process. The script runs
unchanged on the code before issue 45, whose default checked the first capture step and every
10th after it, so the two default columns compare the two rules on one machine.
Measurements belong in ``figures/bench/README.md``.
"""
import argparse
import statistics
import time

import torch
import transformers as tf

from torch_impl import MKOR

_COMMON = dict(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=256)


def _model(kind):
    torch.manual_seed(0)
    if kind == "bert":
        return tf.BertForMaskedLM(tf.BertConfig(**_COMMON, hidden_dropout_prob=0.0,
                                                attention_probs_dropout_prob=0.0))
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**_COMMON, num_key_value_heads=4))
    return tf.MixtralForCausalLM(tf.MixtralConfig(**_COMMON, num_key_value_heads=4,
                                                  num_local_experts=4,
                                                  num_experts_per_tok=2))


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 1000, (8, 64), generator=g)
    mask = torch.ones(8, 64, dtype=torch.long)
    for i, n in enumerate([64, 40, 20, 64, 33, 50, 10, 64]):
        mask[i, n:] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=torch.where(mask.bool(), ids, -100))


def _stepper(kind, contender):
    model = _model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step_opt = opt
    if contender != "SGD":
        kwargs = {} if contender == "MKOR default" else {"self_check": None}
        step_opt = MKOR(model, opt, **kwargs)
    batch = _batch()

    def step():
        model(**batch).loss.backward()
        step_opt.step()
        step_opt.zero_grad()
    return step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    contenders = {(kind, c): _stepper(kind, c) for kind in ("bert", "llama", "mixtral")
                  for c in ("SGD", "MKOR self_check=None", "MKOR default")}
    times = {k: [] for k in contenders}
    for step in contenders.values():
        step()  # warm-up (and the first capture step)
    for _ in range(args.repeats):
        for key, step in contenders.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[key].append((time.perf_counter() - t0) / args.steps)
    print(f"torch {torch.__version__}, transformers {tf.__version__}, 2 threads, median of "
          f"{args.repeats} rounds of {args.steps} steps (inv_freq=10)")
    print("| model | contender | ms per step | / SGD | / self_check=None |")
    print("|---|---|---|---|---|")
    for (kind, c), ts in times.items():
        med = statistics.median(ts)
        sgd = statistics.median(times[(kind, "SGD")])
        off = statistics.median(times[(kind, "MKOR self_check=None")])
        print(f"| {kind} | {c} | {med * 1e3:.1f} | {med / sgd:.3f} | "
              f"{med / off:.3f} |" if c != "SGD" else f"| {kind} | SGD | {med * 1e3:.1f} | 1 | |")
    return times


if __name__ == "__main__":
    main()
