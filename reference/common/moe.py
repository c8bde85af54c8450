r"""The fused mixture-of-experts forward model and its rows, NumPy float64 (issue 31; spec
MKOR.md K3 and "Mixture-of-experts in transformers 5"): a problem both families' per-expert
equations run on, not an equation of either paper.

transformers 5 stores a model's experts as 3-D parameters of one module: ``gate_up_proj``
(E, 2I, H) (or ``up_proj`` (E, I, H) without a gate) and ``down_proj`` (E, H, I), each
(E, d_in, d_out) instead when the layout is transposed, with optional biases (E, d_out).
Per routed pair (token t, slot j), expert e = top_k_index[t, j], weight w = top_k_weights[t, j]:

    x = hidden[t],  h = W_up[e] x (+ b_up[e]),  a2 = gate(h),  y = W_down[e] a2 (+ b_down[e]),
    z = post_norm(y) (or z = y),  out[t] += w z.

Each expert's projection is its own ``nn.Linear`` layer: its rows are those of the pairs
routed to it, in the eager loop's order, so

* up projection:   a = x,   g = dL/dh = gate's VJP of dL/da2 (dL/da2 = W_down[e]^T dL/dy);
* down projection: a = a2,  g = dL/dy = post_norm's VJP of w dL/dout[t] (w dL/dout[t] alone
  without a norm): the routing weight enters here, and through it the up projection's g;
* an expert routed no pair has 0 rows.

This module holds the gates and activations (h -> a2 with its VJP, written out by hand), the
routing (``routed_pairs``), the rows (``expert_rows``, ``projection_rows``, ``expert_pairs``)
and the weight gradients they give (``expert_weight_grads``). The per-expert equations live
with their families: MKOR's in ``reference/mkor/experts.py`` (K3, K6, K8-K14), K-FAC's in
``reference/baselines/kfac.py`` (K19). Independent of the torch port (NumPy only).
"""
from dataclasses import dataclass
from typing import Callable

import numpy as np

__all__ = [
    # gates and activations (the forward of h -> a2 and its VJP)
    "Gate", "sigmoid", "silu", "silu_grad", "split_gate_up", "merge_gate_up", "swiglu_gate",
    "clamped_swiglu_gate", "elementwise_activation", "rms_norm", "GATES", "ACTIVATIONS",
    # routing and rows (K3)
    "routed_pairs", "linear_layout", "expert_rows", "PROJECTIONS", "projection_rows",
    "expert_pairs", "expert_weight_grads",
]

#: the names of the two projections in ``expert_rows``' dicts: up (gate_up or up) and down
PROJECTIONS = {"up": ("a_gu", "g_gu"), "down": ("a_d", "g_d")}


# ------------------------------------------------------------------ gates and activations

@dataclass(frozen=True)
class Gate:
    """A map h -> a2 applied row by row, with its vector-Jacobian product.

    ``forward(h)`` maps (n, d_h) to (n, d_a); ``vjp(h, g)`` maps dL/da2 (n, d_a) to dL/dh
    (n, d_h) at the point h. Gates, activations and the post-expert norm all take this form.
    """

    forward: Callable
    vjp: Callable
    name: str = "custom"

    def __call__(self, h):
        return self.forward(h)


def sigmoid(x):
    """1 / (1 + exp(-x)), written so that no exp overflows for either sign of x."""
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def silu(x):
    """SiLU(x) = x sigmoid(x) (transformers' ``ACT2FN["silu"]``)."""
    return x * sigmoid(x)


def silu_grad(x):
    """d SiLU / dx = s (1 + x (1 - s)), s = sigmoid(x)."""
    s = sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


def split_gate_up(h, layout="concatenated"):
    r"""(gate, up) halves of the up projection's output h (n, 2I).

    "concatenated" (``is_concatenated=True``): h = [gate | up], gate = h[:, :I];
    "interleaved" (``is_concatenated=False``, GPT-OSS): h = [g0, u0, g1, u1, ...],
    gate = h[:, 0::2], up = h[:, 1::2].
    """
    h = np.asarray(h, dtype=np.float64)
    if layout == "concatenated":
        half = h.shape[-1] // 2
        return h[..., :half], h[..., half:]
    if layout == "interleaved":
        return h[..., 0::2], h[..., 1::2]
    raise ValueError(f"layout must be 'concatenated' or 'interleaved', got {layout!r}")


def merge_gate_up(gate, up, layout="concatenated"):
    """The inverse of ``split_gate_up``: the (n, 2I) array whose halves are gate and up."""
    gate, up = np.asarray(gate, dtype=np.float64), np.asarray(up, dtype=np.float64)
    if layout == "concatenated":
        return np.concatenate([gate, up], axis=-1)
    if layout == "interleaved":
        out = np.empty(gate.shape[:-1] + (2 * gate.shape[-1],))
        out[..., 0::2], out[..., 1::2] = gate, up
        return out
    raise ValueError(f"layout must be 'concatenated' or 'interleaved', got {layout!r}")


def swiglu_gate(layout="concatenated"):
    r"""SwiGLU, transformers' default ``_apply_gate``: a2 = SiLU(gate) * up, with

        dL/dgate = dL/da2 * up * SiLU'(gate),    dL/dup = dL/da2 * SiLU(gate).
    """
    def forward(h):
        gate, up = split_gate_up(h, layout)
        return silu(gate) * up

    def vjp(h, g):
        gate, up = split_gate_up(h, layout)
        return merge_gate_up(g * up * silu_grad(gate), g * silu(gate), layout)

    return Gate(forward, vjp, f"silu_{layout}")


def clamped_swiglu_gate(alpha, limit, layout="interleaved"):
    r"""GPT-OSS's ``_apply_gate`` (``layout`` "interleaved"; "concatenated" is
    openai_privacy_filter's and MiniMax-M3's):

        gate_c = min(gate, limit),  up_c = clip(up, -limit, limit),
        glu = gate_c sigmoid(alpha gate_c),  a2 = (up_c + 1) glu

    with torch's clamp gradient (passed where min <= x <= max, boundary included):

        dL/dgate = dL/da2 (up_c + 1) (s + alpha gate_c s (1 - s)) [gate <= limit],
        dL/dup   = dL/da2 glu [-limit <= up <= limit],   s = sigmoid(alpha gate_c).
    """
    def forward(h):
        gate, up = split_gate_up(h, layout)
        gate_c, up_c = np.minimum(gate, limit), np.clip(up, -limit, limit)
        return (up_c + 1.0) * gate_c * sigmoid(alpha * gate_c)

    def vjp(h, g):
        gate, up = split_gate_up(h, layout)
        gate_c, up_c = np.minimum(gate, limit), np.clip(up, -limit, limit)
        s = sigmoid(alpha * gate_c)
        d_gate = g * (up_c + 1.0) * (s + alpha * gate_c * s * (1.0 - s)) * (gate <= limit)
        d_up = g * gate_c * s * ((up >= -limit) & (up <= limit))
        return merge_gate_up(d_gate, d_up, layout)

    return Gate(forward, vjp, f"clamped_swiglu_{layout}")


def elementwise_activation(fn, grad, name="custom"):
    """An activation for experts without a gate (``has_gate=False``): a2 = fn(h),
    dL/dh = dL/da2 * grad(h)."""
    return Gate(fn, lambda h, g: g * grad(h), name)


def rms_norm(weight, eps):
    r"""RMSNorm of each row as a Gate (the optional post-expert norm):

        r = (mean_j y_j^2 + eps)^{-1/2},   z = weight * y r,
        dL/dy = r (u - (y r) mean_j(u_j y_j r)),   u = weight * dL/dz.
    """
    weight = np.asarray(weight, dtype=np.float64)

    def forward(y):
        r = 1.0 / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + eps)
        return weight * y * r

    def vjp(y, g):
        r = 1.0 / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + eps)
        y_hat, u = y * r, weight * g
        return r * (u - y_hat * np.mean(u * y_hat, axis=-1, keepdims=True))

    return Gate(forward, vjp, "rms_norm")


GATES = {"silu_concatenated": swiglu_gate("concatenated"),
         "silu_interleaved": swiglu_gate("interleaved")}
ACTIVATIONS = {
    "silu": elementwise_activation(silu, silu_grad, "silu"),
    # NemotronH's experts (has_gate=False): relu(h)^2
    "relu2": elementwise_activation(lambda h: np.maximum(h, 0.0) ** 2,
                                    lambda h: 2.0 * np.maximum(h, 0.0), "relu2"),
}


def _resolve(gate, has_gate):
    if isinstance(gate, str):
        table = GATES if has_gate else ACTIVATIONS
        if gate not in table:
            raise ValueError(f"unknown {'gate' if has_gate else 'activation'} {gate!r}; "
                             f"one of {sorted(table)} or a Gate(forward, vjp)")
        return table[gate]
    if isinstance(gate, tuple) and len(gate) == 2:
        return Gate(*gate)
    if callable(gate) and callable(getattr(gate, "vjp", None)):
        return gate
    raise TypeError("gate must be a name, a Gate, a (forward, vjp) pair or a callable with a "
                    ".vjp(h, g) method: the rows of the up projection need its VJP")


# ------------------------------------------------------------------------ routing and rows

def routed_pairs(top_k_index, num_experts):
    r"""Per expert e, the pairs routed to it in the eager loop's order (K3's rows).

    The eager loop takes ``top_k_pos, token_idx = torch.where(expert_mask[e])`` with
    ``expert_mask[e]`` = (top_k_index == e) laid out (k, T): row-major over (slot, token), so
    all slot-0 tokens in ascending order come first, then slot-1's, and so on. Ids outside
    [0, num_experts) (expert parallelism's sentinel) belong to no expert.

    Returns:
        A list of E pairs (tokens, slots) of int arrays of equal length n_e.
    """
    index = np.asarray(top_k_index)
    if index.ndim != 2:
        raise ValueError(f"top_k_index must be (T, k), got shape {index.shape}")
    pairs = []
    for e in range(num_experts):
        slots, tokens = np.nonzero(index.T == e)
        pairs.append((tokens, slots))
    return pairs


def linear_layout(W, transposed):
    """One expert's matrix in nn.Linear's (d_out, d_in) layout (stored (d_in, d_out) when
    ``transposed``)."""
    W = np.asarray(W, dtype=np.float64)
    return W.T if transposed else W


def _bias(b, e):
    return 0.0 if b is None else np.asarray(b[e], dtype=np.float64)


def expert_rows(hidden, top_k_index, top_k_weights, grad_out, W_gu, W_d, b_gu=None, b_d=None,
                gate="silu_concatenated", has_gate=True, transposed=False, token_mask=None,
                post_norm=None):
    r"""Each expert's input and output-gradient rows of both projections (module docstring).

    For the n_e pairs (t_i, j_i) routed to expert e (``routed_pairs`` order), with
    w_i = top_k_weights[t_i, j_i] and G = grad_out = dL/dout (T, H):

        a_gu_i = x_i = hidden[t_i],             h_i = W_gu[e] x_i (+ b_gu[e])
        a_d_i  = a2_i = gate(h_i),              y_i = W_d[e] a2_i (+ b_d[e])
        g_d_i  = dL/dy_i = post_norm.vjp(y_i, w_i G[t_i])   (w_i G[t_i] without a norm)
        g_gu_i = dL/dh_i = gate.vjp(h_i, W_d[e]^T g_d_i)

    Pairs whose token is masked out (``token_mask[t]`` False) are dropped, as if never routed.

    Args:
        hidden: (T, H) the experts module's input; grad_out: (T, H) the gradient of the loss
            with respect to its output.
        top_k_index, top_k_weights: (T, k) the router's choices and weights.
        W_gu, W_d: (E, d_out, d_in) stacks ((E, d_in, d_out) with ``transposed``); W_gu is
            ``gate_up_proj`` with a gate, ``up_proj`` without.
        b_gu, b_d: (E, d_out) biases or None.
        gate: a name of ``GATES`` (with a gate) or ``ACTIVATIONS`` (without), a ``Gate``, a
            (forward, vjp) pair, or a callable with ``.vjp``.
        has_gate: whether h is [gate, up] (``gate`` maps 2I -> I) or not (an activation).
        transposed: the ``is_transposed`` layout.
        token_mask: (T,) or any shape with T entries (e.g. (B, S)); True = a real token.
        post_norm: None or a Gate applied to y before the routing weight (``rms_norm``).

    Returns:
        A list over experts of dicts with ``tokens``, ``slots`` (n_e,) and the rows
        ``a_gu`` (n_e, d_in_gu), ``g_gu`` (n_e, d_out_gu), ``a_d`` (n_e, I), ``g_d`` (n_e, H);
        (0, d) arrays for an expert with no pairs.
    """
    hidden = np.asarray(hidden, dtype=np.float64)
    grad_out = np.asarray(grad_out, dtype=np.float64)
    weights = np.asarray(top_k_weights, dtype=np.float64)
    gate = _resolve(gate, has_gate)
    num_experts = np.shape(W_gu)[0]
    keep = None if token_mask is None else np.asarray(token_mask, dtype=bool).reshape(-1)
    if keep is not None and keep.shape[0] != hidden.shape[0]:
        raise ValueError(f"token_mask has {keep.shape[0]} entries for {hidden.shape[0]} tokens")
    rows = []
    for e, (tokens, slots) in enumerate(routed_pairs(top_k_index, num_experts)):
        if keep is not None:
            tokens, slots = tokens[keep[tokens]], slots[keep[tokens]]
        W1, W2 = linear_layout(W_gu[e], transposed), linear_layout(W_d[e], transposed)
        x = hidden[tokens]
        h = x @ W1.T + _bias(b_gu, e)
        a2 = gate(h)
        g_z = weights[tokens, slots][:, None] * grad_out[tokens]
        if post_norm is None:
            g_y = g_z
        else:
            g_y = post_norm.vjp(a2 @ W2.T + _bias(b_d, e), g_z)
        g_h = gate.vjp(h, g_y @ W2)
        rows.append({"tokens": tokens, "slots": slots, "a_gu": x, "g_gu": g_h, "a_d": a2,
                     "g_d": g_y})
    return rows


def projection_rows(rows, projection):
    """[(a, g)] per expert of one projection ("up" or "down") of ``expert_rows``' output."""
    if projection not in PROJECTIONS:
        raise ValueError(f"projection must be one of {sorted(PROJECTIONS)}, got {projection!r}")
    a_key, g_key = PROJECTIONS[projection]
    return [(r[a_key], r[g_key]) for r in rows]


def expert_pairs(rows, projection):
    """(a, g) per expert from (a, g) pairs or from ``expert_rows`` dicts (with a projection):
    the form every per-expert equation (MKOR's, K-FAC's) takes its rows in."""
    if rows and isinstance(rows[0], dict):
        if projection is None:
            raise ValueError("rows are expert_rows dicts: name the projection ('up' or 'down')")
        return projection_rows(rows, projection)
    return [(np.asarray(a, dtype=np.float64), np.asarray(g, dtype=np.float64)) for a, g in rows]


def expert_weight_grads(rows, has_bias=False, transposed=False, projection=None):
    r"""The gradient of each expert's matrix from its rows (nn.Linear's backward):

        grad_W[e] = sum_i g_i a_i^T  (d_out x d_in; its transpose with ``transposed``),
        grad_b[e] = sum_i g_i

    zeros for an expert with no rows (the fused parameter's gradient slice). Returns
    (grad_W stack, grad_b stack or None).
    """
    pairs = expert_pairs(rows, projection)
    grad_W = np.stack([(g.T @ a).T if transposed else g.T @ a for a, g in pairs])
    grad_b = np.stack([g.sum(axis=0) for _, g in pairs]) if has_bias else None
    return grad_W, grad_b
