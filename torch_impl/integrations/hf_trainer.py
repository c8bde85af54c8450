r"""MKOR and K-FAC for ``transformers.Trainer(optimizer_cls_and_kwargs=(factory, kwargs))``.

transformers (5.x, ``Trainer.create_optimizer``) treats a first element that is not a
``torch.optim.Optimizer`` subclass as a *factory*: it calls ``factory()(model, **kwargs)``
with the Trainer's model and uses what comes back as the optimizer (MKOR and KFAC are
Optimizer subclasses themselves, so ``(MKOR, kwargs)`` would be called with parameter
groups instead of a model). On that path the Trainer passes neither its parameter groups
nor ``TrainingArguments.learning_rate`` / ``weight_decay``; it does build its lr scheduler
on the returned optimizer (the backbone's param groups), hands it to
``accelerator.prepare``, and saves and loads its ``state_dict()`` in checkpoints (which
carry the preconditioner's state under ``"mkor"`` / ``"kfac"``). So::

    from torch_impl.integrations.hf_trainer import MKORFactory
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      optimizer_cls_and_kwargs=(MKORFactory, dict(
                          backbone=torch.optim.AdamW,
                          backbone_kwargs={"lr": 3e-4, "weight_decay": 0.01},
                          inv_freq=10)))

builds ``MKOR(model, AdamW(groups, lr=3e-4, weight_decay=0.01), inv_freq=10)``. The keywords:

* ``backbone``: the backbone optimizer's class (``torch.optim.AdamW``, ``torch_impl.MARS``,
  ...), a ``torch.optim.Optimizer`` subclass that is not itself a preconditioner;
* ``backbone_kwargs``: its keywords under their own names; ``lr`` is required (the
  Trainer's ``learning_rate`` does not reach this path); ``params`` is not allowed;
* ``group_weight_decay`` (default True): split the trainable parameters into the Trainer's
  own two groups, its ``get_decay_parameter_names`` (no decay for biases and normalisation
  weights) with ``backbone_kwargs["weight_decay"]`` and the rest with 0.0, as the Trainer
  does for its built-in optimizers; False: one group of every trainable parameter;
* every other keyword is MKOR's / KFAC's own option, under its own name.

Every invalid keyword raises ``ValueError`` naming it, when the factory is called (the
Trainer calls it at the start of ``train()``); :meth:`PreconditionerFactory.check`
validates the keywords without a model, e.g. before building the Trainer.

Under accelerate's FSDP2 the Trainer builds the optimizer *before* ``prepare`` shards the
model, and accelerate switches the backbone's parameters for the sharded ones; MKOR and
K-FAC follow that switch at their first step (``torch_impl/kronecker/placement.py``).
"""
import inspect

import torch

from ..baselines import KFAC
from ..mkor import MKOR
from ..kronecker.optimizer import PreconditionedOptimizer

__all__ = ["PreconditionerFactory", "MKORFactory", "KFACFactory"]

_FACTORY_KEYWORDS = ("backbone", "backbone_kwargs", "group_weight_decay")


class PreconditionerFactory:
    """The factory shape ``transformers.Trainer`` calls: ``Factory()(model, **kwargs)``
    (module docstring). Subclasses set :attr:`preconditioner` (``MKOR`` or ``KFAC``)."""

    preconditioner = None

    @classmethod
    def options(cls):
        """The preconditioner's own keyword names (its keyword-only parameters)."""
        signature = inspect.signature(cls.preconditioner.__init__)
        return tuple(n for n, p in signature.parameters.items()
                     if p.kind is inspect.Parameter.KEYWORD_ONLY)

    @classmethod
    def check(cls, backbone=None, backbone_kwargs=None, group_weight_decay=True, **options):
        """Validate the keywords without a model; returns ``(cls, kwargs)`` ready for
        ``Trainer(optimizer_cls_and_kwargs=...)``."""
        name = cls.preconditioner.__name__
        if not (isinstance(backbone, type) and issubclass(backbone, torch.optim.Optimizer)):
            raise ValueError(f"{cls.__name__}: backbone must be a torch.optim.Optimizer "
                             f"subclass (e.g. torch.optim.AdamW), got {backbone!r}")
        if issubclass(backbone, PreconditionedOptimizer):
            raise ValueError(f"{cls.__name__}: backbone {backbone.__name__} is itself a "
                             f"preconditioner; pass the optimizer {name} should wrap")
        if backbone_kwargs is None:
            backbone_kwargs = {}
        if not isinstance(backbone_kwargs, dict):
            raise ValueError(f"{cls.__name__}: backbone_kwargs must be a dict of "
                             f"{backbone.__name__}'s keywords, got {backbone_kwargs!r}")
        if "params" in backbone_kwargs:
            raise ValueError(f"{cls.__name__}: backbone_kwargs must not hold 'params': the "
                             "parameters come from the Trainer's model")
        if "lr" not in backbone_kwargs:
            raise ValueError(f"{cls.__name__}: backbone_kwargs needs 'lr': Trainer's "
                             "optimizer_cls_and_kwargs path does not pass "
                             "TrainingArguments.learning_rate to the optimizer")
        if not isinstance(group_weight_decay, bool):
            raise ValueError(f"{cls.__name__}: group_weight_decay must be True or False, "
                             f"got {group_weight_decay!r}")
        known = cls.options()
        for key in options:
            if key not in known:
                hint = (" (the backbone's keywords go in backbone_kwargs)"
                        if key in inspect.signature(backbone.__init__).parameters else "")
                raise ValueError(f"{cls.__name__}: unknown keyword {key!r}: not an option "
                                 f"of {name}{hint}")
        kwargs = dict(options, backbone=backbone, backbone_kwargs=dict(backbone_kwargs),
                      group_weight_decay=group_weight_decay)
        return cls, kwargs

    def __call__(self, model, **kwargs):
        """``preconditioner(model, backbone(groups, **backbone_kwargs), **options)``."""
        _, kwargs = self.check(**kwargs)
        backbone = kwargs.pop("backbone")
        backbone_kwargs = kwargs.pop("backbone_kwargs")
        groups = parameter_groups(model, backbone_kwargs, kwargs.pop("group_weight_decay"))
        optimizer = backbone(groups, **backbone_kwargs)
        return self.preconditioner(model, optimizer, **kwargs)


def parameter_groups(model, backbone_kwargs, group_weight_decay=True):
    """The trainable parameters as ``transformers.Trainer.create_optimizer`` groups them:
    with ``group_weight_decay`` and a ``weight_decay`` in ``backbone_kwargs``, the Trainer's
    decay parameters (``Trainer.get_decay_parameter_names``) with that decay and the rest
    with 0.0; else one group."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not group_weight_decay or "weight_decay" not in backbone_kwargs:
        return [{"params": [p for _, p in params]}]
    from transformers import Trainer
    decay = set(Trainer.get_decay_parameter_names(None, model))  # reads only the model
    return [{"params": [p for n, p in params if n in decay],
             "weight_decay": backbone_kwargs["weight_decay"]},
            {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0}]


class MKORFactory(PreconditionerFactory):
    """``optimizer_cls_and_kwargs=(MKORFactory, {"backbone": ..., "backbone_kwargs": {...},
    **mkor_options})``."""

    preconditioner = MKOR


class KFACFactory(PreconditionerFactory):
    """``optimizer_cls_and_kwargs=(KFACFactory, {"backbone": ..., "backbone_kwargs": {...},
    **kfac_options})``."""

    preconditioner = KFAC
