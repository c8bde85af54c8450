"""MARS-M, MARS-Shampoo, MARS-AdamW and LAMB under torchtitan's expert parallelism (issue 48,
item 2), on forked gloo ranks through torchtitan's own EP path
(``theory_tests/support/torchtitan_ep.py``: qwen3 and deepseek_v3 MoE models sharded by
``parallelize_qwen3`` / ``parallelize_deepseekv3``, experts ``(_StridedShard(0), Shard(0))``
on the ``(efsdp, ep)`` mesh, tokens exchanged by the ``AllToAllTokenDispatcher``, dense
parameters FSDP-sharded on ``fsdp``), float64, 3 steps, our container.

* **Equal to one process.**  Each case's parameters after 3 steps equal the one-process run
  (ep = 1, world 1, the whole batch) within ``TOLERANCE`` = 1e-13 of the largest absolute
  difference; measured at most 1.1e-15 on 2 ranks (EP = 2) and 3.9e-15 on 4 (EP = 4;
  EP = 2 x efsdp = 2), per case in ``paper_notes/mars.md`` section 10.  The experts move by
  1e-3 to 6e-2 in those steps, so the comparison compares something.  The cases: MARS-M and
  MARS-Shampoo with the expert stacks in a ``matrix_batch_dims=1`` group (each expert
  clipped and orthogonalised as its own matrix) and the dense rest in a second group;
  MARS-AdamW, MARS-M and LAMB with one ``.*`` group whose foreach calls span both meshes
  (``tensor_ops.foreach_groups``: before issue 48 these raised "Cannot run aten.mul.Tensor
  on inputs with different meshes").
* **No collective for the experts.**  With the expert stacks in MARS-M's (or MARS-Shampoo's)
  ``matrix_batch_dims=1`` group and every other parameter given to torchtitan's AdamW, a
  step issues no torch.distributed collective at all on any rank
  (``theory_tests/support/collectives.py`` counts every c10d and functional collective), and
  each rank orthogonalised its own shard of each stack, once a step (the library's
  observers): the experts' ``_StridedShard(0)`` / ``Shard(0)`` shards hold whole matrices
  (``sharding.holds_whole_matrices``).  With the dense matrices in a MARS-M or MARS-Shampoo
  group too, a step issues exactly their cost: one all-reduce per dense matrix (its clip
  norm, M3 / M15) and two all-to-alls (the owner exchange of their Newton-Schulz).
* **The default suite** runs qwen3 on 2 ranks (EP = 2) with MARS-M, MARS-Shampoo, MARS-AdamW
  and the expert-only groups (~10 s); deepseek_v3, MARS-M's and LAMB's one-group cases and
  every 4-rank run are ``-m slow``.  (``theory_tests/distributed/test_foreach_meshes.py``
  checks the foreach grouping itself in the default suite, in ~3 s.)
* **4 ranks** (``-m slow``): EP = 4, and EP = 2 x efsdp = 2 with the expert products in
  float64 (``theory_tests/support/float64_experts.py`` says why torchtitan's bf16 products
  cannot be compared there beyond bf16 rounding); 4 experts, so that efsdp x ep <= E and
  torchtitan keeps the experts' FSDP shard on dim 0.
"""
import functools

import pytest
import torch

from theory_tests.support.distributed_harness import run

F64 = torch.float64
STEPS, GLOBAL_BATCH, TOLERANCE = 3, 4, 1e-13
KINDS = ("qwen3", "deepseek_v3")
EXPERTS = r".*inner_experts.*"
MARSM_KW = {"lr": 2e-2, "weight_decay": 0.1, "momentum": 0.9, "gamma": 0.02, "ns_dtype": F64}
MARS_KW = {"lr": 3e-3, "betas": (0.9, 0.99), "gamma": 0.02, "weight_decay": 0.1}
SHAMPOO_KW = {**MARS_KW, "mars_type": "mars-shampoo", "ns_dtype": F64}
ADAMW_KW = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
STACKS = {"matrix_batch_dims": 1}
# name -> [(pattern, optimizer name, kwargs)], first match wins (torchtitan's ParamGroupConfig)
CASES = {
    "MARSM": [(EXPERTS, "MARSM", {**MARSM_KW, **STACKS}), (".*", "MARSM", MARSM_KW)],
    "MARS-Shampoo": [(EXPERTS, "MARS", {**SHAMPOO_KW, **STACKS}), (".*", "MARS", SHAMPOO_KW)],
    "MARS-AdamW": [(".*", "MARS", MARS_KW)],
    "MARSM-one-group": [(".*", "MARSM", MARSM_KW)],
    "LAMB": [(".*", "LAMB", {"lr": 1e-2, "weight_decay": 0.01})],
}
# the expert stacks alone in an orthogonalising group: the step's collectives are theirs
EXPERTS_ONLY = {
    "MARSM-experts": [(EXPERTS, "MARSM", {**MARSM_KW, **STACKS}), (".*", "AdamW", ADAMW_KW)],
    "MARS-Shampoo-experts": [(EXPERTS, "MARS", {**SHAMPOO_KW, **STACKS}),
                             (".*", "AdamW", ADAMW_KW)],
}
ORTHOGONALISING = ("MARSM", "MARS-Shampoo")  # their dense group orthogonalises too
ALL = {**CASES, **EXPERTS_ONLY}
# the default suite's share (~10 s): qwen3 on 2 ranks, these cases (the dense-collective
# count reads their runs); the rest is -m slow, which CI runs too
DEFAULT_KIND = "qwen3"
DEFAULT = ("MARSM", "MARS-Shampoo", "MARS-AdamW", *EXPERTS_ONLY)


def _config(groups):
    from torchtitan.components.optimizer import ParamGroupConfig

    from torch_impl.integrations.torchtitan import Optimizers
    return Optimizers.Config(
        implementation="foreach",
        param_groups=[ParamGroupConfig(pattern=p, optimizer_name=n, optimizer_kwargs=dict(kw))
                      for p, n, kw in groups])


def _layout(model):
    """{name: (mesh dim names, placement class names, local shape)} of the DTensors."""
    from torch.distributed.tensor import DTensor
    return {n: (p.device_mesh.mesh_dim_names, tuple(type(pl).__name__ for pl in p.placements),
                tuple(p.to_local().shape))
            for n, p in model.named_parameters() if isinstance(p, DTensor)}


def _job(rank, world, kind, ep, names, float64_products):
    """The cases ``names`` on this rank: ``STEPS`` steps of its share of the global batch, each
    ``optimizers.step()`` inside the collective counter and the orthogonalisation recorder."""
    import warnings

    from figures.bench.recording import record_orthogonalisation
    from theory_tests.support import torchtitan_ep as titan
    from theory_tests.support.collectives import CountCollectives
    warnings.simplefilter("ignore")
    titan.configure()
    if float64_products:
        from theory_tests.support.float64_experts import use_float64_products
        use_float64_products()
    per, out = GLOBAL_BATCH // world, {}
    for name in names:
        groups = ALL[name]
        model = titan.ep_model(kind, ep)
        if world > 1:
            titan.parallelize(model, kind, titan.parallel_dims(world, ep))
        optimizers = _config(groups).build(model_parts=[model])
        counts, computed = [], []
        for t in range(STEPS):
            batch = titan.tokens(t, GLOBAL_BATCH)[rank * per:(rank + 1) * per]
            titan.lm_step(model, None, batch, world)
            with CountCollectives() as count, record_orthogonalisation() as record:
                optimizers.step()
            optimizers.zero_grad()
            counts.append(dict(count.ops))
            computed.append(sorted(record.computed))
        out[name] = dict(params=titan.full_parameters(model), counts=counts, computed=computed,
                         layout=_layout(model))
    if world == 1:
        out["init"] = titan.full_parameters(titan.ep_model(kind, 1))
    return out


def _import_torchtitan():
    """torchtitan's models, sharding and parallelize modules and our container imported here,
    before the fork, so that the ranks inherit them (~5 s of imports a job otherwise)."""
    import figures.bench.recording  # noqa: F401
    import torch_impl.integrations.torchtitan  # noqa: F401
    from torchtitan.models.deepseek_v3 import parallelize, sharding  # noqa: F401
    from torchtitan.models.qwen3 import parallelize, sharding  # noqa: F401,F811


@functools.lru_cache(maxsize=None)
def _ranks(kind, world, ep, names, float64_products=False):
    _import_torchtitan()
    return run(_job, world, kind, ep, names, float64_products, timeout=600.0,
               collective_timeout=60.0)


def _names(kind, world, name=None):
    """The cases a job runs: the default suite's on its share, every case elsewhere."""
    if world == 2 and kind == DEFAULT_KIND and (name is None or name in DEFAULT):
        return DEFAULT
    return tuple(ALL)


def _slow_unless_default(kind, name=None):
    default = kind == DEFAULT_KIND and (name is None or name in DEFAULT)
    return () if default else (pytest.mark.slow,)


def _worst(got, want):
    return max((got[k] - want[k]).abs().max().item() for k in want)


def _check_equal_to_one_process(kind, world, ep, name, float64_products=False):
    names = _names(kind, world, name)
    (one,) = _ranks(kind, 1, 1, names, float64_products)
    experts = [k for k in one["init"] if "inner_experts" in k]
    moved = max((one[name]["params"][k] - one["init"][k]).abs().max().item() for k in experts)
    assert moved > 1e-4, (name, moved)  # the experts took steps
    for rank, res in enumerate(_ranks(kind, world, ep, names, float64_products)):
        worst = _worst(res[name]["params"], one[name]["params"])
        assert worst <= TOLERANCE, (kind, world, ep, name, rank, worst)


def _check_placements(kind, world, ep):
    """torchtitan's EP layout, as the docstring says: experts on (efsdp, ep), dim-0 shards of
    whole experts (E / (efsdp ep) each), dense parameters on fsdp."""
    for res in _ranks(kind, world, ep, _names(kind, world), ep < world):
        for name, (dims, placements, local) in res["MARSM"]["layout"].items():
            if "inner_experts" in name:
                assert dims == ("efsdp", "ep") and placements == ("_StridedShard", "Shard")
                assert local[0] == 4 // world, (name, local)
            else:
                assert dims == ("fsdp",), (name, dims)


def _check_expert_collectives(kind, world, ep):
    """No collective in any step on any rank; each rank orthogonalised each of its local
    stacks once a step (the 3 stacks of each MoE layer)."""
    for res in _ranks(kind, world, ep, _names(kind, world), ep < world):
        for name in EXPERTS_ONLY:
            r = res[name]
            local = sorted(shape for n, (_, _, shape) in r["layout"].items()
                           if "inner_experts" in n)
            assert local and all(c == {} for c in r["counts"]), (name, r["counts"])
            assert r["computed"] == [local] * STEPS, (name, r["computed"])


def _check_dense_collectives(kind, world, ep):
    """The dense matrices' cost: one all-reduce per dense matrix (its clip norm), two
    all-to-alls (one owner exchange) a step; nothing else."""
    for res in _ranks(kind, world, ep, _names(kind, world), ep < world):
        dense = sum(1 for n, p in res["MARSM"]["params"].items()
                    if p.ndim == 2 and "inner_experts" not in n)
        for name in ORTHOGONALISING:
            want = {"_c10d_functional.all_reduce": dense, "c10d.alltoall_base_": 2}
            assert res[name]["counts"] == [want] * STEPS, (name, res[name]["counts"])


TWO_RANK_CASES = [pytest.param(kind, name, marks=_slow_unless_default(kind, name))
                  for kind in KINDS for name in CASES]
TWO_RANK_KINDS = [pytest.param(kind, marks=_slow_unless_default(kind)) for kind in KINDS]


@pytest.mark.parametrize("kind,name", TWO_RANK_CASES)
def test_two_ep_ranks_step_as_one_process(kind, name):
    _check_equal_to_one_process(kind, 2, 2, name)


@pytest.mark.parametrize("kind", TWO_RANK_KINDS)
def test_two_ep_ranks_hold_whole_experts_on_the_ep_mesh(kind):
    _check_placements(kind, 2, 2)


@pytest.mark.parametrize("kind", TWO_RANK_KINDS)
def test_expert_stacks_are_orthogonalised_where_they_live_with_no_collective(kind):
    _check_expert_collectives(kind, 2, 2)


@pytest.mark.parametrize("kind", TWO_RANK_KINDS)
def test_the_dense_matrices_cost_their_norms_and_one_owner_exchange(kind):
    _check_dense_collectives(kind, 2, 2)


FOUR = [(4, False), (2, True)]  # (ep, float64 products): EP = 4; EP = 2 x efsdp = 2


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("ep,float64_products", FOUR)
@pytest.mark.parametrize("kind", KINDS)
def test_four_ep_ranks_step_as_one_process(kind, ep, float64_products, name):
    _check_equal_to_one_process(kind, 4, ep, name, float64_products)


@pytest.mark.slow
@pytest.mark.parametrize("ep", [4, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_four_ranks_count_no_collective_for_the_experts(kind, ep):
    _check_placements(kind, 4, ep)
    _check_expert_collectives(kind, 4, ep)
    _check_dense_collectives(kind, 4, ep)


def _every_collective(rank, world):
    """Each entry point of the counter's docstring, counted on its own."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from theory_tests.support.collectives import CountCollectives
    mesh, x, peer = init_device_mesh("cpu", (world,)), torch.ones(4), 1 - rank
    sharded = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])

    def pair(first, second):
        return (first(), second()) if rank == 0 else (second(), first())
    calls = {
        "all_reduce": lambda: dist.all_reduce(x),
        "reduce": lambda: dist.reduce(x, 0),
        "all_gather": lambda: dist.all_gather([torch.empty(4) for _ in range(world)], x),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(8), x),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(4), x),
        "all_to_all": lambda: dist.all_to_all([torch.empty(2)] * 2, list(x.chunk(2))),
        "broadcast": lambda: dist.broadcast(x, 0),
        "gather": lambda: dist.gather(x, [torch.empty(4)] * 2 if rank == 0 else None),
        "scatter": lambda: dist.scatter(torch.empty(4), [x] * 2 if rank == 0 else None),
        "reduce_scatter": lambda: dist.reduce_scatter(torch.empty(2), list(x.chunk(2))),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(2), x),
        "send_recv": lambda: pair(lambda: dist.send(x, peer),
                                  lambda: dist.recv(torch.empty(4), peer)),
        "isend_irecv": lambda: [w.wait() for w in (dist.isend(x, peer),
                                                   dist.irecv(torch.empty(4), peer))],
        "all_gather_object": lambda: dist.all_gather_object([None] * world, rank),
        "broadcast_object_list": lambda: dist.broadcast_object_list([rank], 0),
        "functional_all_gather": lambda: funcol.all_gather_tensor(x, 0, mesh),
        "functional_all_reduce": lambda: funcol.all_reduce(x, "sum", mesh),
        "functional_all_to_all": lambda: funcol.all_to_all_single(x, None, None, mesh),
        "dtensor_full_tensor": lambda: sharded.full_tensor(),
        "dtensor_norm": lambda: torch.linalg.vector_norm(sharded).full_tensor(),
        "nothing": lambda: x * 2,
    }
    out = {}
    for name, call in calls.items():
        with CountCollectives() as count:
            call()
        out[name] = count.total
    return out


def test_the_counter_sees_every_kind_of_collective():
    for res in run(_every_collective, 2, timeout=60.0):
        assert res.pop("nothing") == 0
        assert all(n >= 1 for n in res.values()), res
