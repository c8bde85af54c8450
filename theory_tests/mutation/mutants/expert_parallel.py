"""Mutants of what expert parallelism needs from MARS, MARS-M and LAMB (issue 48): foreach
kernels grouped by DTensor mesh (``torch_impl/common/tensor_ops.py``, LAMB) and expert stacks
orthogonalised on the rank that holds them (``torch_impl/common/sharding.py``), keyed by the
``paper_notes/claims.md`` rows FOREACH-MESH and MARS-EP."""
from ..mutant import Mutant

__all__ = ["MUTANTS"]

T_TENSOR_OPS = "torch_impl/common/tensor_ops.py"
T_SHARDING = "torch_impl/common/sharding.py"
T_LAMB = "torch_impl/baselines/lamb.py"
T_FUNCTIONAL = "torch_impl/mars/functional.py"
T_MARS_EQUATIONS = "torch_impl/mars/mars_equations.py"

_MESHES = "theory_tests/distributed/test_foreach_meshes.py::"
TWO_MESHES = (_MESHES + "test_a_group_on_two_meshes_steps_by_foreach_as_by_the_loop",)
GLOBAL_CLIP = (_MESHES + "test_a_global_clip_over_two_meshes_is_the_clip_of_the_plain_tensors",)
_EP = "theory_tests/distributed/test_mars_ep.py::"
EP_EQUAL = (_EP + "test_two_ep_ranks_step_as_one_process",)
EP_EXPERT_COUNT = (
    _EP + "test_expert_stacks_are_orthogonalised_where_they_live_with_no_collective",)
EP_DENSE_COUNT = (_EP + "test_the_dense_matrices_cost_their_norms_and_one_owner_exchange",)

_KEY = "    return t.device, t.dtype, (t.device_mesh if is_dtensor(t) else None)"
_NO_MESH = "    return t.device, t.dtype, None"

MUTANTS = {
    "FOREACH-MESH": [
        # the grouping ignores the mesh: one foreach call spans the dense and the expert mesh
        Mutant(T_TENSOR_OPS, _KEY, _NO_MESH, tests=TWO_MESHES),
        # LAMB batches a whole group again (its stacked trust ratios span two meshes)
        Mutant(T_LAMB, "    for idx in foreach_groups(params):",
               "    for idx in [list(range(len(params)))]:"),
        # each group's call gets every tensor's per-tensor scalars, not its own
        Mutant(T_TENSOR_OPS,
               "*([a[i] for i in idx] if isinstance(a, list) else a for a in args))",
               "*args)"),
        # a group's results put back at the wrong positions
        Mutant(T_TENSOR_OPS, "            for i, r in zip(idx, part):",
               "            for i, r in zip(reversed(idx), part):"),
        # MARS's global clip norm stacked across meshes again
        Mutant(T_MARS_EQUATIONS, "    if len(meshes) > 1 and None not in meshes:",
               "    if False:", tests=GLOBAL_CLIP),
        # ... or summed per mesh but a mesh's sum of norms taken for its sum of squares
        Mutant(T_MARS_EQUATIONS,
               "        norms = [_full(_stacked_norm(ns)) for ns in meshes.values()]",
               "        norms = [_full(sum(ns)) for ns in meshes.values()]", tests=GLOBAL_CLIP),
    ],
    "MARS-EP": [
        # the same grouping bug, on torchtitan's EP path: the one-group cases raise
        Mutant(T_TENSOR_OPS, _KEY, _NO_MESH, tests=EP_EQUAL),
        # torchtitan's experts (_StridedShard(0), Shard(0)) taken for matrices in pieces: each
        # stack all-gathered and orthogonalised whole (right numbers, a collective per stack)
        Mutant(T_SHARDING, "type(pl) in (Shard, _StridedShard)", "type(pl) in (Shard,)",
               tests=EP_EXPERT_COUNT),
        # every DTensor stack all-gathered, whole experts on a rank or not
        Mutant(T_SHARDING, "    if holds_whole_matrices(M):\n        return on_local_matrices(",
               "    if False:\n        return on_local_matrices(", tests=EP_EXPERT_COUNT),
        # MARS-M's dense matrices all-gathered on every rank instead of the owner exchange
        Mutant(T_FUNCTIONAL, '    if orthogonalize_on == "owner":  # sharded matrices: each NS',
               '    if orthogonalize_on == "never":  # sharded matrices: each NS',
               tests=EP_DENSE_COUNT),
    ],
}
