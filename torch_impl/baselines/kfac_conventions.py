r"""kfac-pytorch (KAISA) hyperparameters for this project's :class:`~.kfac.KFAC` (spec K19).

gpauloski/kfac-pytorch (``kfac.preconditioner.KFACPreconditioner``, checked at version 0.4.1)
and :class:`~.kfac.KFAC` apply the same algorithm -- Kronecker factors A and G kept as
EMAs, an eigen (or inverse) form with the damping in the same place, the same KL clip --
but scale the factors differently, so a damping or KL-clip value copied from one means
something else in the other. For one layer whose forward saw R rows (B samples):

* A (Linear, R rows): ours (1/R) sum_i a_i a_i^T; theirs the same.
* G (Linear): ours R sum_i g_i g_i^T (N = R samples); theirs (1/R) sum_i g_i g_i^T.
* A (Conv2d, B samples x L positions of unfolded patches a): ours (1/(BL)) sum a a^T;
  theirs the same of a / L.
* G (Conv2d): ours B sum_{b,l} g g^T (N = B samples); theirs (1/(BL)) sum (g/L)(g/L)^T.
* EMA F <- beta F + (1 - beta) F_new in both (factor_decay beta weights the *old* factor);
  ours starts from the first batch (``factor_init="batch"``), theirs from F = I.
* factor_decay: ours [0, 1) ([0, 1] with ``factor_init="identity"``); theirs (0, 1].

with g_i the output gradients of the *mean* loss and L the output positions of a
convolution. Per layer, ours = c_F x theirs for each factor F:

* Linear (inputs of any leading shape, R rows): c_A = 1, c_G = R^2;
* Conv2d (B samples, L = H_out W_out positions): c_A = L^2, c_G = B^2 L^3;

and c = c_A c_G. With the EMA started at c_A I and c_G I (``factor_init="identity"``,
``factor_init_scale=(c_A, c_G)``) every later factor keeps the ratio, so in the eigen form

.. math::
    V_{ours} = (c\, G_{kp} \otimes A_{kp} + \delta I)^{-1} \hat G
             = \tfrac1c (G_{kp} \otimes A_{kp} + \tfrac{\delta}{c} I)^{-1} \hat G
             = V_{kp} / c \quad\text{when}\quad \delta = c\,\delta_{kp},

and in the inverse form (G + delta I)^{-1} Ghat (A + delta I)^{-1} = V_kp / c needs
delta / c_G = delta / c_A = delta_kp: only layers with c_A = c_G (one row per batch) map.
The KL clip nu = min(1, sqrt(kappa / |sum_m lr^2 <V_m, Ghat_m>|)) sees
sum <V_m, Ghat_m> / c here, so it agrees when kappa / (lr_0^2 / c) = kappa_kp / lr_kp^2
(lr_0: our first param group's lr, which the clip reads; lr_kp: kfac-pytorch's own
``lr`` argument), i.e. kappa = kappa_kp lr_0^2 / (c lr_kp^2). What is left is the 1/c in
the gradient the backbone receives:

* an optimizer linear in the gradient (``torch.optim.SGD``, momentum and Nesterov
  included): lr x c and weight_decay / c on the preconditioned parameters' groups. Then
  lr_kp = lr / c, delta_kp = delta / c, kappa_kp = kappa / c (the spec's relation);
* one invariant to the gradient's scale up to its eps (``Adam``, ``AdamW``): the same lr,
  eps / c, and a coupled weight decay (``Adam``'s) / c on those groups;
  kappa = kappa_kp / c when lr_0 = lr_kp.

Parameters outside the preconditioned layers get their gradient unchanged in both, so
their groups keep their settings; a group that mixes the two cannot be converted. One
damping and one KL clip serve all layers, so every preconditioned layer must share the
same (c_A, c_G) -- the same R for Linear layers, the same B and L for convolutions, and no
mix of the two unless L = 1 -- else :func:`from_kfac_pytorch` raises a ValueError listing
each layer's constants. (A per-layer damping would lift this; :class:`~.kfac.KFAC` has
one.) The constants depend on the batch: a batch of another size needs a new conversion,
and gradient accumulation (kfac-pytorch averages the micro-batch factors) is not covered.

What cannot be matched: kfac-pytorch runs ``eigh``/``inv`` in float32 whatever its
``factor_dtype``/``inv_dtype`` say (``layers/eigen.py``, ``layers/inverse.py``), so float64
runs agree to float32 rounding only; it ignores a convolution's dilation and string
padding (refused here) and token masks (``token_mask=None`` is returned).
"""
import dataclasses
import math

import torch
import torch.nn as nn

from ..kronecker.discovery import DEFAULT_MAX_FACTOR_DIM, discover, unwrap_model
from ..common.validation import check_choice, check_number

__all__ = ["KFACPytorchConversion", "from_kfac_pytorch", "kfac_pytorch_scales"]


def _layer_scales(module, shape):
    """(c_A, c_G): our factor over kfac-pytorch's, for one layer, from the shape of its
    input (Linear) or output (Conv2d) in one forward."""
    if isinstance(module, nn.Conv2d):
        batch, positions = shape[0], shape[-2] * shape[-1]
        return positions ** 2, batch ** 2 * positions ** 3
    rows = math.prod(shape[:-1])
    return 1, rows ** 2


def kfac_pytorch_scales(model, example_input, *, optimizer=None, skip_modules=(),
                        max_factor_dim=DEFAULT_MAX_FACTOR_DIM):
    """{layer name: (c_A, c_G)} for the layers :class:`~.kfac.KFAC` preconditions, measured
    by one forward of ``example_input`` (a tensor, a tuple of positional arguments or a
    dict of keyword arguments) with the model in eval mode and without grad (modes are
    restored; batch-norm statistics are not touched).

    Raises:
        ValueError: a layer kfac-pytorch treats otherwise or not at all (a non-Linear /
            Conv2d type, fused experts, an ``nn.MultiheadAttention`` out-projection, a frozen
            bias, a dilated or string-padded convolution, a factor side at the identity), or a
            layer not called exactly once by the forward.
    """
    found = discover(unwrap_model(model), skip_modules, optimizer, max_factor_dim)
    for layer in found.layers:
        module, why = layer.module, None
        if layer.kind == "mha_out":
            why = "an nn.MultiheadAttention out-projection (kfac-pytorch never sees its forward)"
        elif getattr(layer, "experts", None) is not None:
            why = (f"a fused stack of {layer.experts} experts (kfac-pytorch has no 3-D expert "
                   "parameters, and each expert's rows would give it its own c_G)")
        elif not isinstance(module, (nn.Linear, nn.Conv2d)):
            why = f"{type(module).__name__} (kfac-pytorch registers nn.Linear and nn.Conv2d only)"
        elif module.bias is not None and not module.bias.requires_grad:
            why = "a frozen bias (kfac-pytorch skips a module with any frozen parameter)"
        elif isinstance(module, nn.Conv2d) and (
                isinstance(module.padding, str) or tuple(module.dilation) != (1, 1)
                or module.padding_mode != "zeros"):
            why = ("a convolution with dilation, string padding or a non-zero padding mode "
                   "(kfac-pytorch's patches ignore these)")
        elif layer.identity_L or layer.identity_R:
            why = ("a factor side at the identity (max_factor_dim); kfac-pytorch has no size "
                   "guard: pass max_factor_dim=None or skip the layer")
        if why is not None:
            raise ValueError(f"from_kfac_pytorch: layer {layer.name!r} is {why}; leave it out "
                             "with skip_modules (and kfac-pytorch's skip_layers)")
    shapes, hooks = {}, []
    for layer in found.layers:
        def record(module, args, out, name=layer.name):
            x = out if isinstance(module, nn.Conv2d) else args[0]
            shapes.setdefault(name, []).append(tuple(x.shape))
        hooks.append(layer.module.register_forward_hook(record))
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with torch.no_grad():
            if isinstance(example_input, dict):
                model(**example_input)
            elif isinstance(example_input, tuple):
                model(*example_input)
            else:
                model(example_input)
    finally:
        for hook in hooks:
            hook.remove()
        for module, mode in modes:
            module.training = mode
    scales = {}
    for layer in found.layers:
        seen = shapes.get(layer.name, [])
        if len(seen) != 1:
            raise ValueError(f"from_kfac_pytorch: layer {layer.name!r} ran {len(seen)} times in "
                             "the example forward; its scale needs exactly one call")
        scales[layer.name] = _layer_scales(layer.module, seen[0])
    return scales


@dataclasses.dataclass(frozen=True)
class KFACPytorchConversion:
    """What :func:`from_kfac_pytorch` found.

    Attributes:
        kfac_kwargs: keyword arguments for ``KFAC(model, optimizer, **kfac_kwargs)``.
        group_settings: one dict per param group of the optimizer, the values to set
            (``lr``, ``weight_decay``, ``eps`` where they change; :meth:`apply` sets them).
        c_A, c_G, c: the shared constants (ours = c_F x kfac-pytorch's factor; c = c_A c_G).
        layer_scales: {layer name: (c_A, c_G)}.
        backbone: "linear" (lr x c) or "scale_invariant" (eps / c).
        lr_factor: our lr over kfac-pytorch's for the preconditioned groups (c or 1);
            multiply a schedule by it (build an lr scheduler after :meth:`apply`).
    """

    kfac_kwargs: dict
    group_settings: tuple
    c_A: int
    c_G: int
    c: int
    layer_scales: dict
    backbone: str
    lr_factor: float

    def apply(self, optimizer):
        """Set :attr:`group_settings` on ``optimizer``'s param groups (idempotent)."""
        if len(optimizer.param_groups) != len(self.group_settings):
            raise ValueError(f"the optimizer has {len(optimizer.param_groups)} param groups, "
                             f"the conversion was made for {len(self.group_settings)}")
        for group, settings in zip(optimizer.param_groups, self.group_settings):
            group.update(settings)
        return optimizer


def _backbone(optimizer, backbone):
    if backbone is not None:
        if backbone not in ("linear", "scale_invariant"):
            raise ValueError(f"backbone must be None, 'linear' or 'scale_invariant', got "
                             f"{backbone!r}")
        return backbone
    if isinstance(optimizer, torch.optim.SGD):
        return "linear"
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return "scale_invariant"
    raise ValueError(f"from_kfac_pytorch: unknown backbone {type(optimizer).__name__}; pass "
                     "backbone='linear' (its step is linear in the gradient, like SGD) or "
                     "'scale_invariant' (invariant to the gradient's scale up to eps, like Adam)")


def _group_settings(optimizer, layers, c, backbone, explicit_backbone):
    """Per param group: the settings that make the backbone's step the same."""
    mine = {id(p) for module in layers for p in module.parameters(recurse=False)}
    out = []
    for index, group in enumerate(optimizer.param_groups):
        held = {id(p) for p in group["params"]}
        if not held & mine or c == 1:
            out.append({})
            continue
        if held - mine:
            raise ValueError(f"from_kfac_pytorch: param group {index} mixes preconditioned and "
                             "other parameters, whose gradients differ in scale by c = "
                             f"{c}; put the preconditioned layers' parameters in groups of "
                             "their own")
        wd = group.get("weight_decay", 0) or 0
        if backbone == "linear":
            settings = {"lr": group["lr"] * c}
            if wd:
                settings["weight_decay"] = wd / c
        else:
            if "eps" not in group:
                raise ValueError(f"from_kfac_pytorch: param group {index} has no eps for a "
                                 "scale-invariant backbone")
            settings = {"eps": group["eps"] / c}
            decoupled = (isinstance(optimizer, torch.optim.AdamW)
                         or bool(group.get("decoupled_weight_decay", False)))
            if wd and explicit_backbone:
                raise ValueError("from_kfac_pytorch: with backbone='scale_invariant' the "
                                 "weight decay's coupling is unknown; set it to 0 or use "
                                 "torch.optim.Adam / AdamW")
            if wd and not decoupled:
                settings["weight_decay"] = wd / c
        out.append(settings)
    return tuple(out)


def from_kfac_pytorch(model, optimizer, example_input, *, damping=1e-3, factor_decay=0.95,
                      kl_clip=1e-3, lr=None, compute_method="eigen", factor_update_steps=1,
                      inv_update_steps=1, skip_modules=(), max_factor_dim=None, backbone=None):
    """Convert ``kfac.preconditioner.KFACPreconditioner`` hyperparameters to :class:`KFAC`'s.

    Usage::

        conv = from_kfac_pytorch(model, opt, x_batch, damping=0.003, kl_clip=0.001)
        conv.apply(opt)                     # lr / eps / weight decay of the layer groups
        kfac = KFAC(model, opt, **conv.kfac_kwargs)

    Args:
        model, optimizer: the model and the backbone, as for :class:`KFAC`.
        example_input: one training batch (tensor, tuple of arguments or dict of keyword
            arguments) of the size used in training: the constants depend on it.
        damping, factor_decay, kl_clip, lr, compute_method, factor_update_steps,
            inv_update_steps: kfac-pytorch's values (numbers, not schedules); ``lr`` is the
            one kfac-pytorch's KL clip uses, by default the first param group's lr.
        skip_modules: our glob patterns (translate kfac-pytorch's ``skip_layers`` regexes).
        max_factor_dim: passed to :class:`KFAC` (None: no size guard, like kfac-pytorch).
        backbone: None (detect SGD / Adam / AdamW), "linear" or "scale_invariant".

    Returns:
        :class:`KFACPytorchConversion` (module docstring for the formulas).

    Raises:
        ValueError: a value kfac-pytorch itself refuses, layers that do not share (c_A, c_G),
            the inverse form with c_A != c_G, a param group mixing preconditioned and other
            parameters, or a layer :func:`kfac_pytorch_scales` refuses.
    """
    for name, value in (("damping", damping), ("kl_clip", kl_clip), ("lr", lr),
                        ("factor_decay", factor_decay)):
        if callable(value):
            raise ValueError(f"{name}: schedules are not converted; convert each value (the "
                             "constants do not change during training)")
    check_number("damping", damping, 0.0, low_open=True, finite=True)
    check_number("factor_decay", factor_decay, 0.0, 1.0)  # kfac-pytorch's (0, 1], and 0
    if kl_clip is not None:
        check_number("kl_clip", kl_clip, 0.0, low_open=True)
    method = compute_method.lower() if isinstance(compute_method, str) else str(
        getattr(compute_method, "name", compute_method)).lower()
    check_choice("compute_method", method, ("eigen", "inverse"))
    kind = _backbone(optimizer, backbone)
    scales = kfac_pytorch_scales(model, example_input, optimizer=optimizer,
                                 skip_modules=skip_modules, max_factor_dim=max_factor_dim)
    if not scales:
        raise ValueError("from_kfac_pytorch: no layer is preconditioned")
    pairs = set(scales.values())
    if len(pairs) > 1:
        listed = ", ".join(f"{n}: c_A={a}, c_G={g}" for n, (a, g) in scales.items())
        raise ValueError("from_kfac_pytorch: the layers do not share one (c_A, c_G), and KFAC "
                         f"has one damping and one KL clip for all ({listed}); precondition "
                         "layers of one kind and size only (skip_modules), or tune our "
                         "hyperparameters directly")
    (c_A, c_G), = pairs
    c = c_A * c_G
    if method == "eigen":
        ours_damping = c * damping
    elif c_A == c_G:
        ours_damping = c_A * damping
    else:
        raise ValueError(f"from_kfac_pytorch: the inverse form damps A and G separately, so it "
                         f"maps only when c_A = c_G (here c_A={c_A}, c_G={c_G}); use "
                         "compute_method='eigen'")
    layers = [unwrap_model(model).get_submodule(name) for name in scales]
    settings = _group_settings(optimizer, layers, c, kind, backbone is not None)
    lr_kp = optimizer.param_groups[0]["lr"] if lr is None else lr
    lr_0 = settings[0].get("lr", optimizer.param_groups[0]["lr"])
    if kl_clip is None:
        ours_kl = None
    elif lr_kp == 0 or lr_0 == 0:
        raise ValueError("from_kfac_pytorch: the KL clip needs a non-zero lr to convert")
    else:
        ours_kl = kl_clip * lr_0 ** 2 / (c * lr_kp ** 2)
    kwargs = {"inv_freq": inv_update_steps, "factor_freq": factor_update_steps,
              "damping": ours_damping, "factor_decay": factor_decay, "kl_clip": ours_kl,
              "method": method, "skip_modules": tuple(skip_modules),
              "max_factor_dim": max_factor_dim, "token_mask": None,
              "factor_init": "identity", "factor_init_scale": (float(c_A), float(c_G))}
    lr_factor = float(c) if kind == "linear" else 1.0
    return KFACPytorchConversion(kwargs, settings, c_A, c_G, c, dict(scales), kind, lr_factor)
