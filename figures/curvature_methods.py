r"""Each Kronecker method's approximation of a layer's exact GGN block, and its distance to it
(figure ``curvature_distance``; issue 46 item 7, KC1, KC4, KC5, KC7, KC9).

Methods, per preconditioned layer, each a pair (G, A) whose kron(G, A) stands for the block of
[W | b] flattened row-major (KC1):

* **K-FAC** in each flavour, ``fisher_type`` ∈ {empirical, mc, type-2} × ``kfac_approx`` ∈
  {expand, reduce} (KC2–KC5), through :data:`KFAC_FACTORS`, a function with the signature of
  the port's ``kfac_factors`` (issue 46 item 2): the figure draws the port's. The NumPy
  oracle's formulas (``reference/baselines/kfac_flavours.py``) on the rows of
  :mod:`figures.curvature_rows` (:func:`oracle_kfac_factors`) stay as the independent check
  the figure's tests compare it with.
* **MKOR rank k** (KC7): the R rows of the capture (sample order) cut into k contiguous groups
  (``torch.tensor_split``), ā_j the mean of [a_r | 1] and ḡ_j the mean of R_g·g_r over group j
  (g_r the rows of the training loss's gradient w.r.t. the layer output; R_g = R for a Linear,
  the batch size B for a Conv2d, as rank-1 MKOR's K3/K4), the statistic
  (1/k) Σ_j ḡ_j ḡ_jᵀ ⊗ (1/k) Σ_j ā_j ā_jᵀ. k = 1 is MKOR's ḡḡᵀ ⊗ āāᵀ. The groups are the
  port's own cut (:func:`port_group_means`, over ``torch_impl.mkor.rank_k.group_row_sums``,
  what ``MKOR(rank=k)`` runs); :func:`split_group_means` (``torch.tensor_split``) is the
  independent check of it.
* **best Kronecker** (KC9): the top singular pair of the Van Loan–Pitsianis rearrangement of
  the block itself, the Frobenius-closest G ⊗ A there is (the oracle's ``best_kronecker``).

**Distances.** raw = ‖B − G⊗A‖_F / ‖B‖_F with B the exact GGN block; **scaled** =
min_c ‖B − c G⊗A‖_F / ‖B‖_F, at c* = ⟨B, G⊗A⟩ / ‖G⊗A‖²_F (reported with it). The scaled one is
what a method's *shape* costs: MKOR's scale is arbitrary (its rescale absorbs it: the factors'
inverses are renormalised to the gradient's norm) and K-FAC's is set by its damping and lr
in practice. The raw one is reported for K-FAC's flavours, which claim to approximate the
block itself (c* = 1 where a flavour is exact). Since the best Kronecker product minimises
over every scale too, its distance is ≤ each method's scaled distance ≤ its raw one
(tested in ``theory_tests/figures/test_curvature_distance.py``).

**Cancelled statistics.** Where a method's G sums rows that cancel -- the rows of a whole
sequence at an attention *key* projection sum to zero, since adding one vector to every key
leaves the softmax unchanged -- what is left of G is rounding noise, and so would be any
distance computed from it. A G whose trace is below ``VANISHED`` times that of the same
rows' uncancelled statistic (K-FAC's expand G for its reduce G; MKOR's one-row-per-group G for
its k-group G: both bound it from above, by Cauchy–Schwarz up to the group size) is recorded
as ``vanished``, with the exact-arithmetic distances of K = 0: scaled 1, c* = 0, raw 1.
"""
import numpy as np
import torch
from torch import nn

from reference.baselines import kfac_flavours as oracle
from theory_tests.support import curvature as truth  # helper A's brute force (KC1)

from torch_impl import kfac_factors
from torch_impl.mkor.rank_k import group_row_sums

from .curvature_rows import Forward

__all__ = ["FLAVOURS", "oracle_kfac_factors", "KFAC_FACTORS", "split_group_means", "port_group_means",
           "GROUP_MEANS", "mkor_rank_k_factors", "raw_distance", "scaled_distance",
           "layer_distances", "preconditioned_layers"]

FLAVOURS = tuple((f, a) for a in ("expand", "reduce") for f in ("empirical", "mc", "type-2"))
# tr(G) / tr(uncancelled G) below this: G is rounding noise (module docstring). Rounding
# leaves ~1e-32 (squared norms at float64's 1e-16), a real statistic >~ 1e-6 in these nets.
VANISHED = 1e-20


def preconditioned_layers(model):
    """(name, module) of every Linear / Conv2d, in forward (registration) order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]


def oracle_kfac_factors(model, loss_func, inputs, targets, *, fisher_type="type-2",
                        kfac_approx="expand", mc_samples=1, generator=None):
    """The port's ``kfac_factors`` contract ({name: (A, G)}, float64 tensors) computed by
    the oracle's formulas (KC2–KC5) on :class:`~figures.curvature_rows.Forward`'s rows. "mc"
    draws from a NumPy generator seeded by ``generator.initial_seed()`` (the port draws from
    the torch generator itself: the same distribution, other samples)."""
    kind = truth.loss_kind(loss_func)
    layers = preconditioned_layers(model)
    fwd = Forward(model, [m for _, m in layers], inputs)
    out = fwd.output.detach()
    points = truth.output_points(loss_func, out)
    labels = truth.target_points(loss_func, targets, out)
    R = truth.reduction_factor(loss_func, out)
    rng = np.random.default_rng(generator.initial_seed() if generator is not None else 0)
    cols = oracle.kfac_columns(kind, fisher_type, points.numpy(), labels.numpy(),
                               samples=mc_samples, rng=rng)
    per_column = [fwd.backprop(truth.points_to_output(torch.from_numpy(c), out.shape, loss_func))
                  for c in cols]
    rule = oracle.expand_factors if kfac_approx == "expand" else oracle.reduce_factors
    factors = {}
    for name, module in layers:
        g = np.stack([c[name].detach().numpy() for c in per_column])
        A, G = rule(fwd.a[name].numpy(), g, R, has_bias=module.bias is not None)
        factors[name] = (torch.from_numpy(A), torch.from_numpy(G))
    return factors


# The K-FAC factors the figure draws: the port's (the oracle's stay as the tests' check).
KFAC_FACTORS = kfac_factors


def split_group_means(rows, k):
    """(k, d) means of ``rows`` (R, d) over k contiguous groups of sizes as equal as possible
    (KC7, ``torch.tensor_split``): the figure's own statement of the cut, checked against the
    port's."""
    return torch.stack([group.mean(0) for group in torch.tensor_split(rows, k)])


def port_group_means(rows, k):
    """(k, d) group means of ``rows`` (R, d, k <= R: no group is empty) by the port's cut,
    ``torch_impl.mkor.rank_k.group_row_sums`` (KC7's additive form: sums / counts)."""
    sums, counts = group_row_sums(rows, k)
    return sums / counts.unsqueeze(-1).to(sums.dtype)


GROUP_MEANS = port_group_means  # the statistic MKOR(rank=k) runs


def mkor_rank_k_factors(fwd, loss, k):
    """{name: (A_k, G_k, vanished)} of MKOR rank k (KC7, module docstring) for the layers of
    the :class:`Forward` ``fwd``, whose (reduced) training loss is ``loss``."""
    g_rows = fwd.loss_rows(loss)
    out = {}
    for name, layer in fwd.layers.items():
        a = fwd.a[name].reshape(-1, fwd.a[name].shape[-1])
        if layer.bias is not None:
            a = torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)
        g = g_rows[name].detach().reshape(-1, g_rows[name].shape[-1])
        if k > a.shape[0]:
            raise ValueError(f"{name}: rank {k} > its {a.shape[0]} rows")
        per_sample = fwd.a[name].shape[0] if isinstance(layer, nn.Conv2d) else a.shape[0]
        a_bar, g_bar = GROUP_MEANS(a, k), GROUP_MEANS(per_sample * g, k)
        G = g_bar.T @ g_bar / k
        uncancelled = float((per_sample * g).square().sum()) / g.shape[0]  # one row per group
        out[name] = (a_bar.T @ a_bar / k, G, float(torch.trace(G)) < VANISHED * uncancelled)
    return out


def raw_distance(block, approx):
    """‖B − K‖_F / ‖B‖_F."""
    return float(torch.linalg.norm(block - approx) / torch.linalg.norm(block))


def scaled_distance(block, approx):
    """(min_c ‖B − c K‖_F / ‖B‖_F, c*), c* = ⟨B, K⟩ / ‖K‖²_F (0 for K = 0)."""
    kk = float((approx * approx).sum())
    c = float((block * approx).sum()) / kk if kk > 0 else 0.0
    return raw_distance(block, c * approx), c


def layer_distances(model, loss_func, inputs, targets, *, ranks=(1, 2, 4, 8), mc_seed=0):
    """Records (dict: layer, method, family, scaled, scale, raw, vanished) of every method's
    distance to each preconditioned layer's exact GGN block (module docstring; raw only for
    K-FAC's flavours and the best Kronecker product, whose raw and scaled distances agree)."""
    layers = preconditioned_layers(model)
    blocks = {n: truth.ggn_block(model, loss_func, inputs, targets, m) for n, m in layers}
    records = []

    def add(name, method, family, A, G, raw, vanished=False):
        if vanished:  # K = 0 in exact arithmetic (module docstring)
            records.append(dict(layer=name, method=method, family=family, scaled=1.0,
                                scale=0.0, raw=1.0 if raw else None, vanished=True))
            return
        K = torch.kron(G.to(torch.float64), A.to(torch.float64))
        scaled, c = scaled_distance(blocks[name], K)
        records.append(dict(layer=name, method=method, family=family, scaled=scaled, scale=c,
                            raw=raw_distance(blocks[name], K) if raw else None,
                            vanished=False))

    expand_G = {}
    for fisher_type, approx in FLAVOURS:  # expand first: it bounds reduce's G
        factors = KFAC_FACTORS(model, loss_func, inputs, targets, fisher_type=fisher_type,
                               kfac_approx=approx, mc_samples=1,
                               generator=torch.Generator().manual_seed(mc_seed))
        for name, _ in layers:
            A, G = factors[name]
            trace = float(torch.trace(G.to(torch.float64)))
            if approx == "expand":
                expand_G[fisher_type, name] = trace
            vanished = trace < VANISHED * expand_G[fisher_type, name]
            add(name, f"K-FAC {fisher_type} {approx}", "K-FAC", A, G, True, vanished)
    fwd = Forward(model, [m for _, m in layers], inputs)
    loss = loss_func(fwd.output, targets)
    for k in ranks:
        for name, (A, G, vanished) in mkor_rank_k_factors(fwd, loss, k).items():
            add(name, f"MKOR rank {k}", "MKOR", A, G, False, vanished)
    for name, module in layers:
        d_out, d_in, has_bias = truth.layer_shape(module)
        G, A = oracle.best_kronecker(blocks[name].numpy(), d_out, d_in + has_bias)
        add(name, "best Kronecker", "best", torch.from_numpy(A), torch.from_numpy(G), True)
    return records
