"""The LAMB backbone (torch_impl.baselines.LAMB) against the NumPy oracle first_order.lamb."""
import numpy as np
import pytest
import torch

from reference.common import first_order
from torch_impl.baselines import LAMB


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_lamb_matches_the_oracle(device, weight_decay):
    """float64, 12 steps, a normal tensor and an all-zero one (trust ratio 1 branch):
    parameters agree to 1e-12 relative (same operations, summation order aside). The oracle
    and this port share LAMB's formula: ``common/test_independent_oracles.py`` checks both against
    closed forms and against LAMB built from ``torch.optim.Adam``."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(4, 3, generator=g, dtype=torch.float64),
              torch.zeros(5, dtype=torch.float64)]
    torch_params = [p.clone().to(device).requires_grad_() for p in params]
    opt = LAMB(torch_params, lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay)
    ref = [p.numpy().copy() for p in params]
    states = [{} for _ in params]
    for t in range(12):
        grads = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in params]
        for p, gr in zip(torch_params, grads):
            p.grad = gr.to(device)
        opt.step()
        ref = [first_order.lamb(p, gr.numpy(), s, lr=0.02, betas=(0.8, 0.99), eps=1e-6,
                                weight_decay=weight_decay)
               for p, gr, s in zip(ref, grads, states)]
        for p, r in zip(torch_params, ref):
            # relative to the tensor's largest entry (an absolute floor 1e-12 below 1)
            assert np.allclose(p.detach().cpu().numpy(), r, rtol=0,
                               atol=1e-12 * max(1.0, np.abs(r).max()))


@pytest.mark.parametrize("kwargs,name", [(dict(lr=-1.0), "lr"), (dict(betas=(1.0, 0.9)), "betas"),
                                         (dict(betas=(0.9, -0.1)), "betas"), (dict(eps=-1.0), "eps"),
                                         (dict(weight_decay=-1.0), "weight_decay")])
def test_lamb_rejects_invalid_hyperparameters(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LAMB([torch.zeros(2, requires_grad=True)], **kwargs)
