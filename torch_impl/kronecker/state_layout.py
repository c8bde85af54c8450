r"""Where a preconditioner's state lives in an optimizer state dict: on the parameters.

Checkpointing tools do not carry extra top-level keys. ``torch.distributed.checkpoint``'s
``get_state_dict`` keeps ``state`` and ``param_groups``; torchtitan's flat layout keeps
``state.{fqn}.{name}`` and ``param_groups.{fqn}.{key}`` and, on load, asks the *live*
optimizer which ``state`` names each parameter has. So MKOR's and K-FAC's state is laid out
per parameter, as a backbone's own state is:

* each layer's factors and counters ride on that layer's weight, under the preconditioner's
  key (``"mkor"`` / ``"kfac"``): ``state[w]["mkor"] = {"L_inv": ..., ...}``;
* the run's own counters (step count, MKOR-H's switch, buffered losses, loss scale) ride on
  the first parameter of the first non-empty group, under ``"mkor_run"`` / ``"kfac_run"``.

A layer whose factors another rank owns (``factor_placement="owner"``) has no entry here, so
each entry is held by one rank and DCP saves the owner's copy.

:class:`StateView` is ``optimizer.state`` of a preconditioner: the backbone's per-parameter
state with these entries added, read live (no copies); writes of the backbone's own keys go to
the backbone, writes of the preconditioner's keys load that entry into the preconditioner (as
a tool that moves optimizer state to a device does). ``bool(view)`` is the backbone's: state
counts as initialised once the backbone has some, which is what torchtitan's and DCP's
``init_optim_state`` test before their zero-gradient step.
"""
import copy
from collections.abc import MutableMapping

__all__ = ["StateView", "packed_index", "place", "collect", "saved_param_ids"]


def packed_index(param_groups):
    """{id(param): index} in torch's ``state_dict`` packing order (groups in order, params in
    order, numbered from 0)."""
    order = [p for group in param_groups for p in group["params"]]
    return {id(p): i for i, p in enumerate(order)}


def saved_param_ids(state_dict, param_groups):
    """{id(live param): the key the checkpoint gives it}: the checkpoint's group ``params``
    lists matched to the live groups in order, as ``torch.optim.Optimizer.load_state_dict``
    matches them (keys are the packing indices of ``state_dict()``, or the FQNs DCP's
    ``set_state_dict`` hands over)."""
    saved = [k for g in state_dict.get("param_groups", []) for k in g["params"]]
    live = [p for g in param_groups for p in g["params"]]
    if len(saved) != len(live):
        raise ValueError(f"state_dict: its {len(saved)} parameters do not match the {len(live)} "
                         "here (a different model or optimizer?)")
    return {id(p): k for p, k in zip(live, saved)}


def run_key(key):
    return f"{key}_run"


def place(own, weights, first, key):
    """{param: {name: entry}} for a preconditioner state ``own`` (``{"layers": {layer name:
    state}, **run}``): each non-empty layer state on its weight ``weights[name]``, the run's
    entries on ``first`` (no run entry if there is no parameter at all)."""
    entries = {}
    for name, layer in own["layers"].items():
        if layer:
            entries.setdefault(weights[name], {})[key] = layer
    if first is not None:
        entries.setdefault(first, {})[run_key(key)] = {k: v for k, v in own.items()
                                                       if k != "layers"}
    return entries


def collect(per_param, index_to_layer, key):
    """Take the preconditioner's entries out of a saved ``state`` (``{key: {name: value}}``)
    and return ``(backbone_state, own)``: ``own`` is ``None`` if no run entry is there (a
    backbone checkpoint), else ``{"layers": {name: state or {}}, **run}`` with every layer of
    ``index_to_layer`` named (``{}`` where the checkpoint holds none of it)."""
    backbone, layers, run = {}, {}, None
    for index, entry in per_param.items():
        entry = dict(entry)
        found = entry.pop(key, None)
        if found is not None:
            name = index_to_layer.get(index)
            if name is None:
                raise ValueError(f"state_dict: parameter {index} carries '{key}' state but is "
                                 "not the weight of a preconditioned layer here: the "
                                 "checkpoint's layers do not match the preconditioned modules "
                                 "(a different model or parameter order?)")
            layers[name] = found
        carried = entry.pop(run_key(key), None)
        if carried is not None:
            if run is not None:
                raise ValueError(f"state_dict: two '{run_key(key)}' entries")
            run = carried
        if entry:
            backbone[index] = entry
    if run is None:
        if layers:
            raise ValueError(f"state_dict: layer state under '{key}' without its "
                             f"'{run_key(key)}' entry (step count, switch)")
        return backbone, None
    return backbone, dict(run, layers={name: layers.get(name, {})
                                       for name in index_to_layer.values()})


class _ParamState(MutableMapping):
    """One parameter's state: the backbone's entry plus the preconditioner's."""

    def __init__(self, backbone_state, param, extra, write_extra):
        self._backbone, self._param = backbone_state, param
        self._extra, self._write_extra = extra, write_extra

    def _base(self):
        return self._backbone.get(self._param, {})

    def __getitem__(self, name):
        if name in self._extra:
            return self._extra[name]
        return self._base()[name]

    def __setitem__(self, name, value):
        if name in self._extra:
            self._write_extra(self._param, name, value)
            self._extra[name] = value
        else:
            self._backbone[self._param][name] = value

    def __delitem__(self, name):
        if name in self._extra:
            raise KeyError(f"{name!r} is the preconditioner's state and cannot be deleted")
        del self._backbone[self._param][name]

    def __iter__(self):
        yield from self._base()
        yield from (k for k in self._extra if k not in self._base())

    def __len__(self):
        return len(set(self._base()) | set(self._extra))

    def __repr__(self):
        return repr(dict(self))

    def __deepcopy__(self, memo):  # a copy is plain data: it is nobody's live state
        return copy.deepcopy(dict(self), memo)


class StateView(MutableMapping):
    """``optimizer.state`` of a preconditioner (module docstring). ``entries()`` returns the
    live ``{param: {name: entry}}`` of :func:`place`; ``write(param, name, value)`` loads one
    entry into the preconditioner."""

    def __init__(self, backbone, entries, write):
        self._opt, self._entries, self._write = backbone, entries, write

    @property
    def _state(self):
        return self._opt.state

    def __getitem__(self, param):
        extra = self._entries().get(param)
        if not extra:
            return self._state[param]  # a defaultdict, as torch.optim's
        return _ParamState(self._state, param, extra, self._write)

    def __setitem__(self, param, value):
        self._state[param] = value

    def __delitem__(self, param):
        del self._state[param]

    def __contains__(self, param):
        return param in self._state or param in self._entries()

    def __iter__(self):
        yield from self._state
        yield from (p for p in self._entries() if p not in self._state)

    def __len__(self):
        return len(set(map(id, self._state)) | set(map(id, self._entries())))

    def __bool__(self):
        return bool(self._state)

    def __repr__(self):
        return f"StateView({len(self)} parameters)"

    def __deepcopy__(self, memo):
        return {p: copy.deepcopy(self[p], memo) for p in self}
