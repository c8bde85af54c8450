"""The checkpoint methods of a preconditioner (MKOR, K-FAC): its ``state_dict`` is the backbone's
with the preconditioner's own state laid out on the parameters (:mod:`.state_layout`), so it
travels wherever per-parameter state does (``torch.save``, DCP, torchtitan's flat FQN layout);
``init_state`` creates the backbone's state without a counted step. A mixin of
:class:`~.wrapper.PreconditionedOptimizer`, which supplies ``optimizer``, ``param_groups``,
``_layers``, ``_state_key``, ``_capture`` and the subclass's ``_preconditioner_state`` /
``load_preconditioner_state_dict``."""
import warnings

from .state_layout import collect, packed_index, place, saved_param_ids

__all__ = ["Checkpoints"]


class Checkpoints:
    """``state_dict`` / ``load_state_dict`` / ``init_state`` of a preconditioner (module
    docstring)."""

    def init_state(self):
        """Create the backbone's state as its first step would, without stepping: torchtitan's
        and DCP's ``init_optim_state`` step an optimizer whose ``state`` is empty (zero
        gradients, lr 0), which would count a step here and in the backbone; after this they
        see state and do nothing. The preconditioner's own state exists from construction."""
        from torch_impl.common.optim_state import init_backbone_state
        init_backbone_state(self.optimizer)

    def _layer_weights(self):
        """{layer name: the parameter its state rides on} (its weight)."""
        return {layer.name: layer.module.weight for layer in self._layers}

    def _first_param(self):
        return next((p for g in self.param_groups for p in g["params"]), None)

    def _entries(self, clone):
        """{param: {name: entry}}: this preconditioner's state laid out on the parameters."""
        return place(self._preconditioner_state(clone), self._layer_weights(),
                     self._first_param(), self._state_key)

    def _write_entry(self, param, name, value):
        """``state[param][name] = value`` for one of this preconditioner's entries: load it."""
        own = self._preconditioner_state(clone=False)
        if name == self._state_key:
            layer = next(n for n, w in self._layer_weights().items() if w is param)
            own = dict(own, layers=dict(own["layers"], **{layer: value}))
        else:
            own = dict(own, **value)
        self.load_preconditioner_state_dict(own)

    def preconditioner_state_dict(self):
        """This preconditioner's own state (copies): ``{"layers": {name: state}, ...}``."""
        return self._preconditioner_state(clone=True)

    def state_dict(self):
        """The backbone's ``state_dict()`` with this preconditioner's state on the parameters
        (:mod:`.state_layout`): each layer's under ``_state_key`` (``"mkor"`` / ``"kfac"``) on
        its weight, the run's under ``_state_key + "_run"`` on the first parameter. One
        checkpoint resumes both, and it travels wherever per-parameter state does:
        ``torch.save``, DCP's ``get_state_dict`` / ``set_state_dict``, torchtitan's flat
        FQN-keyed layout."""
        for hook in self._optimizer_state_dict_pre_hooks.values():  # as torch.optim does
            hook(self)
        state = self.optimizer.state_dict()
        index = packed_index(self.param_groups)
        packed = dict(state["state"])  # the backbone's live per-parameter dicts: not mutated
        for param, entry in self._entries(clone=True).items():
            i = index[id(param)]
            packed[i] = dict(packed.get(i, {}), **entry)
        state["state"] = packed
        for hook in self._optimizer_state_dict_post_hooks.values():
            state = hook(self, state) or state
        return state

    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict` output. A plain backbone ``state_dict`` loads too (the
        preconditioner then keeps its state, with a warning), and so do the earlier layouts:
        a top-level ``_state_key`` entry (with a copy in the first param group) and the
        preconditioner-only ``{"steps", "layers", ..., "optimizer"?}``."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():  # as torch.optim does
            state_dict = hook(self, state_dict) or state_dict
        state = dict(state_dict)
        own = state.pop(self._state_key, None)
        groups = state.get("param_groups")
        if groups and self._state_key in groups[0]:  # the earlier copy carried through DCP
            first = dict(groups[0])
            carried = first.pop(self._state_key)
            state["param_groups"] = [first] + list(groups[1:])
            own = carried if own is None else own
        if own is None and "layers" in state and "param_groups" not in state:
            own, state = state, state.get("optimizer")
        if state is not None and "state" in state:
            saved_ids = saved_param_ids(state, self.param_groups)
            by_id = {saved_ids[id(w)]: name for name, w in self._layer_weights().items()}
            state["state"], placed = collect(state["state"], by_id, self._state_key)
            own = placed if placed is not None else own
        if own is None:
            warnings.warn(f"{type(self).__name__}.load_state_dict: no '{self._state_key}' entry: "
                          "only the backbone's state was loaded", UserWarning, stacklevel=2)
        backup = self.preconditioner_state_dict()
        try:  # the preconditioner first: a mismatch leaves the backbone untouched
            if own is not None:
                self.load_preconditioner_state_dict(own)
            if state is not None and "param_groups" in state:
                self.optimizer.load_state_dict(state)
        except Exception:
            self.load_preconditioner_state_dict(backup)
            raise
        self._capture.refresh()  # the restored step count decides the next capture
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)
