"""The measurements of figure 8 (:mod:`figures.experiments.rank1_approximation`): a layer's rows and
second moments as MKOR and K-FAC see them, the rank-1 error of a factor, and the cosine
between rank-1 and full-factor preconditioned gradients; ``Probe`` records them by hooks."""
import math

import torch
from torch import nn
from torch.nn import functional as F

LAMBDAS = (0.01, 0.1, 1.0)  # damping, as a fraction of tr(F)/d


def moments(rows):
    """(F, mean) of the (N, d) rows in float64: F = (1/N) sum_i r_i r_i^T."""
    rows = rows.double()
    return rows.T @ rows / rows.shape[0], rows.mean(0)


def rank1_error(second, mean):
    """||F - m m^T||_F / ||F||_F (0 when F is 0)."""
    norm = torch.linalg.matrix_norm(second)
    if norm == 0:
        return 0.0
    return float(torch.linalg.matrix_norm(second - torch.outer(mean, mean)) / norm)


def mean_share(second, mean):
    """tr(m m^T) / tr(F) = ||m||^2 / tr(F), in [0, 1]: the part of the second moment's trace
    the mean carries (0 when the mean vanishes; nan when F is 0)."""
    trace = float(torch.diagonal(second).sum())
    return float(mean @ mean) / trace if trace > 0 else math.nan


def damping(second, lam):
    """delta = lam * tr(F) / d (the mean eigenvalue of the full factor, times lam)."""
    return lam * float(torch.diagonal(second).sum()) / second.shape[0]


def damped_precondition(G_hat, left, right, delta_left, delta_right):
    """(left + delta_left I)^{-1} G_hat (right + delta_right I)^{-1}, by two solves."""
    eye = lambda d: torch.eye(d, dtype=left.dtype)  # noqa: E731
    X = torch.linalg.solve(left + delta_left * eye(left.shape[0]), G_hat.double())
    return torch.linalg.solve(right + delta_right * eye(right.shape[0]), X.T).T


def cosine(X, Y):
    nx, ny = torch.linalg.vector_norm(X), torch.linalg.vector_norm(Y)
    if nx == 0 or ny == 0:
        return math.nan
    return float((X * Y).sum() / (nx * ny))


def layer_metrics(stats, G_hat, mkor_factors=None, lambdas=LAMBDAS):
    """The quantities of one layer at one step, from its probe ``stats`` (F_A, a_bar, F_G,
    g_bar), its gradient matrix ``G_hat`` (d_out, d_in') and MKOR's (L_inv, R_inv)."""
    FA, abar, FG, gbar = stats
    out = dict(err_A=rank1_error(FA, abar), err_G=rank1_error(FG, gbar),
               share_A=mean_share(FA, abar), share_G=mean_share(FG, gbar))
    G_hat = G_hat.double()
    A1, G1 = torch.outer(abar, abar), torch.outer(gbar, gbar)
    P_mkor = None
    if mkor_factors is not None and all(f is not None for f in mkor_factors):
        L_inv, R_inv = (f.double() for f in mkor_factors)
        P_mkor = L_inv @ G_hat @ R_inv
    for lam in lambdas:
        dA, dG = damping(FA, lam), damping(FG, lam)
        full = damped_precondition(G_hat, FG, FA, dG, dA)
        rank1 = damped_precondition(G_hat, G1, A1, dG, dA)
        out[f"cos_rank1_full@{lam:g}"] = cosine(rank1, full)
        out[f"cos_grad_full@{lam:g}"] = cosine(G_hat, full)
        out[f"cos_mkor_full@{lam:g}"] = math.nan if P_mkor is None else cosine(P_mkor, full)
    return out


# ------------------------------------------------------------------ rows and the probe
def input_rows(module, x):
    """The (N, d_in') input rows of a Linear (per token) or Conv2d (unfolded patches),
    with a 1 appended when the layer has a trainable bias."""
    if isinstance(module, nn.Conv2d):
        if isinstance(module.padding, str) or module.padding_mode != "zeros":
            raise NotImplementedError("only integer zero padding")
        patches = F.unfold(x, module.kernel_size, dilation=module.dilation,
                           padding=module.padding, stride=module.stride)
        rows = patches.transpose(1, 2).reshape(-1, patches.shape[1])
    else:
        rows = x.reshape(-1, x.shape[-1])
    if module.bias is not None and module.bias.requires_grad:
        rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
    return rows


def grad_rows(module, g):
    """The (N, d_out) output-gradient rows: N g_i for a Linear (N = rows), B g_{b,l} for
    a Conv2d (B = samples, one row per output position)."""
    if isinstance(module, nn.Conv2d):
        return g.flatten(2).transpose(1, 2).reshape(-1, g.shape[1]) * g.shape[0]
    rows = g.reshape(-1, g.shape[-1])
    return rows * rows.shape[0]


def grad_matrix(module):
    """[dW | db] as (d_out, d_in') in float64."""
    G = module.weight.grad.reshape(module.weight.shape[0], -1).double()
    if module.bias is not None and module.bias.requires_grad:
        G = torch.cat([G, module.bias.grad.double().reshape(-1, 1)], dim=1)
    return G


class Probe:
    """Forward hooks (plus a gradient hook on the output) on the named Linear / Conv2d
    modules; while ``active``, each forward + backward stores (F_A, a_bar, F_G, g_bar) of
    that module in ``stats`` (one call per module per forward is assumed)."""

    def __init__(self, model, names):
        self.modules = {n: m for n, m in model.named_modules() if n in set(names)}
        self.active, self.stats = False, {}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in self.modules.items()]

    def _hook(self, name):
        def hook(module, args, output):
            if not (self.active and torch.is_grad_enabled() and output.requires_grad):
                return
            FA, abar = moments(input_rows(module, args[0].detach()))

            def on_grad(g):
                FG, gbar = moments(grad_rows(module, g.detach()))
                self.stats[name] = (FA, abar, FG, gbar)
            output.register_hook(on_grad)
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


# ------------------------------------------------------------------ tasks
