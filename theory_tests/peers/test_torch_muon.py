"""MARS-M at gamma = 0 without the clip is ``torch.optim.Muon(nesterov=False,
adjust_lr_fn="match_rms_adamw")`` bit for bit, with both at their defaults otherwise.

``theory_tests/mars/test_mars_m_properties.py`` compares gamma = 0 with ``clip_c=True`` and
gradients too small for the clip to fire, and ``test_orthogonaliser_options.py`` compares
``clip_c=False`` with a non-default Newton-Schulz triple.  This is the remaining case: the
default coefficients, ``clip_c=False``, gradients with norms of 3 to 30 (where the clip would
fire), weight decay on and lr changed at every step, float32 (bf16 Newton-Schulz in both).
"""
import torch

from theory_tests.support.mars_property_helpers import clone_params, make_params
from torch_impl import MARSM

MATRICES = [(16, 8), (8, 24), (12, 12)]
LRS = (0.02, 0.05, 0.03, 0.01, 0.004, 0.002)


def test_gamma_zero_unclipped_mars_m_is_torch_muon_bit_for_bit():
    a = make_params(MATRICES, 7, torch.float32)
    b = clone_params(a)
    start = clone_params(a)
    ours = MARSM(a, lr=LRS[0], weight_decay=0.1, gamma=0.0, clip_c=False)
    muon = torch.optim.Muon(b, lr=LRS[0], weight_decay=0.1, nesterov=False,
                            adjust_lr_fn="match_rms_adamw")
    for t, lr in enumerate(LRS):
        gen = torch.Generator().manual_seed(70 + t)
        grads = [torch.randn(s, generator=gen) * (0.5 + 4.5 * (t % 2)) for s in MATRICES]
        assert min(torch.linalg.vector_norm(g).item() for g in grads) > 2  # the clip would fire
        for opt, params in ((ours, a), (muon, b)):
            for group in opt.param_groups:
                group["lr"] = lr
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(a, b)), f"step {t + 1}"
    assert all(not torch.equal(p, p0) for p, p0 in zip(a, start))
