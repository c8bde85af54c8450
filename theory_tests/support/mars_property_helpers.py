"""Small helpers shared by the MARS property and contract tests: seeded parameters, gradients
fed by hand, snapshots, and a whole-optimizer comparison."""
import torch

F64 = torch.float64
MARS_TYPES = ["mars-adamw", "mars-lion", "mars-shampoo"]


def make_params(shapes, seed=0, dtype=F64, bound=None):
    """Gaussian parameters, or uniform in [-bound, bound]."""
    gen = torch.Generator().manual_seed(seed)
    if bound is not None:
        return [torch.nn.Parameter((torch.rand(s, generator=gen, dtype=dtype) * 2 - 1) * bound)
                for s in shapes]
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in shapes]


def clone_params(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def snapshot(params):
    return [p.detach().clone() for p in params]


def random_grads(rng, shapes, norms=None, scale=1.0, dtype=F64):
    """Gaussian gradients; with ``norms``, tensor i rescaled to Frobenius norm norms[i]."""
    grads = [torch.tensor(rng.normal(size=s) * scale, dtype=dtype) for s in shapes]
    if norms is not None:
        grads = [g * (n / torch.linalg.vector_norm(g)) for g, n in zip(grads, norms)]
    return grads


def feed(opt, params, grads):
    """One step with the given gradients (``None`` entries leave ``p.grad`` unset)."""
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.detach().clone().to(p.dtype)
    return opt.step()


def steps(opt, params, grad_seq):
    """Feed each gradient list in turn; return the iterates after each step."""
    out = []
    for grads in grad_seq:
        feed(opt, params, grads)
        out.append(snapshot(params))
    return out


def assert_same_optimizer(params_a, opt_a, params_b, opt_b):
    """Bit-identical parameters and per-parameter state (every key, every tensor)."""
    for p, q in zip(params_a, params_b):
        assert torch.equal(p, q)
        sa, sb = opt_a.state.get(p, {}), opt_b.state.get(q, {})
        assert sa.keys() == sb.keys()
        for key in sa:
            x, y = sa[key], sb[key]
            assert torch.equal(x, y) if torch.is_tensor(x) else x == y, key


def closure_for(opt, params, loss_fn, *args, set_to_none=True):
    """A standard closure: zero the grads, compute ``loss_fn(params, *args)``, backward."""
    def closure():
        opt.zero_grad(set_to_none=set_to_none)
        loss = loss_fn(params, *args)
        loss.backward()
        return loss
    return closure


# ------------------------------------------------------------------ shared by the property files

P_STAR = 1.2023686051632128  # sup of the 5-step quintic orbit on (0, 1] (test_newton_schulz)


def assert_ulp_close(actual, expected, travelled):
    """Two evaluations of the same update that differ only in the order of their roundings:
    each step differs by a few ulps of that step, so the iterates may drift apart by 1e-13 of
    the distance travelled (weight decay only contracts), plus 1e-14 of their own size."""
    torch.testing.assert_close(actual, expected, rtol=1e-14, atol=1e-13 * travelled)


def recovered_c(m_now, m_before, beta1):
    """c~_t from (M4): m_t = beta1 m_{t-1} + (1 - beta1) c~_t."""
    return (m_now - beta1 * m_before) / (1 - beta1)


SCALAR_READS = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist")


def spy_on_scalar_reads(monkeypatch):
    """Patch every tensor-to-Python read (``.item()``, ``bool()``, ...) to record its tensor;
    returns the list the reads go to (``monkeypatch.undo()`` ends the spying)."""
    import torch

    reads = []
    for name in SCALAR_READS:
        original = getattr(torch.Tensor, name)

        def spy(self, *args, _original=original, **kwargs):
            reads.append(self)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, spy)
    return reads
