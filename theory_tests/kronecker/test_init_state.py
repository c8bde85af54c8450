"""``init_state()`` of MKOR and K-FAC: the state a checkpoint template must name exists before
the first step, and creating it changes nothing.

torchtitan's ``init_optim_state`` and DCP's ``get_state_dict`` step an optimizer whose state is
empty (zero gradients, lr = 0), and DCP's ``dcp.load`` / torchtitan's flat layout load only the
names the live (template) state has. So:

(a) ``init_state()`` then steps is the fresh run bit for bit, and a DCP ``get_state_dict``
    after it is a no-op;
(b) right after ``init_state()`` every parameter carries the names it carries after a step
    (K-FAC: each layer's decomposition too, which otherwise first appears at step 0);
(c) DCP's own flow (``get_state_dict`` -> ``dcp.save`` after k steps; a fresh job's
    ``init_state()`` and ``get_state_dict`` as the template, ``dcp.load``, ``set_state_dict``)
    continues as the uninterrupted run bit for bit.
"""
import io

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from torch_impl import KFAC, MKOR
from theory_tests.support.checkpoint_checks import assert_same, dcp_round_trip

CASES = {
    "mkor": lambda net: MKOR(net, torch.optim.AdamW(net.parameters(), lr=1e-2), inv_freq=2),
    "kfac": lambda net: KFAC(net, torch.optim.AdamW(net.parameters(), lr=1e-2), inv_freq=2,
                             damping=1e-2),
}


def _net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3)).double()


def _step(net, opt, t):
    g = torch.Generator().manual_seed(t)
    x = torch.randn(16, 6, generator=g, dtype=torch.float64)
    y = torch.randn(16, 3, generator=g, dtype=torch.float64)
    torch.nn.functional.mse_loss(net(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _copy(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _names(state_dict):
    """{param index: {name: sub-names}}: what a template asks a checkpoint for."""
    return {i: {k: sorted(v) if isinstance(v, dict) else None for k, v in st.items()}
            for i, st in state_dict["state"].items()}


@pytest.mark.parametrize("case", list(CASES))
def test_init_state_then_steps_is_the_fresh_run(case):
    """(a)"""
    net_a, net_b = _net(), _net()
    fresh, inited = CASES[case](net_a), CASES[case](net_b)
    inited.init_state()
    get_state_dict(net_b, inited)  # DCP's init step: nothing to do now
    for t in range(5):
        _step(net_a, fresh, t)
        _step(net_b, inited, t)
    for p, q in zip(net_a.parameters(), net_b.parameters()):
        assert torch.equal(p, q)
    assert_same(_copy(fresh.state_dict()), _copy(inited.state_dict()))


@pytest.mark.parametrize("case", list(CASES))
def test_init_state_names_what_a_step_names(case):
    """(b)"""
    net_a, net_b = _net(), _net()
    stepped, inited = CASES[case](net_a), CASES[case](net_b)
    _step(net_a, stepped, 0)
    inited.init_state()
    assert _names(inited.state_dict()) == _names(stepped.state_dict())


@pytest.mark.parametrize("case", list(CASES))
def test_a_dcp_template_resumes_bit_for_bit(case, tmp_path):
    """(c), saved after k = 0 and k = 3 steps (inv_freq = 2: the save falls between two
    factor inversions)."""
    for k in (0, 3):
        net_a = _net()
        opt_a = CASES[case](net_a)
        opt_a.init_state()
        for t in range(k):
            _step(net_a, opt_a, t)
        net_b = _net(seed=1)
        opt_b = CASES[case](net_b)
        opt_b.init_state()
        dcp_round_trip(net_a, opt_a, net_b, opt_b, str(tmp_path / f"k{k}"))
        assert_same(_copy(opt_a.state_dict()), _copy(opt_b.state_dict()), f"k={k}")
        for t in range(k, k + 4):
            _step(net_a, opt_a, t)
            _step(net_b, opt_b, t)
        for p, q in zip(net_a.parameters(), net_b.parameters()):
            assert torch.equal(p, q), f"k={k}"
