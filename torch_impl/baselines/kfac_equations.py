"""The equations K-FAC runs per layer (spec MKOR.md K19), apart from the optimizer in
:mod:`.kfac`: the sums behind a layer's batch factors from one forward's and one backward's
rows, the damped decomposition of a factor with its fallbacks, and the preconditioned
gradient V from the decompositions. The oracle writes them in ``reference/baselines/kfac.py``
(``kfac_factors``, ``eigen_decompose``, ``damped_inverse``, ``eigen_precondition``)."""
import torch

from ..mkor.layers import LayerType

__all__ = ["input_stat", "grad_stat", "per_sample", "decompose", "preconditioned_gradient"]


def _masked_flat(rows, mask):
    rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
    flat = rows.reshape(-1, rows.shape[-1])
    if mask is None:
        return flat, flat.shape[0], None
    keep = mask.reshape(-1, 1)
    return torch.where(keep, flat, 0), mask.sum(), keep


#: rows per chunk of a stack's outer products: chunk x d^2 values at a time
_CHUNK_VALUES = 2 ** 22


def _expert_outer_sums(flat, experts, num_experts):
    """(E, d, d): sum over the rows routed to each expert of x x^T, from (S, d) rows and
    their experts (S,), by index_add_ of the rows' outer products in chunks (no loop over
    the experts, no host sync; memory chunk x d^2)."""
    d = flat.shape[-1]
    out = flat.new_zeros(num_experts, d, d)
    step = max(1, _CHUNK_VALUES // max(1, d * d))
    for start in range(0, flat.shape[0], step):
        x = flat[start:start + step]
        out.index_add_(0, experts[start:start + step], x.unsqueeze(-1) * x.unsqueeze(-2))
    return out


def _expert_counts(mask, experts, num_experts):
    ones = torch.ones_like(experts) if mask is None else mask.reshape(-1).long()
    return torch.zeros(num_experts, dtype=torch.long, device=experts.device).index_add_(
        0, experts, ones)


def input_stat(layer, rows, mask, experts=None):
    """(sum_i a_i a_i^T, rows) of one forward, rows with a trailing 1 for a bias (0 on a
    masked row); an identity side (size guard) stores nothing. A stack of experts
    (``experts``: each row's expert) gives each expert's own ((E, d, d), (E,))."""
    flat, n, keep = _masked_flat(rows, mask)
    if experts is not None:
        n = _expert_counts(mask, experts, layer.experts)
        if layer.identity_R:
            return flat.new_zeros(0), n
        if layer.has_bias:
            ones = flat.new_ones(flat.shape[0], 1) if keep is None else keep.to(flat.dtype)
            flat = torch.cat([flat, ones], dim=1)
        return _expert_outer_sums(flat, experts, layer.experts), n
    if layer.identity_R:
        return flat.new_zeros(0), n
    if layer.has_bias:
        ones = flat.new_ones(flat.shape[0], 1) if keep is None else keep.to(flat.dtype)
        flat = torch.cat([flat, ones], dim=1)
    return flat.T @ flat, n


def grad_stat(layer, rows, mask, experts=None):
    """(sum_i g_i g_i^T, samples): G = N sum_i g_i g_i^T once N, the samples of every
    micro-batch, is known (one sample is ``rows_per_sample`` rows: L for Conv2d); per expert
    for a stack of experts (one row per routed pair)."""
    flat, n, _ = _masked_flat(rows, mask)
    if experts is not None:
        n = _expert_counts(mask, experts, layer.experts)
        if layer.identity_L:
            return flat.new_zeros(0), n
        return _expert_outer_sums(flat, experts, layer.experts), n
    samples = n / layer.type.rows_per_sample(rows.shape[:-1])
    if layer.identity_L:
        return flat.new_zeros(0), samples
    return flat.T @ flat, samples


def per_sample(layer):
    """Whether the layer type counts several rows per sample (Conv2d: L positions), so its
    sample count travels apart from its row count."""
    return type(layer.type).rows_per_sample is not LayerType.rows_per_sample


def decompose(F, damping, method):
    """eigh / inv of the factor F with fallbacks: float64, then more damping. Returns the
    result (in F's dtype) and the number of failed attempts, or (None, attempts)."""
    attempts = 0
    for extra in (0.0, 0.0, 10 * damping, 100 * damping, 1000 * damping):
        # a stack of experts' factors (E, d, d) is decomposed batched, each matrix its own
        M = (F + F.mT) / 2 if attempts == 0 else (F + F.mT).double() / 2
        if extra:
            M = M + extra * torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)
        try:
            if method == "eigen":
                lam, Q = torch.linalg.eigh(M)
                out = (lam.clamp(min=0).to(F.dtype), Q.to(F.dtype))  # rounding can go < 0
                ok = torch.isfinite(lam).all() and torch.isfinite(Q).all()
            else:
                eye = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)
                inv = torch.linalg.inv(M + damping * eye)
                out, ok = inv.to(F.dtype), torch.isfinite(inv).all()
        except RuntimeError:  # torch.linalg.LinAlgError is a RuntimeError
            ok = False
        if ok:
            return out, attempts
        attempts += 1
    return None, attempts



def preconditioned_gradient(s, G_hat, damping, method):
    """V for one layer from its decompositions in the state ``s`` (K19): ``"eigen"``,
    Q_G[(Q_G^T G_hat Q_A) / (lam_G lam_A^T + delta)]Q_A^T; ``"inverse"``,
    (G + delta I)^{-1} G_hat (A + delta I)^{-1}. An identity side is the factor I."""
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
