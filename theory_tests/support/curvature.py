r"""Exact per-layer curvature blocks by brute force, float64 (issue 46 item 1, KC1, KC9).

The truth the Kronecker flavours are tested against, so it imports no Kronecker code: explicit
Jacobians of the network output with respect to ONE layer's parameters (``torch.func.jacrev``
through ``functional_call``), the loss's output Hessian in closed form, and sums over the data
points. For ``L = loss_func(model(inputs), targets) = R Σ_n ℓ_n`` (KC1):

    GGN    = R Σ_n J_nᵀ H_n J_n
    EF     = R Σ_n ∇ℓ_n ∇ℓ_nᵀ                       (∇ℓ_n = J_nᵀ ∇_f ℓ_n, the data's own targets)
    Fisher = R Σ_n E_{ỹ~p(·|f_n)} ∇ℓ_n(ỹ) ∇ℓ_n(ỹ)ᵀ   (the expectation in closed form)

with respect to the layer's parameter vector θ = [W | b].reshape(-1) of the (d_out, d_in + 1)
matrix (a Conv2d's weight as (C_out, C_in·kh·kw)); ``part="weight"`` or ``"bias"`` gives the block
of W.reshape(-1) or b alone ("bias separate"). Data points and R follow
``/work/tools/issue46_conventions.md``:

* CrossEntropyLoss, output (N, C, d1, ...): every (n, d1, ...) is a data point, ℓ = −log p_y,
  R = 1/#points (mean) or 1 (sum);
* MSELoss, output (..., C): every leading position is a data point, ℓ = Σ_c (f_c − y_c)²,
  R = 1/numel(output) (mean: torch divides by every element) or 1 (sum).
"""
import torch
from torch import nn
from torch.func import functional_call, jacrev

__all__ = [
    "loss_kind", "reduction_factor", "output_points", "points_to_output", "target_points",
    "loss_hessians", "loss_gradients", "fisher_output_matrices", "layer_shape",
    "layer_jacobian", "ggn_block", "ef_block", "fisher_block", "column_major",
    "kronecker_rearrange", "best_kronecker",
]

PARTS = ("joint", "weight", "bias")


# ---------------------------------------------------------------- the loss and its data points

def loss_kind(loss_func):
    """"ce" or "mse"; anything this truth cannot compute exactly is refused by name."""
    if isinstance(loss_func, nn.CrossEntropyLoss):
        if loss_func.weight is not None:
            raise ValueError("CrossEntropyLoss(weight=...) is not supported: class weights")
        if loss_func.label_smoothing != 0.0:
            raise ValueError("CrossEntropyLoss(label_smoothing=...) is not supported")
        kind = "ce"
    elif isinstance(loss_func, nn.MSELoss):
        kind = "mse"
    else:
        raise ValueError(f"loss_func must be nn.MSELoss or nn.CrossEntropyLoss, "
                         f"got {type(loss_func).__name__}")
    if loss_func.reduction not in ("mean", "sum"):
        raise ValueError(f"loss_func.reduction must be 'mean' or 'sum', got "
                         f"{loss_func.reduction!r}")
    return kind


def output_points(loss_func, output):
    """The output as (P, C) data points: CE moves its class dim 1 last, MSE keeps its last."""
    if loss_kind(loss_func) == "ce":
        if output.dim() < 2:
            raise ValueError(f"CrossEntropyLoss output must be (N, C, ...), got {tuple(output.shape)}")
        return output.movedim(1, -1).reshape(-1, output.shape[1])
    return output.reshape(-1, output.shape[-1])


def points_to_output(points, output_shape, loss_func):
    """Inverse of :func:`output_points`: (..., P, C) columns back to (..., *output_shape)."""
    lead = points.shape[:-2]
    if loss_kind(loss_func) == "ce":
        moved = (output_shape[0], *output_shape[2:], output_shape[1])
        return points.reshape(*lead, *moved).movedim(-1, len(lead) + 1)
    return points.reshape(*lead, *output_shape)


def target_points(loss_func, targets, output):
    """Targets per data point: CE labels (P,), MSE values (P, C)."""
    if loss_kind(loss_func) == "ce":
        if targets.dtype.is_floating_point:
            raise ValueError("CrossEntropyLoss targets must be class indices (probabilities "
                             "are not supported)")
        labels = targets.reshape(-1)
        if (labels == loss_func.ignore_index).any():
            raise ValueError(f"targets hold ignore_index={loss_func.ignore_index}: ignored "
                             "positions are not supported")
        return labels
    if targets.shape != output.shape:
        raise ValueError(f"MSELoss targets {tuple(targets.shape)} != output {tuple(output.shape)}")
    return targets.reshape(-1, output.shape[-1])


def reduction_factor(loss_func, output):
    """R of KC1: L = R Σ_n ℓ_n."""
    kind = loss_kind(loss_func)
    if loss_func.reduction == "sum":
        return 1.0
    return 1.0 / (output_points(loss_func, output).shape[0] if kind == "ce" else output.numel())


def _summed_loss(kind, points, targets):
    """Σ_n ℓ_n by torch's own loss (reduction "sum"): CE −log p_y, MSE Σ_c (f_c − y_c)²."""
    if kind == "ce":
        return nn.functional.cross_entropy(points, targets, reduction="sum")
    return nn.functional.mse_loss(points, targets, reduction="sum")


def loss_hessians(loss_func, points):
    """H_n = ∇²_f ℓ_n in closed form, (P, C, C): CE diag(p) − p pᵀ, MSE 2 I (KC2)."""
    if loss_kind(loss_func) == "ce":
        p = torch.softmax(points, dim=-1)
        return torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    eye = torch.eye(points.shape[-1], dtype=points.dtype)
    return 2.0 * eye.expand(points.shape[0], -1, -1).clone()


def loss_gradients(loss_func, points, targets):
    """∇_f ℓ_n for the given targets, (P, C): the gradient of Σ_n ℓ_n w.r.t. the points, as
    ℓ_n depends on f_n alone."""
    kind = loss_kind(loss_func)
    f = points.detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(_summed_loss(kind, f, targets), f)
    return grad


def fisher_output_matrices(loss_func, points):
    """E_{ỹ~p(·|f_n)} ∇_f ℓ_n(ỹ) ∇_f ℓ_n(ỹ)ᵀ, (P, C, C), computed without H's formula.

    CE: the expectation is a finite sum over the C classes, Σ_c p_c ∇ℓ(c) ∇ℓ(c)ᵀ, each
    gradient by autograd. MSE: ỹ ~ N(f, I/2) (the Gaussian whose NLL is ℓ up to constants)
    and ∇_f ℓ(ỹ) is affine in ỹ, so E[∇ℓ ∇ℓᵀ] = ∇ℓ(f) ∇ℓ(f)ᵀ + D Cov(ỹ) Dᵀ with
    D = ∂∇_f ℓ/∂ỹ by autograd (per point: ℓ_n depends on ỹ_n alone).
    """
    kind = loss_kind(loss_func)
    points = points.detach()
    P, C = points.shape
    if kind == "ce":
        p = torch.softmax(points, dim=-1)
        out = torch.zeros(P, C, C, dtype=points.dtype)
        for c in range(C):
            g = loss_gradients(loss_func, points, torch.full((P,), c, dtype=torch.long))
            out += p[:, c, None, None] * g[:, :, None] * g[:, None, :]
        return out
    at_mean = loss_gradients(loss_func, points, points)
    D = torch.autograd.functional.jacobian(
        lambda y: _loss_gradients_graph(kind, points, y), points)  # (P, C, P, C)
    D = torch.einsum("pcpd->pcd", D)
    cov = 0.5 * torch.eye(C, dtype=points.dtype)
    return at_mean[:, :, None] * at_mean[:, None, :] + D @ cov @ D.transpose(1, 2)


def _loss_gradients_graph(kind, points, targets):
    """∇_f Σ_n ℓ_n kept differentiable in the targets (for the MSE Fisher's D)."""
    f = points.detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(_summed_loss(kind, f, targets), f, create_graph=True)
    return grad


# ---------------------------------------------------------------- the layer's Jacobian

def _name_of(model, layer):
    for name, module in model.named_modules():
        if module is layer:
            return name
    raise ValueError("layer is not a module of model")


def layer_shape(layer, expert=None):
    """(d_out, d_in, has_bias) of the block's (d_out, d_in + has_bias) parameter matrix."""
    weight = layer.weight if expert is None else layer.weight[expert]
    return weight.shape[0], weight[0].numel(), getattr(layer, "bias", None) is not None


def _param_matrix_jacobian(jac_w, jac_b, expert):
    """(P, C, d_out, d_in') from the Jacobians w.r.t. the whole weight and bias."""
    lead = jac_w.shape[:2]
    if expert is not None:
        jac_w = jac_w[:, :, expert]
        jac_b = None if jac_b is None else jac_b[:, :, expert]
    d_out = jac_w.shape[2]
    cols = [jac_w.reshape(*lead, d_out, -1)]
    if jac_b is not None:
        cols.append(jac_b.reshape(*lead, d_out, 1))  # the bias: a last input column of 1s
    return torch.cat(cols, dim=-1)


def layer_jacobian(model, loss_func, inputs, layer, *, part="joint", expert=None):
    """J: (P, C, D), the Jacobian of the output data points w.r.t. the block's parameters.

    ``part``: "joint" = [W | b].reshape(-1); "weight" = W.reshape(-1); "bias" = b.
    ``expert``: for a fused-expert layer (weight (E, d_out, d_in)), expert e's slice.
    """
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    name = _name_of(model, layer)
    prefix = f"{name}." if name else ""
    has_bias = getattr(layer, "bias", None) is not None
    if part == "bias" and not has_bias:
        raise ValueError("part='bias' but the layer has no bias")
    weight = layer.weight.detach()
    bias = layer.bias.detach() if has_bias else None
    fused = weight.dim() == 3 and not isinstance(layer, nn.Conv1d)
    if fused != (expert is not None):
        raise ValueError("expert= is for a fused-expert layer (weight (E, d_out, d_in)) and it "
                         f"needs one; got expert={expert!r} for a weight of shape "
                         f"{tuple(weight.shape)}")
    if fused and not 0 <= expert < weight.shape[0]:
        raise ValueError(f"expert={expert} is not one of the layer's {weight.shape[0]} experts")

    def out(w, b):
        params = {prefix + "weight": w}
        if b is not None:
            params[prefix + "bias"] = b
        return output_points(loss_func, functional_call(model, params, (inputs,)))

    jac_w, jac_b = jacrev(out, argnums=(0, 1))(weight, bias) if has_bias else (
        jacrev(out)(weight, None), None)
    J = _param_matrix_jacobian(jac_w, jac_b, expert)
    P, C, d_out, width = J.shape
    if part == "weight":
        J = J[..., :width - has_bias]
    elif part == "bias":
        J = J[..., width - 1:]
    return J.reshape(P, C, -1).detach()  # other layers' parameters require grad


def _model_points(model, loss_func, inputs, targets):
    with torch.no_grad():
        output = model(inputs)
    return (output_points(loss_func, output), target_points(loss_func, targets, output),
            reduction_factor(loss_func, output))


def _sandwich(J, M, R):
    """R Σ_n J_nᵀ M_n J_n."""
    return R * torch.einsum("pci,pcd,pdj->ij", J, M, J)


def ggn_block(model, loss_func, inputs, targets, layer, *, part="joint", expert=None):
    """GGN = R Σ_n J_nᵀ H_n J_n (KC1)."""
    points, _, R = _model_points(model, loss_func, inputs, targets)
    J = layer_jacobian(model, loss_func, inputs, layer, part=part, expert=expert)
    return _sandwich(J, loss_hessians(loss_func, points), R)


def ef_block(model, loss_func, inputs, targets, layer, *, part="joint", expert=None):
    """EF = R Σ_n ∇ℓ_n ∇ℓ_nᵀ with ∇ℓ_n = J_nᵀ ∇_f ℓ_n(y_n) (KC1)."""
    points, labels, R = _model_points(model, loss_func, inputs, targets)
    J = layer_jacobian(model, loss_func, inputs, layer, part=part, expert=expert)
    per_point = torch.einsum("pci,pc->pi", J, loss_gradients(loss_func, points, labels))
    return R * per_point.T @ per_point


def fisher_block(model, loss_func, inputs, targets, layer, *, part="joint", expert=None):
    """Fisher = R Σ_n J_nᵀ E_ỹ[∇_f ℓ_n(ỹ) ∇_f ℓ_n(ỹ)ᵀ] J_n (KC1), the targets unused."""
    points, _, R = _model_points(model, loss_func, inputs, targets)
    J = layer_jacobian(model, loss_func, inputs, layer, part=part, expert=expert)
    return _sandwich(J, fisher_output_matrices(loss_func, points), R)


# ---------------------------------------------------------------- flattenings and KC9

def column_major(block, d_out, width):
    """The block re-indexed for θ = vec(M) column-major (M the (d_out, width) matrix), where
    row-major's kron(G, A) becomes kron(A, G)."""
    perm = torch.arange(d_out * width).reshape(d_out, width).T.reshape(-1)
    return block[perm][:, perm]


def kronecker_rearrange(block, d_out, width):
    """Van Loan–Pitsianis: the (d_out², width²) matrix 𝓡 with 𝓡(G ⊗ A) = vec(G) vec(A)ᵀ."""
    if block.shape != (d_out * width, d_out * width):
        raise ValueError(f"block {tuple(block.shape)} is not ({d_out}·{width})²")
    blocks = block.reshape(d_out, width, d_out, width)  # [i, k, j, l] = G_ij A_kl
    return blocks.permute(0, 2, 1, 3).reshape(d_out * d_out, width * width)


def best_kronecker(block, d_out, width):
    """KC9: (G, A) minimising ‖block − G ⊗ A‖_F, from the top singular pair of 𝓡(block);
    signs chosen so that tr A ≥ 0 (the product does not depend on them)."""
    U, s, Vh = torch.linalg.svd(kronecker_rearrange(block, d_out, width))
    G = s[0] * U[:, 0].reshape(d_out, d_out)
    A = Vh[0].reshape(width, width)
    sign = 1.0 if torch.trace(A) >= 0 else -1.0
    return sign * G, sign * A
