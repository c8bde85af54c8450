"""The equations K-FAC runs per layer (spec MKOR.md K19), apart from the optimizer in
:mod:`.kfac`: the sums behind a layer's batch factors from one forward's and one backward's
rows, the damped decomposition of a factor with its fallbacks, and the preconditioned
gradient V from the decompositions. The oracle writes them in ``reference/baselines/kfac.py``
(``kfac_factors``, ``eigen_decompose``, ``damped_inverse``, ``eigen_precondition``).

A stack of E experts (a fused experts projection, ``layer.experts = E``) is E independent
layers: its statistics, factors and decompositions carry a leading expert axis, each
expert's computed from its own rows as for an ``nn.Linear`` fed them (the oracle:
``expert_kfac_factors`` in ``reference/baselines/kfac.py``), in batched operations, never a
Python loop over the experts (but for the rare per-matrix retry of a failed decomposition)."""
import torch

from ..kronecker.layers import LayerType

__all__ = ["input_stat", "grad_stat", "per_sample", "decompose", "decompose_stack",
           "identity_decomposition", "preconditioned_gradient"]


def _masked_flat(rows, mask):
    rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
    flat = rows.reshape(-1, rows.shape[-1])
    if mask is None:
        return flat, flat.shape[0], None
    keep = mask.reshape(-1, 1)
    return torch.where(keep, flat, 0), mask.sum(), keep


def _expert_outer_sums(flat, experts, num_experts):
    r"""(E, d, d): :math:`\sum_{i: e_i = e} x_i x_i^T` for every expert e, from the rows
    ``flat`` (S, d) and their experts ``experts`` (S,) in [0, E).

    The rows are sorted by expert and cut into *segments*: one expert's rows inside one
    chunk of c = ceil(S / E) consecutive sorted rows. A segment starts at every chunk
    boundary and at every change of expert, so there are at most ceil(S / c) + E - 1 <= 2E - 1
    segments of at most c rows each, numbers the shapes alone give: no host sync (a loop over
    the experts would select each expert's rows by a data-dependent count, E syncs) and no
    Python loop over the experts. Each segment, zero-padded to c rows (a zero row adds
    nothing), gives its Gram matrix in one batched product; the products are added into
    their experts by ``index_add_``, E segments at a time (at most two rounds).

    Cost: the padded rows are at most S + E c <= 2S, so at most 2 S d^2 multiply-adds in
    GEMMs (the per-expert loop does S d^2, in E separate products); memory 2 S d for the
    padded rows and E d^2 for one round of products, beside the E d^2 result. Measured on
    2 CPU threads (E=8, S=4096, d=256): 7.5 ms float32 / 15 ms float64, against 4.0 / 8.8 ms
    for the per-expert loop (whose syncs cost nothing there) and 24 / 780 ms for an
    ``index_add_`` of every row's outer product (S d^2 of elementwise work); the one-hot
    product (onehot * x)^T x costs E S d^2.
    """
    S, d = flat.shape
    out = flat.new_zeros(num_experts, d, d)
    if S == 0:
        return out
    c = -(-S // num_experts)  # rows per chunk
    order = torch.argsort(experts, stable=True)
    x, e = flat[order], experts[order]
    i = torch.arange(S, device=flat.device)
    starts = torch.ones(S, dtype=torch.bool, device=flat.device)
    starts[1:] = (e[1:] != e[:-1]) | (i[1:] // c != i[:-1] // c)
    segment = torch.cumsum(starts, 0) - 1
    offset = i - torch.cummax(torch.where(starts, i, 0), 0).values  # row within its segment
    count = -(-S // c) + num_experts - 1  # the bound above; spare segments stay all zero
    padded = flat.new_zeros(count, c, d)
    padded[segment, offset] = x
    owner = torch.zeros(count, dtype=experts.dtype, device=flat.device).scatter_(
        0, segment, e)  # each segment's expert (a spare one: expert 0, adding zeros)
    for j in range(0, count, num_experts):
        block = padded[j:j + num_experts]
        out.index_add_(0, owner[j:j + num_experts], block.mT @ block)
    return out


def _expert_counts(mask, experts, num_experts):
    """(E,) int64: the rows of each expert (the unmasked ones), sync-free."""
    ones = torch.ones_like(experts) if mask is None else mask.reshape(-1).long()
    return torch.zeros(num_experts, dtype=torch.long, device=experts.device).index_add_(
        0, experts, ones)


def input_stat(layer, rows, mask, experts=None):
    """(sum_i a_i a_i^T, rows) of one forward, rows with a trailing 1 for a bias (0 on a
    masked row); an identity side (size guard) stores nothing. A stack of experts
    (``experts``: each row's expert, (S,)) gives every expert's own: ((E, d, d), (E,)),
    zeros and 0 for an expert without rows."""
    flat, n, keep = _masked_flat(rows, mask)
    if experts is not None:
        n = _expert_counts(mask, experts, layer.experts)
    if layer.identity_R:
        return flat.new_zeros(0), n
    if layer.has_bias:
        ones = flat.new_ones(flat.shape[0], 1) if keep is None else keep.to(flat.dtype)
        flat = torch.cat([flat, ones], dim=1)
    if experts is not None:
        return _expert_outer_sums(flat, experts, layer.experts), n
    return flat.T @ flat, n


def grad_stat(layer, rows, mask, experts=None):
    """(sum_i g_i g_i^T, samples): G = N sum_i g_i g_i^T once N, the samples of every
    micro-batch, is known (one sample is ``rows_per_sample`` rows: L for Conv2d). A stack
    of experts gives every expert's own ((E, d, d), (E,)): one row per routed pair, so an
    expert's samples are its rows, as for an ``nn.Linear`` expert fed them."""
    flat, n, _ = _masked_flat(rows, mask)
    if experts is not None:
        samples = _expert_counts(mask, experts, layer.experts)
        if layer.identity_L:
            return flat.new_zeros(0), samples
        return _expert_outer_sums(flat, experts, layer.experts), samples
    samples = n / layer.type.rows_per_sample(rows.shape[:-1])
    if layer.identity_L:
        return flat.new_zeros(0), samples
    return flat.T @ flat, samples


def per_sample(layer):
    """Whether the layer type counts several rows per sample (Conv2d: L positions), so its
    sample count travels apart from its row count."""
    if getattr(layer, "experts", None) is not None:
        return False  # a stack of experts: samples = rows, per expert, sent as its counts
    return type(layer.type).rows_per_sample is not LayerType.rows_per_sample


def _attempt(F, damping, method, attempt, extra):
    """One try of :func:`decompose`: (result in F's dtype or None, whether it is finite).
    Attempt 0 in F's dtype, later ones in float64; ``extra`` damping added to F. F may be
    a stack (..., d, d): one batched call, finite only if every matrix's result is."""
    M = (F + F.mT) / 2 if attempt == 0 else (F + F.mT).double() / 2
    if extra:
        M = M + extra * torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)
    try:
        if method == "eigen":
            lam, Q = torch.linalg.eigh(M)
            out = (lam.clamp(min=0).to(F.dtype), Q.to(F.dtype))  # rounding can go < 0
            return out, torch.isfinite(lam).all() and torch.isfinite(Q).all()
        eye = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)
        inv = torch.linalg.inv(M + damping * eye)
        return inv.to(F.dtype), torch.isfinite(inv).all()
    except RuntimeError:  # torch.linalg.LinAlgError is a RuntimeError
        return None, False


def _computed(F):
    """F in the dtype a decomposition runs in: a factor kept in bf16 / fp16
    (``factor_dtype``, :mod:`.kfac_state`) is decomposed in float32, never in 16 bits."""
    return F.to(torch.promote_types(F.dtype, torch.float32))


def decompose(F, damping, method):
    """eigh / inv of the factor F with fallbacks: float64, then more damping. Returns the
    result (in F's dtype, float32 for a 16-bit F) and the number of failed attempts, or
    (None, attempts)."""
    F = _computed(F)
    attempts = 0
    for extra in (0.0, 0.0, 10 * damping, 100 * damping, 1000 * damping):
        out, ok = _attempt(F, damping, method, attempts, extra)
        if ok:
            return out, attempts
        attempts += 1
    return None, attempts


def identity_decomposition(E, d, damping, method, dtype, device):
    """The decomposition of E identity factors (what an identity side means, K19):
    eigenvalues 1 and Q = I, or the inverse I / (1 + delta)."""
    eye = torch.eye(d, dtype=dtype, device=device).expand(E, d, d)
    if method == "eigen":
        return torch.ones(E, d, dtype=dtype, device=device), eye.clone()
    return eye / (1 + damping)


def decompose_stack(F, damping, method, previous=None):
    """Every matrix of a stack F (E, d, d) decomposed as :func:`decompose` would
    decompose it alone: one batched eigh / inv in F's dtype, and only if some matrix fails
    it (rare), each matrix again through :func:`decompose`'s fallbacks on its own -- so a
    failing expert never moves the others to float64 or extra damping.

    Returns (result, attempts, failed): the stacked result (a pair (lam (E, d), Q (E, d, d))
    or the inverses (E, d, d)), the failed attempts summed over the matrices, and the
    experts whose every attempt failed; those keep their part of ``previous`` (the stack's
    last result), or the identity's (:func:`identity_decomposition`) if there is none."""
    F = _computed(F)
    out, ok = _attempt(F, damping, method, 0, 0.0)
    if ok:
        return out, 0, []
    E, d = F.shape[0], F.shape[-1]
    fallback = (previous if previous is not None else
                identity_decomposition(E, d, damping, method, F.dtype, F.device))
    parts, attempts, failed = [], 0, []
    for e in range(E):  # the rare path: one expert's factor failed the batched call
        result, tries = decompose(F[e], damping, method)
        attempts += tries
        if result is None:
            failed.append(e)
            result = (tuple(t[e] for t in fallback) if method == "eigen" else fallback[e])
        parts.append(result)
    if method == "eigen":
        return (torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])), \
            attempts, failed
    return torch.stack(parts), attempts, failed


def preconditioned_gradient(s, G_hat, damping, method):
    """V for one layer from its decompositions in the state ``s`` (K19): ``"eigen"``,
    Q_G[(Q_G^T G_hat Q_A) / (lam_G lam_A^T + delta)]Q_A^T; ``"inverse"``,
    (G + delta I)^{-1} G_hat (A + delta I)^{-1}. An identity side is the factor I. A stack
    of experts (G_hat (E, d_out, d_in'), decompositions led by E) gets every expert's V from
    its own decompositions, in batched products (an identity side broadcasts)."""
    if method == "eigen":
        lamA, QA = s.get("eig_A", (None, None))
        lamG, QG = s.get("eig_G", (None, None))
        X = G_hat if QA is None else G_hat @ QA
        X = X if QG is None else QG.mT @ X
        lam_G = lamG if lamG is not None else X.new_ones(X.shape[-2])
        lam_A = lamA if lamA is not None else X.new_ones(X.shape[-1])
        # lam_G lam_A^T, per expert for a stack ((E, d) eigenvalues)
        lam = (torch.outer(lam_G, lam_A) if X.dim() == 2 else
               lam_G.unsqueeze(-1) * lam_A.unsqueeze(-2))
        X = X / (lam + damping)
        X = X if QA is None else X @ QA.mT
        return X if QG is None else QG @ X
    V = G_hat / (1 + damping) if "inv_A" not in s else G_hat @ s["inv_A"]
    return V / (1 + damping) if "inv_G" not in s else s["inv_G"] @ V
