"""First-order baselines in NumPy float64, written as ``torch.optim`` computes them.

Each function takes the parameter ``p``, its gradient ``g`` and a state dict (created
empty by the caller), updates the state in place and returns the new parameter.
The step counter ``k`` lives in the state and starts at 1 on the first call.

These are the oracles for reduction tests (MARS with gamma = 0 is AdamW; MARS-approx with
beta = beta2 and gamma = 1 - beta1/beta2 is Lion) and the backbones under MKOR.
"""
import numpy as np


def _count(state):
    state["k"] = state.get("k", 0) + 1
    return state["k"]


def adamw(p, g, state, *, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
    r"""AdamW (Loshchilov & Hutter) with torch's epsilon placement.

    m_k = b1 m + (1-b1) g,  v_k = b2 v + (1-b2) g^2,
    p  <- p (1 - lr wd) - lr (m_k / bc1) / (sqrt(v_k) / sqrt(bc2) + eps).
    """
    k = _count(state)
    b1, b2 = betas
    m = state["m"] = b1 * state.get("m", np.zeros_like(p)) + (1 - b1) * g
    v = state["v"] = b2 * state.get("v", np.zeros_like(p)) + (1 - b2) * g * g
    bc1, bc2 = 1 - b1**k, 1 - b2**k
    p = p * (1 - lr * weight_decay)
    return p - lr * (m / bc1) / (np.sqrt(v) / np.sqrt(bc2) + eps)


def lion(p, g, state, *, lr, betas=(0.9, 0.99), weight_decay=0.0):
    r"""Lion (Chen et al. 2023).

    u = sign(b1 m + (1-b1) g),  p <- p (1 - lr wd) - lr u,  m <- b2 m + (1-b2) g.
    """
    _count(state)
    b1, b2 = betas
    m = state.get("m", np.zeros_like(p))
    u = np.sign(b1 * m + (1 - b1) * g)
    state["m"] = b2 * m + (1 - b2) * g
    return p * (1 - lr * weight_decay) - lr * u


def sgd(p, g, state, *, lr, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0):
    r"""SGD with heavy-ball or Nesterov momentum, exactly as ``torch.optim.SGD``.

    g <- g + wd p;  buf_1 = g,  buf_k = mu buf + (1 - dampening) g;
    d = g + mu buf (Nesterov) or buf;  p <- p - lr d.
    """
    k = _count(state)
    g = g + weight_decay * p
    if momentum != 0.0:
        buf = g.copy() if k == 1 else momentum * state["buf"] + (1 - dampening) * g
        state["buf"] = buf
        g = g + momentum * buf if nesterov else buf
    return p - lr * g


def lamb(p, g, state, *, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
    r"""LAMB (You et al. 2020) with bias correction and the identity trust function.

    r = m_hat / (sqrt(v_hat) + eps) + wd p,
    trust = ||p|| / ||r|| (1 when either norm is 0),  p <- p - lr trust r.
    """
    k = _count(state)
    b1, b2 = betas
    m = state["m"] = b1 * state.get("m", np.zeros_like(p)) + (1 - b1) * g
    v = state["v"] = b2 * state.get("v", np.zeros_like(p)) + (1 - b2) * g * g
    r = (m / (1 - b1**k)) / (np.sqrt(v / (1 - b2**k)) + eps) + weight_decay * p
    p_norm, r_norm = np.linalg.norm(p), np.linalg.norm(r)
    trust = p_norm / r_norm if p_norm > 0 and r_norm > 0 else 1.0
    return p - lr * trust * r


def muon(p, g, state, *, lr, momentum=0.95, nesterov=True, ns_steps=5, eps=1e-7,
         weight_decay=0.0):
    r"""Muon (Jordan 2024) as ``torch.optim.Muon`` writes it, on a 2-D parameter.

    buf <- beta buf + (1-beta) g;  d = (1-beta) g + beta buf (Nesterov) or buf;
    p <- p (1 - lr wd) - lr s NS(d),  s = sqrt(max(1, A/B)).
    """
    from ..common.matrix_functions import newton_schulz  # local: first_order stays matrix-free

    _count(state)
    buf = state["buf"] = momentum * state.get("buf", np.zeros_like(p)) + (1 - momentum) * g
    d = (1 - momentum) * g + momentum * buf if nesterov else buf
    scale = max(1.0, p.shape[0] / p.shape[1]) ** 0.5
    return p * (1 - lr * weight_decay) - lr * scale * newton_schulz(d, steps=ns_steps, eps=eps)
