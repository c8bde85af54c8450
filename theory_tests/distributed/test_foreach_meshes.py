"""Foreach kernels over DTensors of two device meshes (issue 48, item 1), on 2 gloo ranks.

Under torchtitan's expert parallelism the dense parameters live on the ``fsdp`` mesh and the
experts on ``(efsdp, ep)``; one optimizer group may hold both.  DTensor runs a foreach op on
one mesh and makes a plain tensor operand (``tensor_ops.scalar_operand``'s 0-d scalar, LAMB's
stacked trust ratios) a replicated DTensor on the first tensor's mesh, so one call over both
meshes fails ("Cannot run aten.mul.Tensor on inputs with different meshes").  The
``FOREACH`` table and LAMB therefore run one call per ``tensor_ops.foreach_groups`` group
(device, dtype, mesh).  Checked here:

- MARS (AdamW rule, its 3-D and 1-D tensors in one fallback bucket; Lion; a global clip),
  MARS-M (its AdamW backup over a 3-D and a 1-D tensor; a 2-D matrix through the owner
  exchange) and LAMB, with one group holding tensors of both meshes, step with
  ``foreach=True`` bit for bit as their loops;
- MARS's global clip (``clip_scope="global"``: one norm over every tensor, which one stack
  of DTensor norms cannot hold across meshes: ``mars_equations.global_norm`` sums per mesh)
  clips as the plain tensors' one norm does;
- placements need no split: tensors of one mesh with different placements go in one call;
- one group is one call with the caller's own list: what every single-mesh step did before.
"""
import pytest
import torch

from theory_tests.support.distributed_harness import run
from torch_impl import LAMB, MARS, MARSM
from torch_impl.common import tensor_ops

F64 = torch.float64
STEPS = 3
CASES = {
    "mars-adamw": (MARS, dict(lr=1e-2, weight_decay=0.1)),
    "mars-adamw-maximize": (MARS, dict(lr=1e-2, weight_decay=0.1, maximize=True)),
    "mars-lion": (MARS, dict(lr=1e-2, mars_type="mars-lion")),
    "mars-m": (MARSM, dict(lr=1e-2, gamma=0.3, ns_dtype=F64)),
    "lamb": (LAMB, dict(lr=1e-2, weight_decay=0.01)),
    # one clip norm over every tensor (M3, paper scope): a sum over both meshes
    "mars-global-clip": (MARS, dict(lr=1e-2, clip_scope="global", optimize_1d=True)),
}


def _meshes(world):
    from torch.distributed.device_mesh import init_device_mesh
    dense = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    experts = init_device_mesh("cpu", (1, world), mesh_dim_names=("efsdp", "ep"))
    return dense, experts


def _tensors(world, seed=0):
    """A dense matrix and a norm weight on ``fsdp`` (Shard(0)), an expert stack on
    ``(efsdp, ep)`` (Shard(0) over ``ep``: whole experts per rank); the same on every rank."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    dense, experts = _meshes(world)
    g = torch.Generator().manual_seed(seed)
    shapes = [(6, 4), (4, 6, 3), (6,)]
    full = [torch.randn(s, generator=g, dtype=F64) for s in shapes]
    meshes = [(dense, [Shard(0)]), (experts, [Replicate(), Shard(0)]), (dense, [Shard(0)])]
    return [distribute_tensor(t, m, p) for t, (m, p) in zip(full, meshes)]


def _train(name, foreach, world, plain=False):
    """``STEPS`` steps of case ``name`` on the DTensors of :func:`_tensors` (``plain``: on
    their full values as plain tensors); returns the full parameters."""
    def tensors(seed):
        ts = _tensors(world, seed)
        return [t.full_tensor() for t in ts] if plain else ts
    cls, options = CASES[name]
    params = [torch.nn.Parameter(t) for t in tensors(0)]
    opt = cls([dict(params=params)], foreach=foreach, **options)
    for t in range(STEPS):
        for p, g in zip(params, tensors(100 + t)):
            p.grad = g
        opt.step()
    return [p.detach() if plain else p.detach().full_tensor() for p in params]


def _job(rank, world):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    out = {}
    for name in CASES:
        out[name] = (_train(name, True, world), _train(name, False, world))
    out["plain"] = _train("mars-global-clip", False, world, plain=True)
    params = _tensors(world)
    out["groups"] = tensor_ops.foreach_groups(params + [params[1].clone(), torch.ones(2)])
    dense, _ = _meshes(world)  # one mesh, two placements: one call, as the loop
    mixed = [distribute_tensor(torch.full((4, 2), 3.0, dtype=F64), dense, [Shard(0)]),
             distribute_tensor(torch.full((4,), 5.0, dtype=F64), dense, [Replicate()])]
    loop = [t.clone() for t in mixed]
    out["one_mesh_groups"] = tensor_ops.foreach_groups(mixed)
    tensor_ops.FOREACH.mul_(mixed, 0.5)
    for t in loop:
        tensor_ops.SINGLE.mul_(t, 0.5)
    out["one_mesh"] = [(a.full_tensor(), b.full_tensor()) for a, b in zip(mixed, loop)]
    return out


@pytest.fixture(scope="module")
def ranks():
    return run(_job, 2, timeout=120.0)


@pytest.mark.parametrize("name", list(CASES))
def test_a_group_on_two_meshes_steps_by_foreach_as_by_the_loop(ranks, name):
    for res in ranks:
        for a, b in zip(*res[name]):
            assert torch.equal(a, b), name


def test_a_global_clip_over_two_meshes_is_the_clip_of_the_plain_tensors(ranks):
    """The one norm of a global clip, summed per mesh and then over the meshes
    (``mars_equations.global_norm``), clips as the plain tensors' norm does (float64: the
    sums are only regrouped; 1e-14)."""
    for res in ranks:
        for a, b in zip(res["mars-global-clip"][0], res["plain"]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-14)


def test_foreach_groups_split_by_mesh_device_and_dtype(ranks):
    """[dense matrix, experts, norm, experts again, a plain float32 tensor]: the two dense
    tensors share one call, the two expert stacks another, the plain tensor its own."""
    for res in ranks:
        assert res["groups"] == [[0, 2], [1, 3], [4]]


def test_placements_of_one_mesh_share_a_call(ranks):
    for res in ranks:
        assert res["one_mesh_groups"] == [[0, 1]]
        for a, b in res["one_mesh"]:
            assert torch.equal(a, b)


def test_one_group_is_the_callers_own_call():
    """Plain tensors of one device and dtype: the kernel runs once, on the caller's list
    (the single-mesh step is the call it always was)."""
    calls = []

    def kernel(x, s):
        calls.append((x, s))
        return x

    xs, scalars = [torch.ones(2), torch.ones(3)], [0.5, 0.25]
    assert tensor_ops._per_group(kernel)(xs, scalars) is xs
    assert len(calls) == 1 and calls[0][0] is xs and calls[0][1] is scalars


def test_groups_keep_each_tensors_arguments_and_order():
    """Two dtypes: each call gets its tensors' own per-tensor scalars, results come back in
    the caller's order, an out-of-place kernel returns new tensors, an in-place one the list."""
    xs = [torch.full((2,), 2.0), torch.full((2,), 3.0, dtype=F64), torch.full((1,), 4.0)]
    roots = tensor_ops.FOREACH.sqrt(xs)
    assert [r.dtype for r in roots] == [x.dtype for x in xs]
    assert all(torch.equal(r, x.sqrt()) for r, x in zip(roots, xs))
    assert tensor_ops.FOREACH.mul_(xs, [10.0, 100.0, 1000.0]) is xs
    assert [x[0].item() for x in xs] == [20.0, 300.0, 4000.0]
