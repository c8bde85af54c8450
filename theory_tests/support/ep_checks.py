"""Checks shared by the expert-parallel tests (torchtitan's and transformers' EP): which
collectives a ``step()`` may issue when nothing of an expert stack travels.

``dense_gathers(pre)`` and ``dense_reductions(pre)`` are read from the preconditioner on each
rank after the run; ``only_dense(result)`` checks a rank's recorded collectives (``result``:
``{"collectives": [calls per step], "gathers": ..., "reductions": ...}``, the calls as
:class:`theory_tests.support.collectives.CountCollectives` records them).
"""

__all__ = ["dense_gathers", "dense_reductions", "only_dense"]


def dense_gathers(pre):
    """The elements of each FSDP2 gradient shard the dense preconditioned layers gather to
    precondition it whole (weight, then bias), sorted: what ``step()`` may all-gather."""
    from torch.distributed.tensor import DTensor
    out = []
    for layer in pre._layers:
        if layer.expert_shard is not None:
            continue
        for p in (layer.module.weight, getattr(layer.module, "bias", None)):
            if isinstance(p, DTensor) and p.requires_grad:
                out.append(p.to_local().numel())
    return sorted(out)


def dense_reductions(pre):
    """The sizes ``step()`` may all-reduce: the self-check's verdicts (3 per layer, 2 + E per
    stack of E experts), the dense layers' statistics packet(s) and K-FAC's KL clip."""
    sizes = {sum(3 if l.experts is None else 2 + (l.expert_shard or l).experts
                 for l in pre._layers)}
    if hasattr(pre, "_exchange"):  # MKOR
        sizes.add(pre._exchange.packet.numel)
    else:  # K-FAC's replicated route (owners: none here), and its KL clip's one scalar:
        # the sum of <V, G> over the experts, each held by one rank
        sizes.update(packet.numel for dst, _, packet, group in pre._routes
                     if group is pre.process_group)
        sizes.add(1)
    return sizes


def only_dense(rank_result):
    """Every collective of every ``step()`` is one the dense layers need: their statistics
    (all-reduced) and their FSDP2 gradient shards (all-gathered, once per layer and step);
    nothing of an expert stack (its gradient, factors or statistics) travels."""
    for calls in rank_result["collectives"]:
        gathers = sorted(k for n, k in calls if "all_gather" in n)
        others = [(n, k) for n, k in calls if "all_gather" not in n]
        assert gathers == rank_result["gathers"], (gathers, rank_result["gathers"])
        assert all(n == "c10d.allreduce_" and k in rank_result["reductions"]
                   for n, k in others), others
