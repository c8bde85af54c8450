r"""LAMB (You et al., ICLR 2020) as a ``torch.optim.Optimizer``: MKOR's BERT backbone.

.. math::
    \begin{aligned}
    m_k &= \beta_1 m_{k-1} + (1-\beta_1) g_k, \qquad
    v_k = \beta_2 v_{k-1} + (1-\beta_2) g_k^2 \\
    r_k &= \frac{m_k / (1-\beta_1^k)}{\sqrt{v_k / (1-\beta_2^k)} + \epsilon} + \lambda p_{k-1} \\
    \phi &= \|p_{k-1}\| / \|r_k\| \ (1 \text{ when either norm is } 0), \qquad
    p_k = p_{k-1} - \eta\, \phi\, r_k
    \end{aligned}

per parameter tensor (the identity trust function), exactly as
``reference.first_order.lamb``. The trust ratio uses ``torch.where``, so a step never
synchronises with the host.
"""
import torch

__all__ = ["LAMB"]


class LAMB(torch.optim.Optimizer):
    """LAMB.

    Args:
        params: iterable of parameters or param-group dicts.
        lr: learning rate eta (>= 0). betas: (beta1, beta2), each in [0, 1).
        eps: added to sqrt(v_hat) (>= 0). weight_decay: lambda (>= 0), inside the
            trust-ratio update as in the LAMB paper.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate (lr): {lr}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0 (betas): {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1 (betas): {betas[1]}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value (eps): {eps}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LAMB does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    # The step count lives on the CPU (as in torch.optim): no device sync.
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                k = int(state["step"].item())
                m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                r = (m / (1 - beta1 ** k)) / ((v / (1 - beta2 ** k)).sqrt() + group["eps"])
                if group["weight_decay"] != 0:
                    r = r.add(p, alpha=group["weight_decay"])
                p_norm, r_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(r)
                usable = (p_norm > 0) & (r_norm > 0)
                trust = torch.where(usable, p_norm / torch.where(usable, r_norm, 1.0), 1.0)
                p.sub_(group["lr"] * trust * r)
        return loss
