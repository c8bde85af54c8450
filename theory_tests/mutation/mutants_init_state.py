"""Mutants of ``init_state()`` (``MARS``, ``MARSM``, ``LAMB``): the state a torchtitan / DCP
init step finds already there, so that its zero-gradient step does nothing; keyed by the
``paper_notes/claims.md`` row PORT-INIT-STATE.  Each is a one-line bug of the method itself
(the state creation it shares with ``step`` is left to the rows of the step)."""
from .mutant import Mutant

__all__ = ["INIT_STATE_MUTANTS"]

T_MARS, T_MM = "torch_impl/mars/mars.py", "torch_impl/mars/mars_m.py"
T_LAMB = "torch_impl/baselines/lamb.py"

_MARS_LOOP = "            for _ in self._create_state(group, fresh):\n                pass"
_MARS_FILTER = ('            fresh = [p for p in group["params"] if p.requires_grad and '
                'not self.state.get(p)]')
_LAMB_LOOP = ("                                         if p.requires_grad and "
              "not self.state.get(p)]):\n                pass")
_LAMB_FILTER = "                                         if p.requires_grad and not self.state.get(p)]):"


def _mars_family(path, buffer):
    """The same bugs in MARS and MARSM (``buffer``: a state key every route has)."""
    return [
        # the counter starts at 1: the init step's t = 2 again
        Mutant(path, _MARS_LOOP,
               '            for p, _, st, *_ in self._create_state(group, fresh):\n'
               '                st["step"].fill_(1.0)'),
        # last_grad initialised to the parameter instead of 0 (g_prev of step 1)
        Mutant(path, _MARS_LOOP,
               '            for p, _, st, *_ in self._create_state(group, fresh):\n'
               '                if "last_grad" in st: st["last_grad"].copy_(p)'),
        # a state key missing (the next step creates it: the state dict is not the first's)
        Mutant(path, _MARS_LOOP,
               '            for p, _, st, *_ in self._create_state(group, fresh):\n'
               f'                st.pop("{buffer}", None)'),
        # frozen parameters (never a gradient, nor from the init step) given state
        Mutant(path, _MARS_FILTER,
               '            fresh = [p for p in group["params"] if not self.state.get(p)]'),
        # the state a parameter already has thrown away (not idempotent, a resumed run reset)
        Mutant(path, _MARS_FILTER,
               '            fresh = [p for p in group["params"] if p.requires_grad and '
               'not self.state.pop(p, None)]'),
        # only the first group
        Mutant(path, "        for group in self.param_groups:\n            fresh = [",
               "        for group in self.param_groups[:1]:\n            fresh = ["),
    ]


T_EX = "torch_impl/mars/exact_mode.py"
_PLACEHOLDERS = "            exact_mode.init_previous_iterates(self, fresh)"

INIT_STATE_MUTANTS = {
    "PORT-INIT-STATE": _mars_family(T_MARS, "exp_avg") + _mars_family(T_MM, "momentum_buffer") + [
        # exact mode's prev_param not named by init_state (MARS, MARSM): a DCP template
        # drops the checkpoint's x_{t-1} and the resumed closure loop skips its re-evaluation
        Mutant(T_MARS, _PLACEHOLDERS, "            pass"),
        Mutant(T_MM, _PLACEHOLDERS, "            pass"),
        # the placeholder taken for x_{t-1} (presence alone): step 1 re-evaluates at zeros
        Mutant(T_EX, '    return "prev_param" in st and float(st.get("step", 0)) > 0',
               '    return "prev_param" in st'),
        # the placeholder never filled at the tensor's first step
        Mutant(T_EX, '                st["prev_param"].copy_(p.detach())', "                pass"),
        # approx mode given an x_{t-1} buffer it never reads (a parameter's worth of memory)
        Mutant(T_EX, '    if opt.param_groups[0]["is_approx"]:\n        return\n    for p in params:',
               '    if False:\n        return\n    for p in params:'),
        # MARS: existing state cast to a state_dtype the group took since (a step would;
        # init_state leaves existing state as it is)
        Mutant(T_MARS, _MARS_FILTER,
               '            fresh = [p for p in group["params"] if p.requires_grad]'),
        # LAMB: the counter at 1, exp_avg_sq missing, frozen parameters given state, existing
        # state reset, only the first group
        Mutant(T_LAMB, _LAMB_LOOP, _LAMB_LOOP.replace("pass", '_[1]["step"].fill_(1.0)')),
        Mutant(T_LAMB, _LAMB_LOOP, _LAMB_LOOP.replace("pass", '_[1].pop("exp_avg_sq")')),
        Mutant(T_LAMB, _LAMB_FILTER,
               "                                         if not self.state.get(p)]):"),
        Mutant(T_LAMB, _LAMB_FILTER,
               "                                         if p.requires_grad and "
               "not self.state.pop(p, None)]):"),
        Mutant(T_LAMB, "        for group in self.param_groups:\n            for _ in self._create_state(",
               "        for group in self.param_groups[:1]:\n            for _ in self._create_state("),
    ],
}
