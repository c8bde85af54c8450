"""``transformers.Trainer(optimizer_cls_and_kwargs=(MKORFactory | KFACFactory, kwargs))``
(``torch_impl/integrations/hf_trainer.py``) against the same preconditioner built by hand
and passed as ``optimizers=(pre, scheduler)``, on a tiny GPT-2 built offline from a config
(:mod:`hf_cases`), bit for bit (``torch.equal``): the Trainer's lr scheduler (linear, one
warmup step) drives the factory-built backbone, gradient accumulation (2 micro-batches per
step), the Trainer's weight-decay grouping, and a resume from the Trainer's own checkpoint
(``optimizer.pt``, written by ``torch.save(optimizer.state_dict())``) equal to the
uninterrupted run.
"""
import warnings

import pytest
import torch

from torch_impl.integrations.hf_trainer import KFACFactory, MKORFactory, parameter_groups
from torch_impl.mars import MARS
from torch_impl.mkor import MKOR
from torch_impl.baselines import KFAC

from theory_tests.support.hf_cases import equal_factors, factors_of, is_identity, lm_batch, tiny_gpt2

STEPS, SAVE = 4, 2
CASES = {  # kind: (factory, class, backbone, backbone_kwargs, options)
    "mkor": (MKORFactory, MKOR, torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1},
             {"inv_freq": 1, "stat_decay": 0.9}),
    "kfac": (KFACFactory, KFAC, torch.optim.SGD,
             {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01},
             {"inv_freq": 2, "damping": 0.01}),
    "mkor_mars": (MKORFactory, MKOR, MARS, {"lr": 0.003, "weight_decay": 0.1},
                  {"inv_freq": 2}),
}


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n=16):
        self.items = [{k: v[0] for k, v in lm_batch(200 + i, batch=1).items()} for i in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _args(out, weight_decay=0.0):
    from transformers import TrainingArguments
    return TrainingArguments(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, save_steps=SAVE,
                             save_strategy="steps", report_to=[], use_cpu=True, seed=0,
                             learning_rate=0.5, warmup_steps=1, lr_scheduler_type="linear",
                             weight_decay=weight_decay, disable_tqdm=True, logging_steps=100,
                             dataloader_num_workers=0)


def _trainers_groups(model, weight_decay):
    """The names in each param group of the Trainer's own default optimizer."""
    from transformers import Trainer
    trainer = Trainer(model=model, args=_args("unused", weight_decay))
    opt = trainer.create_optimizer()
    names = {id(p): n for n, p in model.named_parameters()}
    return [([names[id(p)] for p in g["params"]], g["weight_decay"]) for g in opt.param_groups]


def _train(kind, out, how, resume=None):
    from transformers import Trainer, get_scheduler
    factory, cls, backbone, backbone_kwargs, options = CASES[kind]
    model = tiny_gpt2(dtype=torch.float32)
    if how == "factory":
        kw = dict(optimizers=(None, None), optimizer_cls_and_kwargs=(factory, dict(
            backbone=backbone, backbone_kwargs=backbone_kwargs, **options)))
    else:  # by hand: the Trainer's own weight-decay groups, the same schedule
        params = dict(model.named_parameters())
        groups = [{"params": [params[n] for n in names], "weight_decay": wd}
                  for names, wd in _trainers_groups(model, backbone_kwargs["weight_decay"])]
        pre = cls(model, backbone(groups, **backbone_kwargs), **options)
        sched = get_scheduler("linear", pre, num_warmup_steps=1, num_training_steps=STEPS)
        kw = dict(optimizers=(pre, sched))
    trainer = Trainer(model=model, args=_args(out), train_dataset=_Tokens(), **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=resume)
    pre = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") and \
        not isinstance(trainer.optimizer, cls) else trainer.optimizer
    assert isinstance(pre, cls)
    return model, pre


def _carries(value, key):
    """Whether ``key`` is a key of some dict nested in ``value``."""
    if isinstance(value, dict):
        return key in value or any(_carries(v, key) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_carries(v, key) for v in value)
    return False


@pytest.mark.parametrize("kind", ["mkor", "kfac"])
def test_factory_equals_hand_built_and_resumes_bitwise(kind, tmp_path):
    """Factory-built vs built by hand: bit-identical parameters, factors and backbone state
    after 4 steps of 2 accumulated micro-batches under the linear schedule; and the factory
    run resumed from checkpoint-2 (a fresh model and factory-built preconditioner,
    ``optimizer.pt`` holding its state) ends bit-identical to the uninterrupted run."""
    model, pre = _train(kind, tmp_path / "factory", "factory")
    hand_model, hand = _train(kind, tmp_path / "hand", "hand")
    assert pre.steps == hand.steps == STEPS
    assert not all(is_identity(t) for pair in factors_of(pre).values() for t in pair)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), hand_model.parameters()))
    assert equal_factors(factors_of(pre), factors_of(hand))
    assert [g["lr"] for g in pre.param_groups] == [g["lr"] for g in hand.param_groups]
    assert pre.param_groups[0]["lr"] == 0.0  # the linear schedule reached its end
    saved = torch.load(tmp_path / "factory" / f"checkpoint-{SAVE}" / "optimizer.pt",
                       weights_only=True)
    assert _carries(saved, pre._state_key)  # whatever the layout (kronecker/optimizer.py)
    resumed_model, resumed = _train(kind, tmp_path / "resumed", "factory",
                                    resume=str(tmp_path / "factory" / f"checkpoint-{SAVE}"))
    assert resumed.steps == STEPS
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters()))
    assert equal_factors(factors_of(pre), factors_of(resumed))


def test_mars_backbone_equals_hand_built(tmp_path):
    """Our MARS as the backbone (its own ``lr`` and ``weight_decay``): factory == by hand."""
    model, pre = _train("mkor_mars", tmp_path / "factory", "factory")
    hand_model, hand = _train("mkor_mars", tmp_path / "hand", "hand")
    assert isinstance(pre.optimizer, MARS)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), hand_model.parameters()))
    assert equal_factors(factors_of(pre), factors_of(hand))


def test_weight_decay_groups_are_the_trainers():
    """``group_weight_decay=True`` gives exactly the groups of the Trainer's default
    optimizer (same parameters in the same order, same decays); False: one group; no
    ``weight_decay``: one group."""
    model = tiny_gpt2(dtype=torch.float32)
    names = {id(p): n for n, p in model.named_parameters()}
    ours = [([names[id(p)] for p in g["params"]], g["weight_decay"])
            for g in parameter_groups(model, {"lr": 1.0, "weight_decay": 0.3})]
    theirs = _trainers_groups(model, 0.3)
    assert ours == theirs and ours[0][0] and ours[1][0]
    pre = MKORFactory()(model, backbone=torch.optim.SGD,
                        backbone_kwargs={"lr": 1.0, "weight_decay": 0.3},
                        group_weight_decay=False)
    assert len(pre.param_groups) == 1 and pre.param_groups[0]["weight_decay"] == 0.3
    assert len(parameter_groups(model, {"lr": 1.0})) == 1


@pytest.mark.parametrize("kwargs,match", [
    (dict(backbone_kwargs={"lr": 1.0}), "backbone must be a torch.optim.Optimizer"),
    (dict(backbone=torch.optim.SGD), "backbone_kwargs needs 'lr'"),
    (dict(backbone="adamw", backbone_kwargs={"lr": 1.0}), "backbone must be"),
    (dict(backbone=MKOR, backbone_kwargs={"lr": 1.0}), "backbone MKOR is itself"),
    (dict(backbone=torch.optim.SGD, backbone_kwargs=[("lr", 1.0)]), "backbone_kwargs must be"),
    (dict(backbone=torch.optim.SGD, backbone_kwargs={"lr": 1.0, "params": []}), "'params'"),
    (dict(backbone=torch.optim.SGD, backbone_kwargs={"lr": 1.0}, momentum=0.9),
     "unknown keyword 'momentum'.*backbone_kwargs"),
    (dict(backbone=torch.optim.SGD, backbone_kwargs={"lr": 1.0}, inv_frq=3),
     "unknown keyword 'inv_frq'"),
    (dict(backbone=torch.optim.SGD, backbone_kwargs={"lr": 1.0}, group_weight_decay=1),
     "group_weight_decay"),
    (dict(backbone=torch.optim.SGD, backbone_kwargs={"lr": 1.0}, inv_freq=0), "inv_freq"),
])
def test_invalid_keywords_raise_value_error_naming_them(kwargs, match):
    model = tiny_gpt2(dtype=torch.float32, n_layer=1)
    with pytest.raises(ValueError, match=match):
        MKORFactory()(model, **kwargs)


def test_check_validates_without_a_model():
    """``check`` returns the Trainer tuple, and refuses what the call would refuse."""
    cls, kwargs = KFACFactory.check(backbone=torch.optim.SGD, backbone_kwargs={"lr": 0.1},
                                    damping=0.01)
    assert cls is KFACFactory and kwargs["damping"] == 0.01
    with pytest.raises(ValueError, match="unknown keyword 'stat_decay'.*KFAC"):
        KFACFactory.check(backbone=torch.optim.SGD, backbone_kwargs={"lr": 0.1},
                          stat_decay=0.9)
