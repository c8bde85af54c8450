r"""K-FAC baseline (KAISA form; spec MKOR.md K19) with MKOR's interface.

Per layer, with rows a_i (inputs, [a_i | 1] with a bias) and per-sample output
gradients N g_i of a mean-reduced loss:

.. math::
    A \leftarrow \beta A + (1-\beta) \tfrac1N \textstyle\sum_i a_i a_i^T, \qquad
    G \leftarrow \beta G + (1-\beta) \tfrac1N \textstyle\sum_i (N g_i)(N g_i)^T

every ``factor_freq`` steps (the first update takes the batch factor as is), then every
``inv_freq`` steps an O(d^3) decomposition, and every step

.. math::
    V = Q_G\big[(Q_G^T \hat G Q_A) \oslash (\lambda_G \lambda_A^T + \delta)\big] Q_A^T
      = (G \otimes A + \delta I)^{-1} \hat G \quad (\text{"eigen"}), \qquad
    V = (G + \delta I)^{-1} \hat G (A + \delta I)^{-1} \quad (\text{"inverse"}),

scaled by the KL-clip \nu = \min(1, \sqrt{\kappa / |\sum_m \eta^2 \langle V_m, \hat G_m\rangle|}).
Conv2d rows are the unfolded patches (B L rows) with N = B samples, so
G = (1/B) \sum_{b,l} (B g_{b,l})(B g_{b,l})^T (the KFC approximation).
This is the method MKOR replaces: it *does* call ``eigh`` / ``inv``.

Distributed (the baseline MKOR's O(d) claim is measured against): on a factor-update step
every rank all-reduces the *full* batch factors A_new and G_new of every layer in one flat
buffer (:class:`~.distributed.Packet`, mean taken once), then applies the same EMA and
decomposition, so :attr:`KFAC.payload_bytes` = (sum_m (d_in'^2 + d_out^2) + #bias-free
layers) x itemsize: O(d^2) per layer. (KAISA can also send inverses or shard the work;
this baseline replicates everything, like MKOR.)
"""
import torch

from .capture import Capture, HookedLayers, conv_input, discover, unwrap_model
from .distributed import Packet, world_size
from .vectors import unfold2d

__all__ = ["KFAC"]


def _input_stat(layer, x):
    """(sum_i a_i a_i^T, rows) of one forward, rows with a trailing 1 for a bias."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    if layer.kind == "conv2d":
        m = layer.module
        x, padding = conv_input(m, x)
        rows = unfold2d(x, m.kernel_size, dilation=m.dilation, padding=padding,
                        stride=m.stride).transpose(1, 2)
    else:
        rows = x
    rows = rows.reshape(-1, rows.shape[-1])
    if layer.has_bias:
        rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
    return rows.T @ rows, rows.shape[0]


def _grad_stat(layer, g):
    """(1/N) sum_i (N g_i)(N g_i)^T = N sum_i g_i g_i^T, N = samples (B for Conv2d)."""
    g = g.to(torch.promote_types(g.dtype, torch.float32))
    if layer.kind == "conv2d":
        n = g.shape[0]
        rows = g.flatten(2).transpose(1, 2).reshape(-1, g.shape[1])
    else:
        rows = g.reshape(-1, g.shape[-1])
        n = rows.shape[0]
    return n * (rows.T @ rows)


class KFAC(HookedLayers):
    """K-FAC preconditioner wrapping a ``torch.optim`` optimizer (same API as MKOR).

    Args:
        model, optimizer: as :class:`~torch_impl.mkor.MKOR`.
        inv_freq: decomposition period (KAISA's inv_update_steps).
        factor_freq: factor EMA period (factor_update_steps).
        damping: delta (> 0). factor_decay: beta in [0, 1).
        kl_clip: kappa > 0, or None to disable; the clip uses the learning rate of the
            optimizer's first param group, read at every step.
        method: "eigen" (default) or "inverse".
        skip_modules: glob patterns of module names to leave to the backbone.
        grad_hook: "module" | "tensor", as for MKOR.
        process_group: process group for averaging the factors (default: the world).
    """

    def __init__(self, model, optimizer, *, inv_freq=10, factor_freq=1, damping=1e-3,
                 factor_decay=0.95, kl_clip=1e-3, method="eigen", skip_modules=(),
                 grad_hook="tensor", process_group=None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("optimizer must be a torch.optim.Optimizer")
        for name, value in (("inv_freq", inv_freq), ("factor_freq", factor_freq)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not damping > 0:
            raise ValueError(f"damping must be > 0, got {damping!r}")
        if not 0 <= factor_decay < 1:
            raise ValueError(f"factor_decay must be in [0, 1), got {factor_decay!r}")
        if kl_clip is not None and not kl_clip > 0:
            raise ValueError(f"kl_clip must be None or > 0, got {kl_clip!r}")
        if method not in ("eigen", "inverse"):
            raise ValueError(f"method must be 'eigen' or 'inverse', got {method!r}")
        self.model, self.optimizer, self.process_group = model, optimizer, process_group
        self.inv_freq, self.factor_freq = inv_freq, factor_freq
        self.damping, self.factor_decay, self.kl_clip, self.method = (
            damping, factor_decay, kl_clip, method)
        self._layers, self._skipped = discover(unwrap_model(model), tuple(skip_modules))
        self._steps = 0
        self._state = {layer.name: {} for layer in self._layers}
        self._capture = Capture(self._layers, self.factor_update_due, _input_stat, _grad_stat,
                                grad_hook=grad_hook)
        self._capture.register()
        # Factors are kept in the statistics' dtype: the weights' promoted with float32.
        self._packet = Packet(
            [[(l.d_in, l.d_in), (l.d_out, l.d_out)] for l in self._layers],
            [l.has_bias for l in self._layers],  # A[-1, -1] = mean of 1 * 1 = 1
            torch.promote_types(self._layers[0].module.weight.dtype, torch.float32)
            if self._layers else torch.float32)
        self.communicated_bytes = 0  # running total all-reduced by this rank (an int)

    @property
    def payload_bytes(self):
        """Bytes each rank all-reduces per factor update: (sum_m (d_in'^2 + d_out^2) +
        #bias-free layers) x itemsize."""
        return self._packet.nbytes

    def factor_update_due(self):
        return self._steps % self.factor_freq == 0

    def factors(self):
        """{name: (A, G)} of the current factor EMAs (absent before the first update)."""
        return {n: (s["A"], s["G"]) for n, s in self._state.items() if "A" in s}

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._capture.reset()

    def state_dict(self, include_optimizer=False):
        state = {"steps": self._steps,
                 "layers": {n: {k: (tuple(t.clone() for t in v) if isinstance(v, tuple)
                                    else v.clone()) for k, v in s.items()}
                            for n, s in self._state.items()}}
        if include_optimizer:
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def load_state_dict(self, state):
        if set(state["layers"]) != set(self._state):
            raise ValueError("state_dict layers do not match the preconditioned modules")
        self._steps = state["steps"]
        self._state = {n: dict(s) for n, s in state["layers"].items()}
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])

    # -- the step -----------------------------------------------------------------------
    def _batch_factors(self):
        """[(layer, A_new, G_new)] of this step, averaged over the ranks that captured
        each layer when distributed."""
        new = []
        for layer in self._layers:
            stats = self._capture.stats(layer.name)
            if stats is not None:
                a_sum, a_count, g_sum, g_calls = stats
                new.append((layer, a_sum / a_count, g_sum / g_calls))
        if world_size(self.process_group) == 1 or not self._layers:
            return new
        mine = {layer.name: [A, G] for layer, A, G in new}
        reduction = self._packet.all_reduce([mine.get(l.name) for l in self._layers],
                                            self._layers[0].module.weight.device,
                                            self.process_group)
        self.communicated_bytes += self._packet.nbytes
        out = []
        for layer, ((A, G), count) in zip(self._layers, reduction.wait(self._packet.dtype)):
            # A layer no rank captured stays as it was. A rank that captured it knows the
            # count is >= 1 without reading it; only the others read it (a host sync that
            # ordinary DDP training, where every rank captures every layer, never makes).
            if layer.name in mine or count > 0:
                dev = layer.module.weight.device
                out.append((layer, A.to(dev), G.to(dev)))
        return out

    def _update_factors(self):
        for layer, A_new, G_new in self._batch_factors():
            s, beta = self._state[layer.name], self.factor_decay
            if "A" not in s:
                s["A"], s["G"] = A_new, G_new
            else:
                s["A"] = beta * s["A"] + (1 - beta) * A_new
                s["G"] = beta * s["G"] + (1 - beta) * G_new

    def _decompose(self):
        for s in self._state.values():
            if "A" not in s:
                continue
            if self.method == "eigen":
                for key in ("A", "G"):
                    F = s[key]
                    lam, Q = torch.linalg.eigh((F + F.T) / 2)
                    s["eig_" + key] = (lam.clamp(min=0), Q)  # rounding can go below 0
            else:
                for key in ("A", "G"):
                    F = s[key]
                    eye = torch.eye(F.shape[0], dtype=F.dtype, device=F.device)
                    s["inv_" + key] = torch.linalg.inv(F + self.damping * eye)

    def _apply(self, s, G_hat):
        if self.method == "eigen":
            (lamA, QA), (lamG, QG) = s["eig_A"], s["eig_G"]
            return QG @ ((QG.T @ G_hat @ QA) / (torch.outer(lamG, lamA) + self.damping)) @ QA.T
        return s["inv_G"] @ G_hat @ s["inv_A"]

    @torch.no_grad()
    def precondition(self):
        """Factor / decomposition updates when due, then ``.grad`` <- nu * V."""
        if self.factor_update_due():
            self._update_factors()
        if self._steps % self.inv_freq == 0:
            self._decompose()
        self._capture.reset()
        key = "eig_A" if self.method == "eigen" else "inv_A"
        work = []
        for layer in self._layers:
            s, w, b = self._state[layer.name], layer.module.weight, layer.module.bias
            if key not in s or w.grad is None:
                continue
            dtype = s["A"].dtype
            G_hat = w.grad.reshape(w.shape[0], -1).to(dtype)
            if layer.has_bias:
                gb = b.grad if b.grad is not None else torch.zeros_like(b)
                G_hat = torch.cat([G_hat, gb.reshape(-1, 1).to(dtype)], dim=1)
            work.append((layer, G_hat, self._apply(s, G_hat)))
        nu = None
        if self.kl_clip is not None and work:
            lr = self.optimizer.param_groups[0]["lr"]
            vg = torch.stack([(V * G).sum().to(work[0][2].device) for _, G, V in work]).sum()
            vg = (vg * lr ** 2).abs()
            # nu = 1 when the sum is 0 (nothing to clip); torch.where keeps it sync-free.
            nu = torch.where(vg > 0, (self.kl_clip / torch.where(vg > 0, vg, 1.0)).sqrt(), 1.0)
            nu = nu.clamp(max=1.0)
        for layer, _, V in work:
            if nu is not None:
                V = V * nu.to(V.device)
            w, b = layer.module.weight, layer.module.bias
            w.grad.copy_(V[:, :w[0].numel()].reshape(w.shape))
            if layer.has_bias and b.grad is not None:
                b.grad.copy_(V[:, -1])
        self._steps += 1

    def step(self, closure=None):
        """:meth:`precondition`, then ``optimizer.step()``; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.precondition()
        self.optimizer.step()
        return loss
