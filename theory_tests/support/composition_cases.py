"""The composition matrix's runs (issue 20 item 5): :func:`run` trains a case's model for a
few steps (SGD backbone with momentum, ``inv_freq=1``, MKOR with ``factor_dtype="float64"``)
under one loop feature and returns a :class:`Result`: the final parameters and the
preconditioner's statistics at every step; :func:`ddp_job` is the body of one gloo rank of the
DDP cells; :func:`compare` measures two runs' differences. The models, batches and cases are in
:mod:`composition_models`, the independent statistics in :mod:`composition_observer`; both are
re-exported here.
"""
import contextlib
import dataclasses
import logging
import math
import time
import warnings

import torch

from torch_impl.baselines import KFAC

from torch_impl.mkor import MKOR

from theory_tests.support.hf_cases import snapshot


from theory_tests.support.composition_models import (CASES, DEC_LENGTHS, FEATURES, KINDS, LENGTHS, MODELS,
                                NOT_APPLICABLE, REORDER_TOL, Case, ExpertRows, HashMoE,
                                hash_moe, hash_moe_batch, image_batch, seq2seq_batch,
                                tiny_albert, tiny_llama, tiny_moe, tiny_t5, tiny_vit)
from theory_tests.support.composition_observer import Observer, oracle_errors
from theory_tests.support.composition_rows import default_loss

f64 = torch.float64

__all__ = ["MODELS", "FEATURES", "KINDS", "NOT_APPLICABLE", "CASES", "Case", "Result",
           "Observer", "HashMoE", "LENGTHS", "DEC_LENGTHS", "tiny_llama", "tiny_t5", "tiny_vit",
           "tiny_albert", "tiny_moe", "seq2seq_batch", "image_batch", "make_preconditioner",
           "run", "ddp_job", "compare", "counters_of", "ExpertRows", "hash_moe",
           "hash_moe_batch", "oracle_errors", "statistics_of", "describe", "max_abs_pairs",
           "max_rel_pairs", "REORDER_TOL", "total_count"]

# -- runs -------------------------------------------------------------------------------------
PRECONDITIONERS = {"mkor": MKOR, "kfac": KFAC}


def make_preconditioner(kind, model, lr=0.05, **kwargs):
    """MKOR (factor_dtype float64) or K-FAC on an SGD backbone (momentum 0.9) over the
    trainable parameters, ``inv_freq=1`` unless given: a factor update at every step."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
    if kind == "mkor":
        kwargs.setdefault("factor_dtype", "float64")
    kwargs.setdefault("inv_freq", 1)
    return PRECONDITIONERS[kind](model, opt, **kwargs)


def counters_of(pre):
    """The preconditioner's per-layer counters as Python ints (a stack of experts: a list,
    one per expert)."""
    return {name: {k: (int(v) if v.dim() == 0 else [int(x) for x in v.tolist()])
                   for k, v in c.items()} for name, c in pre.counters().items()}


def total_count(value):
    """A counter of :func:`counters_of` summed over a stack's experts."""
    return sum(value) if isinstance(value, list) else value


def _clone_pairs(d):
    return {n: tuple(None if t is None else t.detach().clone() for t in pair)
            for n, pair in d.items()}


def statistics_of(pre):
    """MKOR's inverse factors / K-FAC's factor EMAs, cloned."""
    return _clone_pairs(pre.inverse_factors() if isinstance(pre, MKOR) else pre.factors())


@dataclasses.dataclass
class Result:
    """What :func:`run` returns. ``pending``: MKOR's ``pending_vectors()`` before every step
    (K-FAC: its factor EMAs after every step, the statistics it exposes); ``factors``:
    ``inverse_factors()`` / ``factors()`` after every step; ``oracle``: the
    :class:`Observer`'s statistics per step (when observed); ``params`` / ``init``: the
    parameters after the run / before it; ``pre`` / ``model``: the preconditioner and the
    (peft-wrapped) model; ``unmatched``: the layers whose rows the Observer could not match
    to a token mask (when observed)."""

    kind: str
    params: dict
    init: dict
    pending: list
    factors: list
    oracle: list
    names: list
    pre: object = None
    model: object = None
    unmatched: set = None

    def statistics(self):
        return self.pending if self.kind == "mkor" else self.factors


def _split(batch, micro):
    n = next(iter(batch.values())).shape[0]
    return [{k: v[i * n // micro:(i + 1) * n // micro] for k, v in batch.items()}
            for i in range(micro)]


class _Recorder:
    """Records the statistics around each step (shared by every loop)."""

    def __init__(self, kind, pre, observer=None):
        self.kind, self.pre, self.observer = kind, pre, observer
        self.pending, self.factors, self.oracle = [], [], []

    def before_step(self):
        if self.kind == "mkor":
            self.pending.append(_clone_pairs(self.pre.pending_vectors()))
        if self.observer is not None:
            self.oracle.append(self.observer.step())

    def after_step(self):
        self.factors.append(statistics_of(self.pre))
        if self.kind == "kfac":
            self.pending.append(self.factors[-1])


def run(case, feature, kind, batches, *, seed=0, dtype=f64, micro=1, per_sample=False,
        observe=False, observe_rows=None, pre_kwargs=None, compile_kwargs=None, lora_rank=2,
        timer=None):
    """Train ``case`` (a :class:`Case` or its name) on ``batches`` (one optimizer step each)
    with preconditioner ``kind`` under loop ``feature``; returns a :class:`Result`.

    Features: "plain" (forward, backward, step, zero_grad), "padding" (the same loop: the
    batches carry the padding),
    "ckpt_reentrant" / "ckpt_nonreentrant" (the case's gradient checkpointing),
    "compile" (``torch.compile(model)``; the preconditioner hooks the original model),
    "lora" (peft LoRA on ``case.lora_targets``, random A and B, dropout 0; the preconditioner
    sees the adapted model), "accelerate" (``Accelerator(gradient_accumulation_steps=micro)``
    around model and preconditioner, each batch split in ``micro`` micro-batches),
    "lightning_bf16" (a LightningModule trained by ``pl.Trainer(precision="bf16-mixed")``),
    "autocast_bf16" (the hand-written loop with the forward under
    ``torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)``, the context
    Lightning's bf16-mixed plugin enters: Lightning's reference). ``micro`` > 1 with "plain"
    accumulates loss / micro over micro-batches by hand. ``per_sample`` applies the case's
    ``per_sample`` (ResNet: BatchNorm in eval mode) and asks its ``loss`` for a mean over
    samples (CLIP: the matching-pair logits), for runs that split batches and for their
    references. The model is called by ``case.loss`` (positionally, with a dict, ...). ``observe`` attaches an :class:`Observer`, with
    ``observe_rows`` in place of the case's ``rows`` rule when given. ``timer`` (a list) receives each
    step's wall time.
    """
    case = CASES[case] if isinstance(case, str) else case
    model = case.build(seed=seed, dtype=dtype)
    if per_sample and case.per_sample is not None:
        case.per_sample(model)
    if feature in ("ckpt_reentrant", "ckpt_nonreentrant"):
        case.checkpointing(model, feature == "ckpt_reentrant")
    if feature == "lora":
        from peft import LoraConfig, get_peft_model
        targets = case.lora_targets
        config = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0,
                            init_lora_weights=False, bias="none",
                            target_modules=targets[0] if len(targets) == 1 and "*" in targets[0]
                            else list(targets), **dict(case.lora_kwargs))
        with warnings.catch_warnings():  # peft reads transformers' deprecated property
            warnings.filterwarnings("ignore", category=FutureWarning,
                                    message=".*gradient_checkpointing.*deprecated")
            model = get_peft_model(model, config)
    init = snapshot(model)
    pre = make_preconditioner(kind, model, **(pre_kwargs or {}))
    observed = case if observe_rows is None else dataclasses.replace(case, rows=observe_rows)
    observer = (Observer(model, pre.preconditioned_modules, observed, kind)
                if observe else None)
    rec = _Recorder(kind, pre, observer)

    if feature == "lightning_bf16":
        _lightning_bf16(case, model, pre, batches, rec, timer)
    elif feature == "accelerate":
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState, GradientState
        # accelerate keeps process-wide singletons: a Trainer or Accelerator made earlier in
        # this worker (e.g. by a README example) would keep its accumulation setting
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        acc = Accelerator(cpu=True, gradient_accumulation_steps=micro)
        model_p, pre_p = acc.prepare(model, pre)
        for batch in batches:
            t0 = time.perf_counter()
            for part in _split(batch, micro):
                with acc.accumulate(model_p):
                    if observer is not None:
                        observer.batch = part
                    acc.backward(case.loss(model_p, part, per_sample))
                    if acc.sync_gradients:
                        rec.before_step()
                    pre_p.step()
                    pre_p.zero_grad()
            rec.after_step()
            if timer is not None:
                timer.append(time.perf_counter() - t0)
    else:
        forward = model
        if feature == "compile":
            forward = torch.compile(model, **(compile_kwargs or {}))
        autocast = (torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)
                    if feature == "autocast_bf16" else contextlib.nullcontext())
        for batch in batches:
            t0 = time.perf_counter()
            for part in _split(batch, micro):
                if observer is not None:
                    observer.batch = part
                with autocast:
                    loss = case.loss(forward, part, per_sample)
                (loss / micro).backward()
            rec.before_step()
            pre.step()
            pre.zero_grad()
            rec.after_step()
            if timer is not None:
                timer.append(time.perf_counter() - t0)
    if observer is not None:
        observer.remove()
    return Result(kind, snapshot(model), init, rec.pending, rec.factors, rec.oracle,
                  list(pre.preconditioned_modules), pre, model,
                  None if observer is None else set(observer.unmatched))


def _lightning_bf16(case, model, pre, batches, rec, timer):
    """``pl.Trainer(precision="bf16-mixed")`` on CPU, one step per batch. Lightning runs the
    training step under ``torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)``,
    calls ``zero_grad`` inside its closure (between forward and backward) and the closure
    inside ``pre.step``."""
    import pytorch_lightning as pl

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            self._t0 = time.perf_counter()
            if rec.observer is not None:
                rec.observer.batch = batch
            return case.loss(self.model, batch)

        def configure_optimizers(self):
            return pre

        def on_before_optimizer_step(self, optimizer):
            rec.before_step()

        def on_train_batch_end(self, outputs, batch, batch_idx):
            rec.after_step()
            if timer is not None:
                timer.append(time.perf_counter() - self._t0)

    trainer = pl.Trainer(max_steps=len(batches), accelerator="cpu", devices=1,
                         precision="bf16-mixed", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)
    quiet = logging.getLogger("pytorch_lightning")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Lit(), loader)
    finally:
        quiet.setLevel(level)


# -- distributed ------------------------------------------------------------------------------
def ddp_job(rank, world, case_name, kinds, steps, micro, model_fn=None, batch_fn=None):
    """One gloo rank of a DDP cell: each step, this rank's 1/world share of the global batch
    ``batch_fn(t)`` (default: the case's, ``world * micro * 2`` rows) in ``micro``
    micro-batches of loss / micro, all but the last under ``ddp.no_sync()``; then the
    preconditioner's step. ``DistributedDataParallel(find_unused_parameters=True)``: an expert
    without tokens on a rank has no gradient there. Runs every kind in ``kinds`` (a model
    each, built by ``model_fn(seed=0, dtype=f64)`` or the case's); returns per kind
    {params, factors (per step), counters (or the error reading them), expert_rows}."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    case = CASES.get(case_name)
    case_loss = default_loss if case is None else case.loss
    batch_fn = batch_fn or (lambda t: case.batch(t, size=world * micro * 2))
    out = {}
    for kind in kinds:
        model = (model_fn or case.build)(seed=0, dtype=f64)
        if case is not None and case.per_sample is not None:
            case.per_sample(model)
        experts = ExpertRows(model)
        ddp = DDP(model, find_unused_parameters=True)
        pre = make_preconditioner(kind, ddp)
        factors = []
        for t in range(steps):
            experts.step = t
            parts = _split(_split(batch_fn(t), world)[rank], micro)
            for i, part in enumerate(parts):
                with contextlib.nullcontext() if i == micro - 1 else ddp.no_sync():
                    (case_loss(ddp, part, True) / micro).backward()
            pre.step()
            pre.zero_grad()
            factors.append(statistics_of(pre))
        experts.remove()
        try:
            counters = counters_of(pre)
        except Exception as exc:  # noqa: BLE001 -- reported, asserted in the parent
            counters = f"{type(exc).__name__}: {exc}"
        out[kind] = {"params": snapshot(model), "factors": factors, "counters": counters,
                     "expert_rows": experts.rows}
    return out


# -- comparisons ------------------------------------------------------------------------------
def _worst_pairs(a, b, error):
    """max of ``error(x, y)`` over the tensors of two {name: (x, y)} dicts (inf if the names,
    a missing pair or the None-pattern differ)."""
    if set(a) != set(b):
        return math.inf
    worst = 0.0
    for name in a:
        if a[name] is None or b[name] is None:
            return math.inf
        for x, y in zip(a[name], b[name]):
            if (x is None) != (y is None):
                return math.inf
            if x is not None:
                worst = max(worst, error(x.double(), y.double()))
    return worst


def max_abs_pairs(a, b):
    """max |x - y| over the tensors of two {name: (x, y)} dicts."""
    return _worst_pairs(a, b, lambda x, y: float((x - y).abs().max()))


def max_rel_pairs(a, b):
    """max over entries of |x - y| / max(1, max|y|) per tensor, over two {name: (x, y)}
    dicts."""
    return _worst_pairs(a, b, lambda x, y: float((x - y).abs().max())
                        / max(1.0, float(y.abs().max())))


def compare(res, ref):
    """Numbers for the table: ``param_rel`` (hf_cases.update_rel_err: the largest parameter
    difference relative to the largest parameter change of the reference), ``params_equal``
    (bit-identical), ``stat_abs`` (max |difference| of the statistics over every step: MKOR's
    a_bar / g_bar, K-FAC's A / G), ``stats_equal``, ``factor_rel`` (factors after every step,
    relative to max(1, max|entry|) of each)."""
    from theory_tests.support.hf_cases import update_rel_err
    res_params = res["params"] if isinstance(res, dict) else res.params
    ref_params = ref["params"] if isinstance(ref, dict) else ref.params
    init = ref.init if not isinstance(ref, dict) else ref["init"]
    out = {"param_rel": update_rel_err(res_params, ref_params, init),
           "params_equal": all(torch.equal(res_params[n], ref_params[n]) for n in ref_params)}
    res_f = res["factors"] if isinstance(res, dict) else res.factors
    ref_f = ref["factors"] if isinstance(ref, dict) else ref.factors
    out["factor_rel"] = max((max_rel_pairs(x, y) for x, y in zip(res_f, ref_f)), default=0.0)
    if len(res_f) != len(ref_f):
        out["factor_rel"] = math.inf
    if not isinstance(res, dict) and not isinstance(ref, dict):
        stats = [max_abs_pairs(x, y) for x, y in zip(res.statistics(), ref.statistics())]
        out["stat_abs"] = max(stats, default=0.0)
        out["stats_equal"] = out["stat_abs"] == 0.0 and len(res.statistics()) == len(
            ref.statistics())
    out["factors_equal"] = out["factor_rel"] == 0.0
    return out


def describe(numbers):
    return ", ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in numbers.items())

