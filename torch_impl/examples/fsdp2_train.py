"""A tiny Llama under FSDP2 (``fully_shard``) with MKOR, K-FAC, MARS or MARS-M, and a DCP
checkpoint, one process per rank:

    torchrun --nproc_per_node 2 -m torch_impl.examples.fsdp2_train --optimizer mkor --steps 20 --checkpoint /tmp/ckpt
    torchrun --nproc_per_node 2 -m torch_impl.examples.fsdp2_train --optimizer mkor --steps 20 --checkpoint /tmp/ckpt --resume

(gloo on CPU, NCCL when CUDA is present; run without torchrun it trains as one process and
says so; ``--optimizer`` is one of mkor, kfac, mars, mars_m, or adamw: MKOR's and K-FAC's
backbone alone, for comparison.)
The first command trains ``--steps`` steps and saves a distributed checkpoint
(``torch.distributed.checkpoint``) after half of them; the second loads it and runs the
second half again, ending where the first run ended. Each rank trains on its own slice of
a synthetic global batch of token sequences that count up by one (learnable next tokens).
Rank 0 prints the loss every few steps and a final line.

Needs transformers (the model is its ``LlamaForCausalLM``), which the library does not bring:
``pip install "transformers>=4.46"``, or the ``examples`` extra (``pip install -e ".[examples]"``
in the clone).
"""
import argparse
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from torch_impl import KFAC, MARS, MARSM, MKOR
from torch_impl.examples import launcher

OPTIMIZERS = ("mkor", "kfac", "mars", "mars_m", "adamw")  # adamw: the backbone alone
NEEDS = ('needs transformers, which the library does not bring: pip install "transformers>=4.46" '
         '(or the examples extra: pip install -e ".[examples]" in the clone)')


def llama():
    """transformers' ``(LlamaConfig, LlamaForCausalLM)``, imported when the example runs (so
    ``--help`` works without it), with the install command when it is missing."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as error:
        raise ImportError(f"torch_impl.examples.fsdp2_train {NEEDS} ({error})") from error
    return LlamaConfig, LlamaForCausalLM


def parse(argv=None):
    # the whole docstring: its last paragraph says what the example needs and how to get it
    p = argparse.ArgumentParser(prog="python -m torch_impl.examples.fsdp2_train",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="mkor",
                   help="The optimizer (default mkor; adamw: MKOR's and K-FAC's backbone "
                        "alone).")
    p.add_argument("--steps", type=int, default=20, help="Training steps (default 20).")
    p.add_argument("--batch", type=int, default=8,
                   help="The global batch, split over the ranks (default 8).")
    p.add_argument("--seq", type=int, default=16, help="Tokens per sequence (default 16).")
    p.add_argument("--lr", type=float, default=3e-3, help="Learning rate (default 3e-3).")
    p.add_argument("--inv-freq", type=int, default=5,
                   help="Steps between MKOR's or K-FAC's factor updates (default 5).")
    p.add_argument("--factor-placement", choices=("replicated", "owner"), default="replicated",
                   help="MKOR / K-FAC: every rank holds every factor, or one owner per layer "
                        "(default replicated).")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                   help="The model's dtype (default float32).")
    p.add_argument("--seed", type=int, default=0,
                   help="Seed of the initial weights (default 0).")
    p.add_argument("--checkpoint",
                   help="A DCP directory: the run saves there after half its steps.")
    p.add_argument("--resume", action="store_true",
                   help="Load --checkpoint and run its second half again.")
    p.add_argument("--log-every", type=int, default=5,
                   help="Steps between rank 0's loss lines (default 5).")
    return p.parse_args(argv)


def build_optimizer(name, model, lr, inv_freq, factor_placement="replicated"):
    if name in ("mkor", "kfac", "adamw"):  # a preconditioner wrapping the model and a backbone
        adamw = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        if name == "adamw":
            return adamw
        kind = MKOR if name == "mkor" else KFAC
        return kind(model, adamw, inv_freq=inv_freq, factor_placement=factor_placement)
    if name == "mars":
        return MARS(model.parameters(), lr=lr, weight_decay=0.01)
    # MARS-M: Muon's rule for the hidden matrices, AdamW for embeddings, head and norms
    hidden = [p for n, p in model.named_parameters()
              if p.ndim == 2 and "embed_tokens" not in n and "lm_head" not in n]
    rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
    return MARSM([dict(params=hidden, rule="mars_m"), dict(params=rest, rule="adamw")],
                 lr=lr, weight_decay=0.01)


def batch(step, args, config, rank, world):
    """This rank's slice of the global batch of ``step``: sequences s, s+1, ... (mod vocab)."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, config.vocab_size, (args.batch, 1), generator=g)
    tokens = (start + torch.arange(args.seq)) % config.vocab_size
    return tokens.chunk(world)[rank]


def main(argv=None):
    """Train; returns {"losses": {step: loss}, "params": {name: full tensor}} (for tests).
    Uses an existing process group if there is one."""
    args = parse(argv)
    if args.resume and not args.checkpoint:
        raise SystemExit("--resume needs --checkpoint")
    LlamaConfig, LlamaForCausalLM = llama()  # before any process group exists
    cuda = torch.cuda.is_available()
    owns_group = not dist.is_initialized()
    if owns_group:  # torchrun's group, or one process without a launcher
        launcher.start("fsdp2_train", "nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {world} ranks")
    mesh = init_device_mesh("cuda" if cuda else "cpu", (world,))

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=args.seq)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    if cuda:
        model = model.cuda()
    for layer in model.model.layers:  # each decoder layer its own FSDP unit, then the root
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = build_optimizer(args.optimizer, model, args.lr, args.inv_freq,
                                args.factor_placement)  # after fully_shard

    half, start, losses = args.steps // 2, 0, {}
    if args.resume:  # the protocol of torch's DCP tutorial
        with warnings.catch_warnings():  # DCP initialises the fresh optimizer's state by a
            # zero-gradient step at lr 0, which captures no layer statistics: K-FAC says so
            warnings.filterwarnings("ignore", "KFAC: no statistics were captured")
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0)}
            dcp.load(state, checkpoint_id=args.checkpoint)
            set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        start = int(state["step"])

    for step in range(start, args.steps):
        if args.checkpoint and not args.resume and step == half:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)},
                     checkpoint_id=args.checkpoint)
        tokens = batch(step, args, config, rank, world).to(model.device)
        loss = model(input_ids=tokens, labels=tokens).loss  # next-token cross-entropy
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().reshape(1)
        dist.all_reduce(mean)
        losses[step] = mean.item() / world
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[step]:.4f}", flush=True)

    params = {n: p.full_tensor().cpu() for n, p in model.named_parameters()}  # a collective
    if rank == 0:
        first = f"from {losses[start]:.4f} " if losses else ""
        ranks = f"{world} rank{'s' if world > 1 else ''}"
        print(f"{args.optimizer} on {ranks}, steps {start}..{args.steps - 1}: loss "
              f"{first}to {losses.get(args.steps - 1, float('nan')):.4f}", flush=True)
    if owns_group:
        dist.destroy_process_group()
    return {"losses": losses, "params": params}


if __name__ == "__main__":
    main()
