"""python -m figures.bench.capture_cost: what following masks and the self-check cost.

Times a training step that captures statistics (``inv_freq=1``: every step) under MKOR and
K-FAC on two models, median of interleaved rounds in one process:

* a BERT masked-LM (hidden 128, 4 layers, batch 8 x 64 tokens, padded): with the
  ``attention_mask`` (the row tracker follows it through the model) and without;
* the MLP of ``figures.bench`` (4 x Linear(1024), batch 1024): no mask.

each with ``self_check=None`` and ``self_check=True`` (every capture step checked), so the
ratios give the tracker's and the self-check's cost per capture step. Measurements belong in
``figures/bench/README.md``; this machine's numbers are noisy.
"""
import argparse
import inspect
import statistics
import time

import torch
import transformers as tf

from torch_impl import KFAC, MKOR


def _bert(hidden=128):
    torch.manual_seed(0)
    return tf.BertForMaskedLM(tf.BertConfig(
        vocab_size=1000, hidden_size=hidden, num_hidden_layers=4 if hidden >= 128 else 1,
        num_attention_heads=4, intermediate_size=4 * hidden, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _mlp(width=1024):
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _batch(kind, width=1024):
    g = torch.Generator().manual_seed(0)
    if kind == "mlp":
        return dict(x=torch.randn(1024, width, generator=g))
    ids = torch.randint(5, 1000, (8, 64), generator=g)
    mask = torch.ones(8, 64, dtype=torch.long)
    for i, n in enumerate([64, 40, 20, 64, 33, 50, 10, 64]):
        mask[i, n:] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=torch.where(mask.bool(), ids, -100))


def _stepper(model_kind, cls, masked, self_check, width=1024):
    model = _bert(min(width, 128)) if model_kind == "bert" else _mlp(width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    kwargs = dict(inv_freq=1)
    if "self_check" in inspect.signature(cls.__init__).parameters:
        kwargs["self_check"] = self_check
    elif self_check is not None:
        return None  # a version without the self-check
    if cls is KFAC:  # factors every step, the O(d^3) decomposition once (step 0, warm-up)
        kwargs.update(factor_freq=1, inv_freq=10 ** 9)
    pre = cls(model, opt, **kwargs)
    batch = _batch(model_kind, width)
    if model_kind == "bert" and not masked:
        batch = {k: v for k, v in batch.items() if k != "attention_mask"}

    def step():
        if model_kind == "mlp":
            loss = model(batch["x"]).square().mean()
        else:
            loss = model(**batch).loss
        loss.backward()
        pre.step()
        pre.zero_grad()
    return step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--mlp-width", type=int, default=1024,
                        help="the MLP's width (below 128 also a 1-layer BERT of that width)")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    contenders = {}
    for model_kind, masked in (("bert", True), ("bert", False), ("mlp", False)):
        for cls in (MKOR, KFAC):
            for check in (None, True):
                step = _stepper(model_kind, cls, masked, check, args.mlp_width)
                if step is not None:
                    label = (f"{model_kind}{' masked' if masked else ''} {cls.__name__} "
                             f"self_check={check}")
                    contenders[label] = step
    times = {k: [] for k in contenders}
    for step in contenders.values():
        step()  # warm-up
    for _ in range(args.repeats):
        for label, step in contenders.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[label].append((time.perf_counter() - t0) / args.steps)
    print(f"torch {torch.__version__}, 2 threads, median of {args.repeats} rounds of "
          f"{args.steps} capture steps")
    print("| contender | ms per capture step | / self_check=None |")
    print("|---|---|---|")
    for label, ts in times.items():
        med = statistics.median(ts)
        base = label.replace("self_check=True", "self_check=None")
        ratio = med / statistics.median(times[base]) if base in times else float("nan")
        print(f"| {label} | {med * 1e3:.1f} | {ratio:.3f} |")
    return times


if __name__ == "__main__":
    main()
