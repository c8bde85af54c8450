r"""How MARS, MARS-M and LAMB store their state and write a step back into it: ``state_dtype``,
``state_rounding``, ``rounding_seed`` and ``kahan_sum`` (one implementation for the three), and
MARS's and MARS-M's ``state_quantization`` (LP4, ``common/quantized_state.py``).

For a parameter p of dtype :math:`d_p` in a group with storage dtype
:math:`d_s` = ``state_dtype`` (:math:`d_p` when ``None``), a step computes in

.. math::
    d_c = \operatorname{promote}(d_p, d_s)
          \ \big[\,\vee\ \text{float32 with } \texttt{state\_rounding="stochastic"},
          \texttt{state\_quantization}
          \text{ or a 16-bit } p \text{ with } \texttt{kahan\_sum}\,\big]

on working copies of every tensor stored narrower than :math:`d_c` (gradients are only
read), and writes each copy w back into its stored tensor s once, after the update:

* ``"nearest"``: s <- RN(w) (``copy_``; the behaviour before these options, bit for bit);
* ``"stochastic"``: s <- SR(w) (LP1, ``common.rounding``) with the stream (LP2) seeded by
  ``stream_seed(rounding_seed, group index, position in the group, name_word(name), t)``,
  t the tensor's step count after the step's increment (its CPU counter, read on the host:
  no device sync) and ``name`` the state key (``"exp_avg"``, ``"momentum_buffer"``, ...) or
  ``"param"`` for a 16-bit parameter; exact mode's refill of ``last_grad`` with g_prev for
  step t is the stream ``"g_prev"``, t.  Two tensors, buffers, steps or optimizers (whose
  ``rounding_seed`` is drawn by ``default_rounding_seed``) never share a stream, and a
  resumed run needs nothing beyond ``state_dict``.  A DTensor's local shard is rounded with
  the rank's mesh coordinate as further words;
* ``kahan_sum`` (LP3), a 16-bit parameter p with compensation c (``kahan_comp``, p's dtype):
  the step starts from x = p + c in float32 and writes p <- RN(x), c <- RN(x - p), whatever
  ``state_rounding`` says (float32 / float64 parameters lose nothing and keep no buffer);
* a buffer held in 8 bits (``state_quantization="blockwise8"``) is dequantized into its
  working copy and quantized back (LP4), whatever ``state_rounding`` says.

``load_state_dict`` keeps ``state_dtype`` (torch casts every floating state tensor to the
parameter's dtype): ``shield_state_dtype`` / ``unshield_state_dtype`` pass it by torch's cast.
"""
import torch

from . import quantized_state
from .quantized_state import Quantized
from .rounding import ROUNDING_DTYPES, default_rounding_seed, name_word, stochastic_round, \
    stream_seed
from .sharding import is_dtensor
from .validation import check_bool, check_choice

__all__ = ["ROUNDINGS", "STATE_DTYPES", "PARAM", "G_PREV", "KAHAN", "check_storage",
           "resolve_rounding_seed", "stored_dtype", "compute_dtype", "kahan_applies",
           "ensure_state", "buffer", "WriteBack", "write_state", "shield_state_dtype",
           "unshield_state_dtype", "load_state_dict_keeping_storage"]

ROUNDINGS = ("nearest", "stochastic")
STATE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
PARAM = "param"      # the stream name of a 16-bit parameter's write
G_PREV = "g_prev"    # the stream name of exact mode's refill of last_grad
KAHAN = "kahan_comp"
# state kept in the parameter's dtype, whatever state_dtype says (torch's load casts them so)
PARAM_DTYPE_KEYS = ("step", "prev_param", "previous_grad", KAHAN)


# ------------------------------------------------------------------ options

def check_storage(group):
    """The group's storage options, against its parameters (a ValueError naming the option)."""
    if group["state_dtype"] is not None:
        check_choice("state_dtype", group["state_dtype"], STATE_DTYPES)
        complex_shapes = [tuple(p.shape) for p in group["params"] if p.is_complex()]
        if complex_shapes:
            raise ValueError(f"state_dtype: complex parameters (shapes {complex_shapes}) keep "
                             "complex state, which a real state_dtype cannot hold; put them in "
                             "a group with state_dtype=None")
    check_choice("state_rounding", group["state_rounding"], ROUNDINGS)
    seed = group["rounding_seed"]
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"rounding_seed: expected None or an int >= 0, got {seed!r}")
    check_bool("kahan_sum", group["kahan_sum"])
    quantized_state.check_quantization(group)  # MARS and MARS-M: state_quantization, block_size
    if group["state_rounding"] == "stochastic":
        for p in group["params"]:
            _check_roundable(p, stored_dtype(p, group))


def _check_roundable(p, dtype):
    if dtype in ROUNDING_DTYPES:
        return
    where = f"the {p.dtype} parameter of shape {tuple(p.shape)}"
    if not p.is_complex() and dtype.itemsize > p.dtype.itemsize:
        raise ValueError(f"state_rounding: 'stochastic' with state_dtype={dtype} wider than "
                         f"{where}: rounding on needs state narrower than the step's float32 "
                         "(state_dtype=torch.bfloat16 or torch.float16)")
    raise ValueError(f"state_rounding: 'stochastic' rounds state stored in bfloat16 or "
                     f"float16, but {where} keeps {dtype} state: nothing to round (set "
                     "state_dtype=torch.bfloat16, or state_rounding='nearest')")


def resolve_rounding_seed(optimizer, group):
    """A stochastic group's ``rounding_seed=None`` becomes the optimizer's seed: one draw of
    ``default_rounding_seed()`` per optimizer, at its first stochastic group (in the
    constructor, as a rule), kept in every such group and so in ``state_dict``.  An optimizer
    that never rounds stochastically draws nothing: torch's random stream stays as it was."""
    if group["state_rounding"] != "stochastic" or group["rounding_seed"] is not None:
        return
    if optimizer.defaults.get("rounding_seed") is None:
        optimizer.defaults["rounding_seed"] = default_rounding_seed()
    group["rounding_seed"] = optimizer.defaults["rounding_seed"]


def stored_dtype(p, group):
    """d_s: the dtype p's state is stored in."""
    return group["state_dtype"] or p.dtype


def kahan_applies(p, group):
    """Whether p carries a Kahan compensation: ``kahan_sum`` and p bf16 / fp16."""
    return group["kahan_sum"] and p.dtype in ROUNDING_DTYPES


def compute_dtype(p, group):
    """d_c: the dtype p's step computes in (module docstring)."""
    dtype = torch.promote_types(p.dtype, stored_dtype(p, group))
    if group["state_rounding"] == "stochastic" or kahan_applies(p, group) or \
            group.get("state_quantization"):
        dtype = torch.promote_types(dtype, torch.float32)
    return dtype


def ensure_state(st, p, group, names):
    """``st[name]`` for each of ``names``: zeros like p in the group's storage dtype where it is
    missing (a buffer a later option needs appears then), cast where the group's
    ``state_dtype`` changed since, or held as 8-bit codes and scales where the group quantizes
    it (``quantized_state.ensure_quantized``); and p's ``kahan_comp`` created (zeros) or
    dropped as ``kahan_sum`` says."""
    dtype = stored_dtype(p, group)
    for name in names:
        if quantized_state.ensure_quantized(st, p, group, name, dtype):
            continue
        if name not in st:
            st[name] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        elif st[name].dtype != dtype:  # the group's state_dtype changed since (or a state
            st[name] = st[name].to(dtype)  # set by hand): it holds from now on
    if kahan_applies(p, group):
        if KAHAN not in st:
            st[KAHAN] = torch.zeros_like(p, memory_format=torch.preserve_format)
    else:
        st.pop(KAHAN, None)


def buffer(st, name):
    """The state column entry of buffer ``name``: the tensor, ``Quantized()`` when it is held
    as codes and scales, ``None`` when the state has no such buffer."""
    if name in st:
        return st[name]
    return Quantized() if name + quantized_state.CODES in st else None


# ------------------------------------------------------------------ the write-back

class WriteBack:
    """One group's working copies (in each tensor's compute dtype) and their writes back.

    ``params`` / ``column`` return the columns a functional step takes, recording a
    (stored, working) pair for each copy; ``finish()`` writes every copy back, after the
    update (``"nearest"`` traced with the step under ``torch.compile``; ``"stochastic"`` in
    ``_round_back``, which dynamo leaves eager: the generator and the counters' host reads
    are no graph's)."""

    def __init__(self, group, group_index):
        self.group, self.group_index = group, group_index
        # (stored or None: quantized, working, name, p, state, compensation or None)
        self.records = []
        self._positions = None

    def params(self, params, states):
        """The parameters in their compute dtypes: x = p + c with Kahan, else p (a copy when
        the compute dtype is wider)."""
        out = []
        for p, st in zip(params, states):
            dtype = compute_dtype(p, self.group)
            comp = st.get(KAHAN) if kahan_applies(p, self.group) else None
            if p.dtype == dtype:
                out.append(p)
                continue
            x = p.to(dtype)
            if comp is not None:
                x.add_(comp)  # LP3: the lost low bits back
            self.records.append((p, x, PARAM, p, st, comp))
            out.append(x)
        return out

    def column(self, name, tensors, params, states):
        """The state column ``name`` (``None`` where a route keeps no such buffer,
        ``Quantized()`` where it is held in 8 bits) in the compute dtypes of ``params``."""
        out = []
        for t, p, st in zip(tensors, params, states):
            dtype = compute_dtype(p, self.group)
            if isinstance(t, Quantized):  # LP4: x = s code[q], quantized again at the end
                t = quantized_state.dequantize(st, name, self.group, dtype)
                self.records.append((None, t, name, p, st, None))
            elif t is not None and t.dtype != dtype:
                copy = t.to(dtype)
                self.records.append((t, copy, name, p, st, None))
                t = copy
            out.append(t)
        return out

    def read(self, tensors, params):
        """A read-only column (the gradients) in the compute dtypes of ``params``."""
        return [t if t is None or t.dtype == compute_dtype(p, self.group)
                else t.to(compute_dtype(p, self.group)) for t, p in zip(tensors, params)]

    def position(self, p):
        """p's position in its group (part of its stream's seed)."""
        if self._positions is None:
            self._positions = {id(q): i for i, q in enumerate(self.group["params"])}
        return self._positions[id(p)]

    def finish(self):
        """Write every working copy back into its stored tensor (module docstring)."""
        if self.group["state_rounding"] == "stochastic":
            _round_back(self.records, self.group, self.group_index,
                        [self.position(r[3]) for r in self.records])
            return
        for stored, working, name, _, st, comp in self.records:
            if stored is None:
                quantized_state.quantize_into(st, name, self.group, working)
            else:
                _nearest_back(stored, working, comp)


def _nearest_back(stored, working, comp):
    stored.copy_(working)
    if comp is not None:  # LP3: what RN(x) lost, itself rounded to the parameter's dtype
        comp.copy_(working.sub(stored))


@torch._dynamo.disable
def _round_back(records, group, group_index, positions):
    seed = group["rounding_seed"]
    for (stored, working, name, _, st, comp), position in zip(records, positions):
        if stored is None:  # 8-bit: the quantizer is the rounding
            quantized_state.quantize_into(st, name, group, working)
            continue
        if comp is not None or stored.dtype not in ROUNDING_DTYPES:
            _nearest_back(stored, working, comp)  # Kahan's parameter write is nearest
            continue
        words = (seed, group_index, position, name_word(name), int(st["step"]))
        _stochastic_write(stored, working, words)


def _stochastic_write(stored, working, words):
    """stored <- SR(working) with the stream of ``words`` (LP2); a DTensor by its local shard,
    the rank's mesh coordinate appended to the words."""
    if is_dtensor(stored):
        coordinate = stored.device_mesh.get_coordinate() or ()
        stored.to_local().copy_(stochastic_round(working.to_local(), stored.dtype,
                                                 stream_seed(*words, *coordinate)))
        return
    stored.copy_(stochastic_round(working, stored.dtype, stream_seed(*words)))


@torch.no_grad()
def write_state(group, group_index, position, stored, value, name, step):
    """``stored`` <- ``value`` outside a step (exact mode's refill of ``last_grad``): LP1 with
    the stream (``name``, ``step``) when the group rounds stochastically and ``stored`` is
    narrower than ``value``, else ``copy_``."""
    if group["state_rounding"] == "stochastic" and stored.dtype in ROUNDING_DTYPES and \
            value.dtype.itemsize > stored.dtype.itemsize:
        _stochastic_write(stored, value, (group["rounding_seed"], group_index, position,
                                          name_word(name), int(step)))
    else:
        stored.copy_(value)


# ------------------------------------------------------------------ load_state_dict

class _Shielded:
    """A state tensor passing through ``Optimizer.load_state_dict`` uncast: torch casts
    tensors (and the contents of dicts and iterables) to the parameter's dtype, not this."""
    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor


def _keeps_state_dtype(key, value):
    """A state entry stored in ``state_dtype``: not ``step`` (a CPU counter), ``prev_param``
    (x_{t-1}), ``previous_grad`` (a copy of ``.grad``), ``kahan_comp`` (the parameter's
    dtype) or a quantized buffer's codes and scales (``_unshielded``)."""
    return key not in PARAM_DTYPE_KEYS and torch.is_tensor(value) and value.is_floating_point()


def _unshielded(key, tensor, p, group):
    """A shielded entry on p's device in its stored dtype: codes stay uint8, scales float32,
    the rest in the group's ``state_dtype`` (or p's dtype)."""
    if quantized_state.is_quantized_entry(key):
        dtype = torch.uint8 if key.endswith(quantized_state.CODES) else torch.float32
        return tensor.to(device=p.device, dtype=dtype)
    return tensor.to(device=p.device, dtype=group["state_dtype"] or p.dtype)


def shield_state_dtype(optimizer, state_dict):
    """Load pre-hook (the last one): the state of saved groups with a ``state_dtype`` shielded
    from torch's cast, and every quantized buffer's codes (torch would make them floats) and
    scales (float32 whatever the parameter); the dict the caller's hooks returned, ids as they
    left them.  A saved group without the key (the authors' format, or ours from before the
    option) gets the constructor's ``state_dtype``, as ``__setstate__`` back-fills it into the
    loaded group."""
    state = dict(state_dict["state"])
    for group in state_dict["param_groups"]:
        dtype = group.get("state_dtype", optimizer.defaults.get("state_dtype"))
        for i in group["params"]:
            if i not in state_dict["state"]:
                continue
            state[i] = {key: _Shielded(value) if (
                            dtype is not None and _keeps_state_dtype(key, value)) or (
                            torch.is_tensor(value) and quantized_state.is_quantized_entry(key))
                        else value for key, value in state[i].items()}
    return {**state_dict, "state": state}


def unshield_state_dtype(optimizer):
    """Load post-hook (the first one): each parameter's shielded state on its device, in its
    group's ``state_dtype`` (the loaded group's: torch takes the saved hyperparameters)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p not in optimizer.state:
                continue
            st = optimizer.state[p]
            for key, value in st.items():
                if isinstance(value, _Shielded):
                    st[key] = _unshielded(key, value.tensor, p, group)


def load_state_dict_keeping_storage(optimizer, load, state_dict):
    """``load(state_dict)`` (torch's ``Optimizer.load_state_dict``) with the state kept in
    ``state_dtype``.  The caller's ``register_load_state_dict_pre_hook`` hooks run first and
    are honoured: the state is taken from the dict they return, through torch's own id map: a
    pre-hook of ours, run after theirs, wraps the state of every group with a ``state_dtype``
    so that torch's cast passes it by, and a post-hook, run before theirs, unwraps it."""
    pre = optimizer.register_load_state_dict_pre_hook(shield_state_dtype)  # after the caller's
    post = optimizer.register_load_state_dict_post_hook(unshield_state_dtype, prepend=True)
    try:
        load(state_dict)
    finally:
        pre.remove()
        post.remove()
