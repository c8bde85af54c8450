"""The two terms by which HeavyBall's AdamW (``mars=True``) may differ from our mapped MARS beyond
the rounding both share (``_lockstep.rounding_bound``), each derived here and computed per
step and per tensor from the lockstep history (``theory_tests/peers/test_heavyball.py``).

Notation: s = √v̂ (the peer's stored second moment is already debiased), η_t the step's lr,
|d_t| = |p_{t+1} - p_t| + η_t λ |p_t| ≥ η_t |u_t| per element (the peer's update before its
decay), u_r the unit rounding of the peer's scalars (2^-24 for float32 and 16-bit parameters,
2^-53 for float64).

1. eps (``eps_form_bound``).  The peer divides m̂ by max(s, ε), ours by s + ε; neither enters
   the state, and both see the same gradients, so per element
   |u_peer - u_ours| = |u_peer| · min(s, ε) / (s + ε),
   and the iterate moves apart by at most max_i |d_i| min(s_i, ε)/(s_i + ε) per step.

2. The peer's float-typed EMA weights (``ema_weight_bound``).  It forms m̂ = lerp(m̂, c, w_t)
   with w_t = 1 - β̂_t = (1 - β)/(1 - βᵗ) evaluated in its scalar dtype: β itself rounded to
   that dtype (|Δ ln w| ≤ u_r β/(1 - β): the β-derivative of ln w is -1/(1 - β) +
   tβ^(t-1)/(1 - βᵗ), whose two terms have opposite signs and the second is the smaller),
   then log1p, a product, expm1, a division, 1 - (·) and 1 - β̂ (at most 8 u_r more, and
   u_r/w for β̂ = 1 - w rounded at magnitude 1).  So w_t carries a relative error
   δ_t ≤ u_r (8 + 1/w_t + β/(1 - β)·[β rounded]).  Ours uses 1 - β and βᵗ in float64.
   m̂_t = Σ_s W_s c_s with the convex weights W_s = w_s Π_{r>s} (1 - w_r); a relative error
   δ_r of w_r moves w_r by δ_r and (1 - w_r) by δ_r w_r/(1 - w_r), so every W_s moves by a
   relative amount at most D_t = Σ_{r≤t} δ_r ρ_r, with ρ_1 = 1 (1 - w_1 multiplies the zero
   state) and ρ_r = max(1, w_r/(1 - w_r)).  Hence |Δm̂| ≤ D¹_t Σ W¹_s |c_s|, and by
   Cauchy-Schwarz Σ W¹_s |c_s| ≤ κ_t √(Σ W²_s c_s²) = κ_t s with κ_t² = Σ_s (W¹_s)²/W²_s:
   |Δm̂|/s ≤ κ_t D¹_t.  v̂ is a sum of positive terms: |Δv̂| ≤ D²_t v̂, so 1/s moves by at
   most D²_t/2 (first order) relatively.  Per step the iterate moves apart by at most
   η_t κ_t D¹_t + (D²_t/2) max|d_t|.
"""
import math

__all__ = ["eps_form_bound", "ema_weight_bound"]


def eps_form_bound(history, eps, decay):
    """Per step, per tensor: term 1 of the module docstring, summed over the steps."""
    total, out = {}, []
    for step in history:
        for r in step:
            s = r["v"].double().clamp_min(0).sqrt()
            d = ((r["peer"] - r["before"]).abs() + r["lr"] * decay * r["before"].abs()).double()
            shift = (d * (s.clamp(max=eps) / (s + eps))).max().item() if eps > 0 else 0.0
            total[r["name"]] = total.get(r["name"], 0.0) + shift
        out.append(dict(total))
    return out


def _weights(beta, t):
    """The debiased EMA's convex weights W_s (s = 1..t) at step t."""
    return [(1.0 - beta) * beta ** (t - s) / (1.0 - beta ** t) for s in range(1, t + 1)]


def _drift(beta, t, ur, beta_rounded):
    """D_t: the largest relative move of any weight W_s from the peer's weight arithmetic."""
    total = 0.0
    for r in range(1, t + 1):
        w = (1.0 - beta) / (1.0 - beta ** r)
        delta = ur * (8.0 + 1.0 / w + (beta / (1.0 - beta) if beta_rounded else 0.0))
        total += delta * (1.0 if r == 1 or w >= 1.0 else max(1.0, w / (1.0 - w)))
    return total


def ema_weight_bound(history, betas, decay, ur, beta_rounded):
    """Per step, per tensor: term 2 of the module docstring, summed over the steps.
    ``ur``: the peer's scalar unit rounding; ``beta_rounded``: whether its β is not the
    float64 value ours uses (a float32 scalar)."""
    beta1, beta2 = betas
    total, out = {}, []
    for t, step in enumerate(history, start=1):
        w1, w2 = _weights(beta1, t), _weights(beta2, t)
        kappa = math.sqrt(sum(a * a / b for a, b in zip(w1, w2)))
        d1, d2 = _drift(beta1, t, ur, beta_rounded), _drift(beta2, t, ur, beta_rounded)
        for r in step:
            d = ((r["peer"] - r["before"]).abs() + r["lr"] * decay * r["before"].abs()).max()
            shift = r["lr"] * kappa * d1 + 0.5 * d2 * d.item()
            total[r["name"]] = total.get(r["name"], 0.0) + shift
        out.append(dict(total))
    return out
