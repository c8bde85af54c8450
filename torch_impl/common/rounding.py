r"""Stochastic rounding of a wider float tensor to a narrower float type (LP1), and the seeds
of its random streams (LP2).

.. math::
    \mathrm{SR}(x) = \begin{cases} hi & u < (x - lo)/(hi - lo) \\ lo & \text{otherwise}
    \end{cases}, \qquad u \sim U[0, 1), \qquad \mathbb{E}[\mathrm{SR}(x)] = x

with lo <= x <= hi the adjacent values of the narrow type (``reference/common/rounding.py``).
A value beyond the narrow type's largest finite one, and a non-finite one, round to nearest
(so an overflow still shows as inf, as it would without the option).

The uniforms of one call come from a ``torch.Generator`` on x's device seeded with ``seed``:
a write is a function of its seed and its input only, so a caller that derives the seed from
what its ``state_dict`` holds (LP2: the optimizer's ``rounding_seed``, the tensor, the buffer,
the step) resumes bit for bit, and nothing is read from the device (no host sync).

float32 -> bfloat16, the common case, adds 16 random bits to the float32 bit pattern and
truncates (one integer add and one mask, no neighbour arithmetic); it is the same rule, with
u = (65535.5 - r) / 65536 for x >= 0 and (r + 0.5) / 65536 for x < 0, r the 16 random bits
(``theory_tests/low_precision/test_rounding.py`` proves the two paths equal element for element).
"""
import hashlib

import torch

__all__ = ["stochastic_round", "stochastic_round_with_uniform", "stream_seed", "name_word",
           "default_rounding_seed", "agreed_rounding_seed", "ROUNDING_DTYPES"]

# the narrow types a state may be stored in with stochastic rounding
ROUNDING_DTYPES = (torch.bfloat16, torch.float16)
_MASK64 = (1 << 64) - 1


def _splitmix64(z):
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def stream_seed(*words):
    """One 63-bit seed from integer words (LP2): each word is folded in by a splitmix64
    round, so seeds that differ in any word differ everywhere (no two (seed, tensor, buffer,
    step) share a stream but by a 2^-63 collision)."""
    h = 0
    for w in words:
        h = _splitmix64(h ^ (int(w) & _MASK64))
    return h >> 1


def name_word(name):
    """A stable 64-bit word for a buffer name (Python's ``hash`` of a str changes per process)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def default_rounding_seed():
    """One draw from torch's default CPU generator: ``torch.manual_seed`` fixes it, and two
    optimizers built one after the other get different streams."""
    return int(torch.randint(0, 2 ** 62, (), dtype=torch.int64))


def agreed_rounding_seed():
    """``default_rounding_seed()``, and under ``torch.distributed`` (initialised, world size > 1)
    rank 0's draw on every rank (one broadcast, at construction): replicated state (DDP) must
    round identically on every rank, and ranks whose torch generators differ would otherwise
    draw different seeds and let the replicas drift apart in silence."""
    seed = default_rounding_seed()
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend() == "nccl" else torch.device("cpu")
        box = torch.tensor([seed], dtype=torch.int64, device=device)
        dist.broadcast(box, src=0)
        seed = int(box.item())  # at construction, not in a step
    return seed


def _check(x, dtype):
    if not x.is_floating_point() or dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype: stochastic rounding of a {x.dtype} tensor to {dtype} "
                         "(expected a float tensor and bfloat16, float16 or float32)")
    if torch.finfo(dtype).bits >= torch.finfo(x.dtype).bits:
        raise ValueError(f"dtype: {dtype} is not narrower than the tensor's {x.dtype}: "
                         "there is nothing to round")


def _generator(device, seed):
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def stochastic_round_with_uniform(x, dtype, u):
    """SR(x) to ``dtype`` with the given uniforms ``u`` (x's shape, values in [0, 1))."""
    _check(x, dtype)
    nearest = x.to(dtype)
    near = nearest.to(x.dtype)
    # the neighbour on the other side of x (float64 -> bf16 may round twice: still a neighbour)
    toward = torch.where(near < x, torch.inf, -torch.inf).to(dtype)
    other = torch.nextafter(nearest, toward).to(x.dtype)
    lo, hi = torch.minimum(near, other), torch.maximum(near, other)
    up = u < (x - lo) / (hi - lo)
    out = torch.where(up, hi, lo).to(dtype)
    return torch.where(_in_rule(x, near, dtype), out, nearest)


def _in_rule(x, near, dtype):
    """Where LP1 applies: finite, within the narrow type's range, and not already a value of it."""
    return (x.abs() <= torch.finfo(dtype).max) & (near != x)


def stochastic_round(x, dtype, seed):
    """SR(x) to ``dtype`` (LP1), the uniforms drawn from a generator on x's device seeded with
    ``seed`` (LP2; a Python int).  Returns a new tensor of ``dtype`` and x's shape."""
    _check(x, dtype)
    g = _generator(x.device, seed)
    if x.dtype == torch.float32 and dtype == torch.bfloat16:
        r = torch.randint(0, 1 << 16, x.shape, generator=g, device=x.device, dtype=torch.int32)
        bits = (x.contiguous().view(torch.int32) + r).bitwise_and_(-65536)  # 0xFFFF0000
        out = bits.view(torch.float32).to(torch.bfloat16)  # exact: the low bits are zero
        keep = torch.isfinite(x) & (x.abs() <= torch.finfo(torch.bfloat16).max)
        return torch.where(keep, out, x.to(torch.bfloat16))
    u = torch.rand(x.shape, generator=g, device=x.device, dtype=x.dtype)
    return stochastic_round_with_uniform(x, dtype, u)
