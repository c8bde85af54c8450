r"""What every fused-experts layout shares: a projection as a layer, and the adapter protocol.

A fused experts module holds E expert linear layers per projection as one 3-D parameter.
Each layout (transformers 5's ``use_experts_implementation`` classes, :mod:`.transformers`;
torchtitan's ``GroupedExperts``, :mod:`.torchtitan`) is described by one
:class:`ExpertsLayout` adapter (kfac-pytorch's layer-adapter pattern): how to recognise the
module, what it declares and what contradicts it, its projections, how one call's inputs bind
to its forward, and how that call's rows of every projection are recomputed from the inputs
and the gradient of its output. Discovery (:mod:`torch_impl.kronecker.discovery`) and the
capture (:mod:`torch_impl.kronecker.capture.experts`) only talk to the adapter, so both layouts
share one machinery.
"""
import torch

from ..layers import LayerType

__all__ = ["ExpertProjection", "FusedExpertsType", "ExpertsLayout", "product_dtype"]


class ExpertProjection:
    """One projection of a fused experts module as a layer-like object: ``weight`` the 3-D
    parameter, ``bias`` its (E, d_out) bias or None, ``transposed`` whether the experts are
    stored (E, d_in, d_out), ``layout`` the module's :class:`ExpertsLayout`, ``training`` the
    module's, ``expert_shard`` the :class:`~.parallel.ExpertShard` of a stack under expert
    parallelism (None: every expert is seen and held here)."""

    def __init__(self, experts, weight_name, layout, bias_name=None, transposed=False,
                 shard=None):
        self.experts, self.weight_name, self.layout = experts, weight_name, layout
        self.expert_shard = shard
        self.weight = getattr(experts, weight_name)
        self.bias = None if bias_name is None else getattr(experts, bias_name, None)
        self.transposed = bool(transposed)

    @property
    def training(self):
        return self.experts.training

    def __repr__(self):
        return f"ExpertProjection({type(self.experts).__name__}.{self.weight_name})"


class FusedExpertsType(LayerType):
    """One projection of a fused experts module: E linear layers (module docstring)."""

    name = "experts"

    def matches(self, module):
        return isinstance(module, ExpertProjection)

    def stack(self, module):
        shard = module.expert_shard  # EP: the experts of this rank's chunk
        return module.weight.shape[0] if shard is None else shard.n_seen

    def shape(self, module):
        _, rows, cols = module.weight.shape
        return (cols, rows) if module.transposed else (rows, cols)

    def as_matrix(self, module, weight_like):
        return weight_like.mT if module.transposed else weight_like


class ExpertsLayout:
    """The adapter of one fused-experts layout. Subclasses define every method."""

    #: a short name used in messages
    name = "fused experts"

    def matches(self, module):
        """Whether ``module`` is of this layout (from its structure, never its shapes alone)."""
        raise NotImplementedError

    def problem(self, module, parent=None):
        """None if the capture can follow the module (``parent``: the module holding it, for
        what sits beside it), else why not (``skip_reasons``)."""
        raise NotImplementedError

    def projections(self, module, parent=None):
        """[(parameter name, :class:`ExpertProjection`)], in the order :meth:`rows` returns
        their rows (``parent``: the module holding it, whose dispatcher may place it)."""
        raise NotImplementedError

    def hook_target(self, module, shard=None):
        """What the capture's forward hook goes on: the object whose forward hooks see each
        call of the experts' forward on the rows it multiplies, as ``hook(module, args,
        kwargs, output)``. The module itself, unless an expert-parallel dispatch inside its
        forward hands the experts other rows (``shard``: the projections'
        :class:`~.parallel.ExpertShard`)."""
        return module

    def bind(self, module, args, kwargs, shard=None):
        """One call's inputs, bound by name to the class's forward; the first is the tensor
        whose leading dimensions index the call's rows (its token mask's layout). ``shard``:
        the projections' :class:`~.parallel.ExpertShard` (expert parallelism), or None."""
        raise NotImplementedError

    def observe(self, module, inputs):
        """What :meth:`rows` needs to know of the arithmetic the call's forward really ran
        (read in the forward hook, from the forward itself), or None when the layout fixes
        it (torchtitan's explicit bf16 grouped mms)."""
        return None

    def rows(self, module, inputs, grad_out, arithmetic=None, shard=None):
        """``(token, expert, rows)`` of one call: ``token`` (S,) each row's index into the
        flattened leading dimensions of ``inputs[0]``, ``expert`` (S,) its expert (under
        expert parallelism, its index in the ``shard``'s chunk), ``rows``
        one ``(a, g)`` of (S, d) per projection. Raises on what the rows cannot be (expert
        parallelism). Runs under the forward's autocast state; ``arithmetic`` is what
        :meth:`observe` read of the call."""
        raise NotImplementedError


def product_dtype(rows, weight):
    """The dtype of the forward's product rows @ W (before any bias): the autocast dtype
    under autocast. The weight's gradient is formed from the gradient of that product, which
    autograd rounds to it (a bf16 product plus a float32 bias: a float32 sum whose gradient
    reaches the product in bf16)."""
    device = rows.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(rows.dtype, weight.dtype)
