r"""transformers' own expert parallelism (``DistributedConfig(ep_size=...)``) read from the
structure it installs, for the fused-experts adapter (:mod:`.transformers`; the rule:
:mod:`.parallel`).

transformers 5 applies a model's ``base_model_ep_plan`` at ``from_pretrained``: the experts'
3-D parameters get the ``grouped_gemm`` style (``MoEParamShard``: a DTensor ``Shard(0)`` on
the ``ep`` mesh, ``module.num_experts`` set to the local count, ``_is_expert_parallel``), and
the experts module the ``ep_dispatch_experts`` style, which replaces the *instance's*
``forward`` by ``EpDispatchExpertsParallel.install_forward``'s ``ep_forward``. That forward
hands this rank's (token, expert) pairs to an ``EPImplementation`` built for the module; FSDP
then shards the stacks on the ``efsdp`` mesh beside ``ep`` (placements
``(_StridedShard(0), Shard(0))``), the layout torchtitan's EP has.

Training runs ``AllToAllEP`` (``ep_implementation="all_to_all"``, or ``"auto"`` where the EP
group does not share one batch, so that ``AutoEP`` always takes it): each pair is sent to the
rank holding its expert, and that rank calls the experts' **own** forward (the class's, held
as ``implementation.experts_forward``) once on the rows it received, with their *local*
expert ids (top-1) and unit weights; the routing weights are applied after the outputs come
back, so the gradient reaching that call's output is already w dL/dout. Those are exactly the
rows of the rank's EP chunk, so the capture hooks that call (:class:`DispatchedCall`), not
the module's: the module's own hooks see this rank's tokens with global expert ids, whose
rows other ranks multiply.

Found from structure only: the instance forward is transformers' ``ep_forward`` (module and
qualified name) closing over this very module; its implementation is exactly transformers'
``AllToAllEP`` (or an ``AutoEP`` with no all-reduce or Mega MoE path) calling this module's
class forward; its EP mesh is the one the parameters' ``ep`` dimension carries
(:func:`~.parallel.ep_problem`). Refused, naming it: ``AllReduceEP`` (every rank runs its
experts on a shared batch with the other ranks' routes masked to a sentinel id), Mega MoE, any
other implementation, and EP parameters without transformers' dispatch (sentinel ids).
"""
import inspect
import weakref

__all__ = ["Dispatch", "dispatch_of", "DispatchedCall"]

_EP_MODULE = "transformers.distributed.expert_parallel"
_EP_FORWARD = "EpDispatchExpertsParallel.install_forward.<locals>.ep_forward"
_ALL_TO_ALL, _AUTO = "AllToAllEP", "AutoEP"
#: {implementation: its installed _Site} (one per AllToAllEP, however many hooks)
_SITES = weakref.WeakKeyDictionary()


def _is(obj, qualname):
    kind = type(obj)
    return kind.__module__ == _EP_MODULE and kind.__qualname__ == qualname


class Dispatch:
    """transformers' EP dispatch of one experts module: ``implementation`` the
    ``AllToAllEP`` whose experts call is hooked, ``ep_mesh`` its EP mesh, ``experts`` E (all
    ranks' experts: the local count times the EP degree)."""

    def __init__(self, module, implementation):
        self.module, self.implementation = module, implementation
        self.ep_mesh = implementation.ep_mesh
        self.experts = module.num_experts * self.ep_mesh.size()


def _class_forward(module, fn):
    """Whether ``fn`` is the experts class's own forward bound to ``module`` (or our call
    site's wrapper of it)."""
    impl = getattr(fn, "_ep_implementation", None)
    site = None if impl is None else _SITES.get(impl)
    if site is not None:
        fn = site.original
    return getattr(fn, "__self__", None) is module and \
        getattr(fn, "__func__", None) is type(module).forward


def dispatch_of(module):
    """(:class:`Dispatch`, None) for an experts module under transformers' EP with an
    all-to-all dispatch, (None, why not) where EP is there in another form, (None, None)
    without EP."""
    forward = vars(module).get("forward")
    is_ep = (getattr(forward, "__module__", None), getattr(forward, "__qualname__", None)) == \
        (_EP_MODULE, _EP_FORWARD)
    if not is_ep:
        if getattr(module, "_is_expert_parallel", False):
            return None, ("expert parallelism without transformers' ep_dispatch_experts "
                          "forward (sentinel expert ids): the rows of the experts other ranks "
                          "hold are not here")
        return None, None
    closure = inspect.getclosurevars(forward).nonlocals
    impl = closure.get("implementation")
    if closure.get("module") is not module:
        return None, "transformers' EP forward installed for another module"
    if _is(impl, _AUTO):
        if impl.all_reduce is not None or impl.megamoe is not None:
            return None, ("transformers' AutoEP with an all-reduce or Mega MoE path (the EP "
                          "group shares one batch): ep_implementation='all_to_all' is followed")
        impl = impl.all_to_all
    if not _is(impl, _ALL_TO_ALL):
        return None, (f"transformers' EP implementation {type(impl).__qualname__}: only "
                      "AllToAllEP's dispatch is followed (AllReduceEP masks the other ranks' "
                      "routes to a sentinel expert on a shared batch)")
    if not _class_forward(module, impl.experts_forward):
        return None, "transformers' AllToAllEP calling another function than the experts' forward"
    if impl.num_local_experts != module.num_experts:
        return None, (f"transformers' AllToAllEP for {impl.num_local_experts} local experts, "
                      f"the module has {module.num_experts}")
    return Dispatch(module, impl), None


class _Site:
    """The wrappers installed on one AllToAllEP: its ``_dispatch_tokens`` notes the rows it
    dispatched, its ``experts_forward`` runs the class forward then every hook."""

    def __init__(self, module, impl):
        self.module = weakref.ref(module)
        self.impl, self.original = impl, impl.experts_forward
        self.hooks, self.dispatched, self._next = {}, None, 0

        def dispatch_tokens(*args, **kwargs):
            out = type(impl)._dispatch_tokens(impl, *args, **kwargs)
            self.dispatched = out[0]
            return out

        def experts_forward(hidden, top_k_index, top_k_weights):
            output = self.original(hidden, top_k_index, top_k_weights)
            args = self._rows_of(hidden, top_k_index, top_k_weights)
            for hook in list(self.hooks.values()):
                hook(self.module(), args, {}, output)
            return output
        experts_forward._ep_implementation = impl
        impl.experts_forward, impl._dispatch_tokens = experts_forward, dispatch_tokens

    def _rows_of(self, hidden, top_k_index, top_k_weights):
        """The call's inputs as the rows the dispatch delivered: all of them, or none for the
        call AllToAllEP makes on a placeholder row when it received nothing (to keep the empty
        rows connected to the backward)."""
        dispatched, self.dispatched = self.dispatched, None
        if hidden is dispatched:
            return hidden, top_k_index, top_k_weights
        if dispatched is not None and dispatched.shape[0] == 0:
            return hidden[:0], top_k_index[:0], top_k_weights[:0]
        raise RuntimeError("transformers' AllToAllEP called the experts on rows its dispatch "
                           "did not produce: their provenance is unknown")

    def add(self, hook):
        self._next += 1
        self.hooks[self._next] = hook
        return self._next

    def remove(self, key):
        self.hooks.pop(key, None)
        if not self.hooks:  # the last hook: transformers' own methods back
            self.impl.experts_forward = self.original
            del self.impl._dispatch_tokens
            _SITES.pop(self.impl, None)


class _Handle:
    def __init__(self, site, key):
        self.site, self.key = site, key

    def remove(self):
        if self.site is not None:
            self.site.remove(self.key)
            self.site = None


class DispatchedCall:
    """The AllToAllEP's call of the experts' own forward on this rank's dispatched rows, as a
    hook target: ``register_forward_hook(hook, with_kwargs=True)`` calls ``hook(module,
    (rows, local expert ids, weights), {}, output)`` after each such call (module
    docstring); the handle's ``remove`` takes it off (the last one restores transformers'
    methods)."""

    def __init__(self, dispatch):
        self.dispatch = dispatch

    def register_forward_hook(self, hook, *, with_kwargs=False):
        if not with_kwargs:
            raise ValueError("DispatchedCall hooks take (module, args, kwargs, output)")
        impl = self.dispatch.implementation
        site = _SITES.get(impl)
        if site is None:
            site = _SITES[impl] = _Site(self.dispatch.module, impl)
        return _Handle(site, site.add(hook))
