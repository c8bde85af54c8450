"""The composition matrix (issue 20 item 5, rows added by issues 29 and 31): seventeen real
models (GPT-2, BERT, Llama, T5, ViT, ALBERT, ResNet from transformers, transformers' Switch MoE
with Linear experts; CLIP's two towers, XLNet's sequence-first rows, an EncoderDecoderModel
with a projection, a user's wrapper fed dict batches, BERT called with a positional mask; and
Mixtral, Qwen2-MoE, Aria and GPT-OSS, whose experts are fused 3-D parameters preconditioned
as stacks of expert layers, :mod:`composition_moe`) x nine training-loop features, under MKOR
and K-FAC. Every cell is compared with a reference run;
the table, cell by cell, with the measured errors, is ``paper_notes/composition_matrix.md``.

One test function per feature (a column of the matrix); its docstring states the reference
and the assertion. Runs are 3 steps, ``inv_freq=1`` (a factor update at every step), SGD
backbone, float64 unless the feature needs otherwise, batches of 4 with padding
``LENGTHS`` / ``DEC_LENGTHS`` where padded (:mod:`composition_cases`).

Tolerances: "bit-identical" (``torch.equal``) where both runs perform the same operations in
the same order; ``REORDER_TOL`` (1e-10 of the largest parameter change, derived in
:mod:`composition_cases`) where they compute the same function with sums in another order;
statistics against the independent computation (:class:`~composition_observer.Observer`) within
the bound derived from the rows themselves (ratio <= 1).

A fast subset (one cell per feature and per model, including the five cells of the bugs
listed in issue 20: ALBERT x non-reentrant checkpointing, Llama x reentrant checkpointing
with padding, T5 x padding, MoE x DDP, deep Llama x compile -- the last slow, as every compile
cell) runs by default; the rest is ``-m slow``. Each cell prints its measured errors.
"""
import dataclasses
import functools
import json
import logging
import math
import os
import pathlib
import re
import time

import pytest
import torch

from theory_tests.support import composition_cases as cc
from theory_tests.support.composition_cases import (CASES, FEATURES, KINDS, MODELS, NOT_APPLICABLE, REORDER_TOL,
                               compare, describe, oracle_errors, run, total_count)
from theory_tests.support.composition_moe import FUSED
from theory_tests.support.composition_rows import shape_coincidence
from theory_tests.support.distributed_harness import run as run_ranks
from theory_tests.support.dynamo_probe import compiled_graphs, disabled_calls
from theory_tests.support.hf_cases import equal_factors, update_rel_err

STEPS = 3

#: (model, feature) cells in the default run, both kinds: one per feature (compile: none,
#: every compile cell takes 15-60 s on 2 cores) and one per model, among them the bug cells.
DEFAULT = {
    ("resnet", "plain"),
    ("llama", "ckpt_reentrant"),        # issue 20 bug (b)
    ("albert", "ckpt_nonreentrant"),    # bug (a)
    ("t5", "padding"),                  # bug (c)
    ("gpt2", "lora"),
    ("bert", "accelerate"),
    ("moe", "ddp"),                     # bug (d)
    ("vit", "lightning_bf16"),
    # issue 29's rows: the mask each layer's rows need, where a call's shape would mislead
    ("clip", "padding"),
    ("xlnet", "padding"),
    ("encdec", "padding"),
    ("bert_wrapper", "padding"),
    ("bert_positional", "ckpt_reentrant"),
    # issue 31's rows: fused experts (3-D parameters) preconditioned as stacks of experts
    ("mixtral", "padding"),
    ("qwen2_moe", "ddp"),
    ("aria", "ckpt_reentrant"),
    ("gpt_oss", "plain"),
}

#: Float32 tolerance for compiled-vs-eager runs of models that compute part of a float64
#: forward in float32 (the reason per model): inductor's fused kernels and ATen's may round
#: such a float32 result differently by a few ulps (4 u, u = 2^-24); about 10 such norms lie
#: on each path through these models, the 3 steps add up, and the factors' conditioning may
#: amplify by ~10 (REORDER_TOL's argument): 4 u x 10 x 3 x 10 = 7.2e-5.
FLOAT32_TOL = 4 * 2.0 ** -24 * 10 * STEPS * 10
FLOAT32_PARTS = {
    "llama": "LlamaRMSNorm casts the hidden states to float32 and back",
    "t5": "T5LayerNorm computes the variance in float32",
    "moe": "Switch's T5-style layer norm computes the variance in float32",
    "mixtral": "MixtralRMSNorm casts the hidden states to float32 and back; the router's "
               "softmax computes in float32",
    "qwen2_moe": "Qwen2MoeRMSNorm casts the hidden states to float32 and back; the router's "
                 "softmax computes in float32",
    "aria": "AriaTextRMSNorm casts the hidden states to float32 and back",
    "gpt_oss": "GptOssRMSNorm casts the hidden states to float32 and back",
}

#: Cells compared with REORDER_TOL instead of bit-identity, with the reason.
REORDERED = {
    ("t5", "ckpt"): "transformers' T5 computes the cross-attention output of its checkpointed "
                    "decoder block differently in the last bits (measured without any "
                    "preconditioner: every position differs, by up to 8.9e-16, at step 0)",
    ("moe", "ckpt"): "the same T5-style cross-attention as T5 (Switch is built on T5)",
}

#: Token models whose runs with other ids at the padded positions agree within REORDER_TOL,
#: not bit for bit, with the reason (measured without any preconditioner).
PAD_REORDERED = {
    model: "padded tokens are routed too: they change how many rows each expert's matmul "
           "runs on, and the same rows multiplied in a matmul of another height differ in the "
           "last bits, so the real tokens' expert outputs move (one forward and backward "
           "without a preconditioner: up to 4.3e-19 at real tokens, parameter gradients up "
           "to 2.2e-19); the padded pairs' rows themselves are masked out"
    for model in FUSED
}

#: Cells that run and fail, with the reason: ``xfail(strict=True)``, so a fix shows (none now:
#: the fused experts' bf16 cells failed until the capture recomputed their rows under the
#: forward's autocast, with each product's gradient in the product's dtype).
KNOWN_FAILING = {}


def cells(feature):
    """pytest params (model, kind) of one feature's column: N/A cells left out (they are in
    ``NOT_APPLICABLE``), the default subset unmarked, the rest ``slow``."""
    out = []
    for model in MODELS:
        if (model, feature) in NOT_APPLICABLE:
            continue
        for kind in KINDS:
            marks = () if (model, feature) in DEFAULT else (pytest.mark.slow,)
            if (model, feature) in KNOWN_FAILING:
                marks += (pytest.mark.xfail(strict=True, reason=KNOWN_FAILING[model, feature]),)
            out.append(pytest.param(model, kind, marks=marks, id=f"{model}-{kind}"))
    return out


def report(capsys, model, feature, kind, **numbers):
    """One parseable line per cell: ``[matrix model/feature/kind] key=value, ...``; with
    ``COMPOSITION_MATRIX_LOG=path`` set, also a JSON line appended to that file (under
    pytest-xdist the workers' output is not shown: this is how the table's numbers are
    collected)."""
    with capsys.disabled():
        print(f"\n[matrix {model}/{feature}/{kind}] {describe(numbers)}")
    path = os.environ.get("COMPOSITION_MATRIX_LOG")
    if path:
        line = json.dumps({"model": model, "feature": feature, "kind": kind,
                           **{k: (v if not isinstance(v, float) or math.isfinite(v) else str(v))
                              for k, v in numbers.items()}})
        with open(path, "a") as f:
            f.write(line + "\n")


def batches(model, padded=False, pad_seed=0, size=4, dtype=torch.float64, **kwargs):
    case = CASES[model]
    return [case.batch(t, size=size, padded=padded, pad_seed=pad_seed, dtype=dtype, **kwargs)
            for t in range(STEPS)]


def assert_same_run(bitwise, numbers):
    """Bit-identical parameters and statistics (every step), or within REORDER_TOL."""
    if bitwise:
        assert numbers["params_equal"], describe(numbers)
        assert numbers["stats_equal"] and numbers["factors_equal"], describe(numbers)
    else:
        assert numbers["param_rel"] <= REORDER_TOL, describe(numbers)
        assert numbers["factor_rel"] <= REORDER_TOL, describe(numbers)


def assert_oracle(result, numbers, key="oracle"):
    """The statistics of every step equal the Observer's within its derived bound."""
    worst_abs, ratio, where = oracle_errors(result.statistics(), result.oracle)
    numbers[f"{key}_abs"], numbers[f"{key}_ratio"] = worst_abs, ratio
    return ratio, where


# -- plain ------------------------------------------------------------------------------------
@pytest.mark.parametrize("model,kind", cells("plain"))
def test_plain(model, kind, capsys):
    """Reference: the independent computation (composition_observer.Observer: forward hooks and
    ``retain_grad``, none of torch_impl's capture code). Assertion: at every step, MKOR's
    ``pending_vectors()`` (a_bar, g_bar) / K-FAC's factor EMAs (A, G) of every preconditioned
    layer equal the Observer's within the rounding bound derived from the rows (sums of the
    same terms in another order); the set of layers is the same (every layer with rows)."""
    res = run(model, "plain", kind, batches(model), observe=True)
    numbers = {}
    ratio, where = assert_oracle(res, numbers)
    report(capsys, model, "plain", kind, **numbers)
    assert ratio <= 1, f"{where}: {describe(numbers)}"
    # MKOR's pending vectors hold the layers with rows; K-FAC's factors() every layer
    idle = set(res.names) - set(res.statistics()[0])
    assert idle == (IDLE.get(model, set()) if kind == "mkor" else set()), idle


#: Preconditioned layers without rows in these runs, by model, with the reason.
IDLE = {
    # EncoderDecoderModel does not use its BERT encoder's pooler: no gradient reaches it
    "encdec": {"encoder.pooler.dense"},
}


# -- checkpointing ----------------------------------------------------------------------------
def _checkpointing(model, kind, reentrant, capsys):
    feature = "ckpt_reentrant" if reentrant else "ckpt_nonreentrant"
    case = CASES[model]
    padded = case.tokens
    ref = run(model, "plain", kind, batches(model, padded=padded))
    res = run(model, feature, kind, batches(model, padded=padded))
    numbers = compare(res, ref)
    pad_numbers = None
    if padded and model != "moe":  # the MoE's experts see padded tokens (test_padding)
        other = run(model, feature, kind, batches(model, padded=True, pad_seed=50))
        pad_numbers = compare(other, res)
        numbers["pad_param_rel"] = pad_numbers["param_rel"]
    report(capsys, model, feature, kind, **numbers)
    assert res.pre.steps == STEPS
    assert_same_run((model, "ckpt") not in REORDERED, numbers)
    if pad_numbers is not None and model in PAD_REORDERED:
        assert_same_run(False, pad_numbers)
    elif pad_numbers is not None:
        assert pad_numbers["params_equal"] and pad_numbers["stats_equal"], describe(pad_numbers)


@pytest.mark.parametrize("model,kind", cells("ckpt_reentrant"))
def test_ckpt_reentrant(model, kind, capsys):
    """Reference: the same run without checkpointing (token models: on the padded batches,
    so the recompute must keep the token mask). Checkpointing: transformers'
    ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})``,
    or ``torch.utils.checkpoint`` on ALBERT's shared layer group / ResNet's stages (no
    transformers support). Assertion: bit-identical parameters and statistics at every step
    (T5, MoE: REORDER_TOL, see REORDERED); token models also give bit-identical runs when only
    the ids at padded positions change (fused experts: within REORDER_TOL, PAD_REORDERED)."""
    _checkpointing(model, kind, True, capsys)


@pytest.mark.parametrize("model,kind", cells("ckpt_nonreentrant"))
def test_ckpt_nonreentrant(model, kind, capsys):
    """As :func:`test_ckpt_reentrant` with ``use_reentrant=False`` (transformers 5's default):
    ALBERT's shared layer runs three times per forward, each call in its own checkpoint, and
    every call's statistics count."""
    _checkpointing(model, kind, False, capsys)


# -- padding ----------------------------------------------------------------------------------
@pytest.mark.parametrize("model,kind", cells("padding"))
def test_padding(model, kind, capsys):
    """Reference: the same batches with other ids at the padded positions (encoder and
    decoder; attention masks 0, labels -100 there), and the independent computation with the
    token masks (T5 / MoE: encoder layers and cross-attention keys / values by
    ``attention_mask``; decoder self-attention, cross-attention queries / outputs, FFNs by
    ``decoder_attention_mask`` -- and, in a second run with labels only, by
    ``labels != -100``). Encoder and decoder are both 8 long with different real lengths,
    so a mask applied to the wrong stack is caught. Assertions: the statistics equal the
    Observer's within its bound; the runs with other pad ids are bit-identical (parameters
    and statistics at every step); with ``token_mask=None`` they differ (> 1e-6 of the
    largest parameter change: the check has teeth). MoE: the experts' rows are tokens
    gathered by the router, which no (B, T) mask indexes: the experts, and only they, are in
    ``unmasked_reasons``, padded tokens reach their statistics (the Observer does not mask
    them either); and padded tokens change which experts run on how many rows, which moves
    the real tokens' expert outputs in the last bits (measured without a preconditioner:
    gradients at real positions differ by up to 3.5e-17): pad-id invariance is asserted for
    every other layer's statistics at step 0 within REORDER_TOL (relative to max(1, max|x|)).
    Every model: ``unmasked_reasons`` lists exactly the token layers no (B, T) mask indexes
    (``composition_rows.listed_unmasked``: the MoE's experts, gathered by the router; CLIP's
    text projection, each row's end-of-text token picked by an index). Fused experts
    (Mixtral, Qwen2-MoE, Aria, GPT-OSS: composition_moe): each routed pair is a row of its expert and
    follows its token's mask, so they are masked (mask source "tokens" for every layer, none
    in ``unmasked_reasons``) and the Observer masks the pairs of padded tokens; padded tokens
    are routed too and move the real tokens' expert outputs in the last bits
    (``PAD_REORDERED``): pad-id invariance within REORDER_TOL. The issue-29 rows put
    a mask of the right shape in the wrong place: CLIP's text as long as its vision tokens,
    XLNet's (T, B) rows with B = T, the EncoderDecoderModel's encoder and decoder both 8 long
    behind a projection, BERT inside a wrapper fed a dict, BERT given the mask by position.
    On the first three, the statistics an Observer with the shape rule
    (``composition_rows.shape_coincidence``) computes differ from the captured ones by
    > 1e-6 (``shape_rule_abs``: the coincidence has teeth); on the last two the unmasked run
    is what a missed mask gives."""
    a = run(model, "padding", kind, batches(model, padded=True), observe=True)
    b = run(model, "padding", kind, batches(model, padded=True, pad_seed=50))
    numbers = {}
    ratio, where = assert_oracle(a, numbers)
    wheres = [where]
    if CASES[model].seq2seq:
        labels_only = run(model, "padding", kind, batches(model, padded=True, decoder_ids=False),
                          observe=True)
        ratio2, where2 = assert_oracle(labels_only, numbers, key="labels_oracle")
        ratio, wheres = max(ratio, ratio2), [where, where2]
    pads = compare(b, a)
    numbers["pad_param_rel"], numbers["pad_stat_abs"] = pads["param_rel"], pads["stat_abs"]
    a0 = run(model, "padding", kind, batches(model, padded=True), pre_kwargs={"token_mask": None})
    b0 = run(model, "padding", kind, batches(model, padded=True, pad_seed=50),
             pre_kwargs={"token_mask": None})
    numbers["unmasked_param_rel"] = compare(b0, a0)["param_rel"]
    if model == "moe":  # step 0, the layers whose rows are masked (all but the experts)
        first_a, first_b = a.statistics()[0], b.statistics()[0]
        masked = sorted(set(first_a) - a.unmatched)
        numbers["pad_step0_masked_rel"] = cc.max_rel_pairs({n: first_b.get(n) for n in masked},
                                                          {n: first_a[n] for n in masked})
    if CASES[model].shape_misleads:  # the mask a shape rule would pick is wrong here
        misled = run(model, "padding", kind, batches(model, padded=True), observe=True,
                     observe_rows=shape_coincidence)
        numbers["shape_rule_abs"], _ = oracle_errors(misled.statistics(), misled.oracle)[:2]
    report(capsys, model, "padding", kind, **numbers)
    assert ratio <= 1, f"{wheres}: {describe(numbers)}"
    if CASES[model].shape_misleads:
        assert numbers["shape_rule_abs"] > 1e-6, describe(numbers)
    assert numbers["unmasked_param_rel"] > 1e-6
    assert set(a.pre.unmasked_reasons) == a.unmatched
    if model == "moe":
        assert a.unmatched == {n for n in a.names if ".experts.expert_" in n}
        assert masked and numbers["pad_step0_masked_rel"] <= REORDER_TOL, describe(numbers)
    elif model in PAD_REORDERED:  # fused experts: every layer masked, the stacks by token
        sources = {n: row["mask"] for n, row in a.pre.capture_report().items() if n in a.names}
        assert set(sources.values()) == {"tokens"}, sources
        assert any(".mlp.experts." in n for n in a.names) and not a.unmatched
        assert_same_run(False, pads)
    else:
        assert pads["params_equal"] and pads["stats_equal"], describe(pads)


# -- torch.compile ----------------------------------------------------------------------------
class _DynamoWarnings(logging.Handler):
    """Collects the recompile-limit warnings torch._dynamo logs (it does not use
    ``warnings``)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        message = record.getMessage()
        if "recompile_limit" in message or "cache_size_limit" in message:
            lines = [line.strip() for line in message.splitlines()[:3]]
            self.messages.append(" / ".join(lines))


@pytest.fixture
def dynamo_warnings():
    import torch._dynamo
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    handler = _DynamoWarnings()
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        torch._dynamo.reset()


def _recompile_limit_hits():
    unimplemented = torch._dynamo.utils.counters["unimplemented"]
    return sum(v for k, v in unimplemented.items() if "recompile limit" in k.lower())


#: The compile column's schedule: statistics captured at steps 0 and 2, not at step 1, so
#: the run has capture steps (the model's forward routed eagerly, torch_impl/kronecker/
#: capture/eager.py) and a step that runs the compiled graph.
COMPILE_SCHEDULE = {"mkor": {"inv_freq": 2}, "kfac": {"inv_freq": 2, "factor_freq": 2}}


def _compile_numbers(timer):
    return dict(first_step_s=timer[0], compiled_step_s=timer[1], graphs=compiled_graphs(),
                disabled_calls=",".join(sorted(disabled_calls())),
                recompile_limit_hits=_recompile_limit_hits())


def _assert_compiled_around_capture(numbers, warned):
    """The capture steps broke the graph only around the model (its pre-hook, its forward
    routed eagerly, its post-hook), never at a layer's hook; the step without capture ran
    a compiled graph; dynamo logged no recompile-limit warning."""
    disabled = numbers["disabled_calls"].split(",")
    assert len(disabled) == 3 and "Capture._model_pre_hook" in disabled and (
        "Capture._model_post_hook" in disabled), describe(numbers)
    # the model's forward, routed eagerly with the row tracker around it
    assert "EagerCaptureSteps.tracked_forward" in disabled, describe(numbers)
    assert numbers["graphs"] >= 1, describe(numbers)
    assert not warned and numbers["recompile_limit_hits"] == 0, warned


@pytest.mark.parametrize("model,kind", cells("compile"))
def test_compile(model, kind, capsys, dynamo_warnings):
    """Reference: the eager run. ``torch.compile(model)`` (inductor), the preconditioner
    hooked on the model, statistics captured at steps 0 and 2 (COMPILE_SCHEDULE). float64;
    assertion: parameters and factors within REORDER_TOL (inductor's fused kernels
    reassociate sums), or FLOAT32_TOL for the models that compute norms in float32
    (FLOAT32_PARTS: the same models trained by plain SGD differ by the same ~2e-7 compiled
    vs eager); the capture steps broke the graph only around the model, and dynamo logged no
    recompile-limit warning."""
    schedule = COMPILE_SCHEDULE[kind]
    ref = run(model, "plain", kind, batches(model), pre_kwargs=schedule)
    timer = []
    res = run(model, "compile", kind, batches(model), pre_kwargs=schedule, timer=timer)
    numbers = compare(res, ref)
    numbers.update(_compile_numbers(timer))
    report(capsys, model, "compile", kind, **numbers)
    tol = FLOAT32_TOL if model in FLOAT32_PARTS else REORDER_TOL
    assert numbers["param_rel"] <= tol and numbers["factor_rel"] <= tol, describe(numbers)
    _assert_compiled_around_capture(numbers, dynamo_warnings.messages)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_compile_deep_llama(kind, capsys, dynamo_warnings):
    """Issue 20 item 4: ``torch.compile`` on a 30-layer Llama (more layers than dynamo's
    recompile limit of 8, KV cache on) with the preconditioner attached: no recompile-limit
    warning (dynamo's log, and its ``unimplemented`` counter), no graph break at a layer, compiled
    equals eager within FLOAT32_TOL (float64 model, float32 RMSNorm). The first compiled
    step (step 1: the capture steps run eagerly) is timed against the first step of the
    same model compiled without a preconditioner, inductor's caches off for both (the bare
    model's graph is the one the run with the preconditioner compiled), both printed."""
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        _deep_llama(kind, capsys, dynamo_warnings)


def _deep_llama(kind, capsys, dynamo_warnings):
    n_layer = 30
    deep = dataclasses.replace(CASES["llama"],
                               build=functools.partial(cc.tiny_llama, n_layer=n_layer))
    data = batches("llama")
    schedule = COMPILE_SCHEDULE[kind]
    ref = run(deep, "plain", kind, data, pre_kwargs=schedule)
    timer = []
    res = run(deep, "compile", kind, data, pre_kwargs=schedule, timer=timer)
    numbers = compare(res, ref)
    numbers.update(_compile_numbers(timer))
    warned = list(dynamo_warnings.messages)
    torch._dynamo.reset()
    bare = cc.tiny_llama(n_layer=n_layer)
    opt = torch.optim.SGD(bare.parameters(), lr=0.05, momentum=0.9)
    compiled = torch.compile(bare)
    t0 = time.perf_counter()
    compiled(**data[0]).loss.backward()
    opt.step()
    numbers["first_step_bare_s"] = time.perf_counter() - t0
    report(capsys, f"llama{n_layer}", "compile", kind, **numbers)
    assert numbers["param_rel"] <= FLOAT32_TOL and numbers["factor_rel"] <= FLOAT32_TOL, (
        describe(numbers))
    _assert_compiled_around_capture(numbers, warned)


# -- peft LoRA --------------------------------------------------------------------------------
@pytest.mark.parametrize("model,kind", cells("lora"))
def test_lora(model, kind, capsys):
    """Reference: the independent computation. ``peft.get_peft_model`` with LoRA (rank 2,
    dropout 0, ``init_lora_weights=False`` so both A and B start random and every adapter
    has a gradient) on the case's targets (attention q / v; GPT-2's fused ``c_attn`` Conv1D;
    ResNet's 3x3 convolutions, whose adapters are Conv2d; the MoE's expert ``wi`` too).
    Assertions: the preconditioned modules are exactly the adapters (``lora_A`` /
    ``lora_B``), every frozen base layer is skipped as frozen, and the adapters' statistics
    equal the Observer's within its bound at every step."""
    res = run(model, "lora", kind, batches(model), observe=True)
    adapters = [n for n, _ in res.model.named_modules()
                if re.search(r"\.lora_[AB]\.default$", n)]
    numbers = {"adapters": len(res.names)}
    ratio, where = assert_oracle(res, numbers)
    report(capsys, model, "lora", kind, **numbers)
    assert adapters and res.names == adapters
    frozen = [n for n, r in res.pre.skip_reasons.items() if r.startswith("frozen")]
    assert {n.rsplit(".lora_", 1)[0] + ".base_layer" for n in res.names} <= set(frozen)
    assert ratio <= 1, f"{where}: {describe(numbers)}"


# -- accelerate -------------------------------------------------------------------------------
@pytest.mark.parametrize("model,kind", cells("accelerate"))
def test_accelerate(model, kind, capsys):
    """Reference: one full batch of 4 per step, plain loop. Feature: ``Accelerator(cpu=True,
    gradient_accumulation_steps=2)`` preparing model and preconditioner, 2 micro-batches of 2
    under ``accelerator.accumulate`` with ``accelerator.backward`` (which divides the loss by
    2: the loss / k convention), ``step`` / ``zero_grad`` through the AcceleratedOptimizer
    (a real step on the second micro-batch only). Unpadded batches (each micro-batch mean
    has the same weight); ResNet's BatchNorm in eval mode in both runs. Assertion: 3
    preconditioner steps, parameters and factors within REORDER_TOL."""
    ref = run(model, "plain", kind, batches(model), per_sample=True)
    res = run(model, "accelerate", kind, batches(model), micro=2, per_sample=True)
    numbers = compare(res, ref)
    report(capsys, model, "accelerate", kind, **numbers)
    assert res.pre.steps == STEPS
    assert_same_run(False, numbers)


# -- DDP no_sync ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _ddp_ranks(model):
    """Both kinds' DDP runs of ``model`` (one 2-rank job, shared by the column's cells)."""
    return run_ranks(cc.ddp_job, 2, model, tuple(KINDS), STEPS, 2, timeout=240)


def _empty_on_rank0(ranks, kind):
    """(expert, step) pairs where rank 0's expert got no token and rank 1's got some."""
    rows0, rows1 = ranks[0][kind]["expert_rows"], ranks[1][kind]["expert_rows"]
    return [(name, t) for name in rows0 for t in range(STEPS)
            if rows0[name].get(t, 0) == 0 and rows1[name].get(t, 0) > 0]


def _count_gap(ranks, kind):
    """Largest difference between the two ranks' pairs routed to one expert in one step."""
    rows0, rows1 = ranks[0][kind]["expert_rows"], ranks[1][kind]["expert_rows"]
    return max((abs(rows0[name].get(t, 0) - rows1[name].get(t, 0)) for name in rows0
                for t in range(STEPS)), default=0)


@pytest.mark.parametrize("model,kind", cells("ddp"))
def test_ddp(model, kind, capsys):
    """Reference: one process on the union of the batches (8 rows, one backward, mean loss).
    Feature: ``DistributedDataParallel`` on 2 forked gloo ranks, each with 4 rows in 2
    micro-batches of loss / 2, the first under ``ddp.no_sync()``. Unpadded batches;
    ResNet's BatchNorm in eval mode in both. Assertions: the ranks hold bit-identical
    parameters and factors; they equal the union run within REORDER_TOL (the all-reduce sums
    in another order). MoE (Switch, learned top-1 router): in some step an expert gets no
    token on rank 0 and some on rank 1 (asserted from the recorded routing), and no factor
    update is counted non-finite. Fused experts (top-2 of 4): each expert's pairs differ in
    number between the ranks in some step (``count_gap`` > 0, from the recorded routing: a
    mean of the ranks' per-expert means would be wrong), and no expert's update is counted
    non-finite."""
    ranks = _ddp_ranks(model)
    data = batches(model, size=8)
    ref = run(model, "plain", kind, data, per_sample=True)
    reference = {"params": ref.params, "factors": ref.factors, "init": ref.init}
    numbers = compare(ranks[0][kind], reference)
    between = compare(ranks[1][kind], dict(ranks[0][kind], init=ref.init))
    numbers["rank_param_rel"] = between["param_rel"]
    if model in FUSED:
        numbers["count_gap"] = _count_gap(ranks, kind)
    report(capsys, model, "ddp", kind, **numbers)
    assert between["params_equal"] and between["factors_equal"]
    assert numbers["param_rel"] <= REORDER_TOL, describe(numbers)
    assert numbers["factor_rel"] <= REORDER_TOL, describe(numbers)
    if model == "moe":
        assert _empty_on_rank0(ranks, kind), "the routing no longer leaves an expert empty"
    if model in FUSED:
        assert numbers["count_gap"] > 0, "the ranks' experts got equally many pairs"
    if model == "moe" or model in FUSED:
        for rank in ranks:
            counters = rank[kind]["counters"]
            assert isinstance(counters, dict), counters
            assert all(total_count(c["non_finite"]) == 0 for c in counters.values())


MOE_DEFAULT = [pytest.param(kind, id=kind) for kind in KINDS]


@pytest.mark.parametrize("kind", MOE_DEFAULT)
def test_expert_with_zero_rows(kind, capsys):
    """MoE x DDP, the zero-row case (issue 20 bug (d)), on :class:`~composition_cases.HashMoE`
    whose static loop calls an expert with 0 rows when no token is routed to it.
    One process, the last expert called with 0 rows at every step: reference, the same model
    skipping that expert (transformers 5's loop); assertion: bit-identical parameters and
    factors, all finite, and the counters say ``no_rows`` 3 for that expert and
    ``non_finite`` / ``overflow`` 0 for every layer. Two gloo ranks, the last expert with 0
    rows on rank 0 and some on rank 1: reference, one process on the union; assertion:
    REORDER_TOL, no non-finite count on either rank."""
    runs = {}
    for call_empty in (True, False):
        model = cc.hash_moe(call_empty=call_empty)
        init = cc.snapshot(model)
        pre = cc.make_preconditioner(kind, model)
        for t in range(STEPS):
            model(**cc.hash_moe_batch(t, size=4)).loss.backward()
            pre.step()
            pre.zero_grad()
        runs[call_empty] = (cc.snapshot(model), cc.statistics_of(pre), pre)
    (params, factors, pre), (params_skip, factors_skip, _) = runs[True], runs[False]
    single_rel = update_rel_err(params, params_skip, init)

    model_fn = functools.partial(cc.hash_moe, call_empty=True)
    ranks = run_ranks(cc.ddp_job, 2, None, (kind,), STEPS, 2, model_fn, cc.hash_moe_batch,
                      timeout=120)
    union = cc.hash_moe()
    union_init = cc.snapshot(union)
    union_pre = cc.make_preconditioner(kind, union)
    union_factors = []
    for t in range(STEPS):
        union(**cc.hash_moe_batch(t)).loss.backward()
        union_pre.step()
        union_pre.zero_grad()
        union_factors.append(cc.statistics_of(union_pre))
    ddp = compare(ranks[0][kind], {"params": cc.snapshot(union), "factors": union_factors,
                                   "init": union_init})
    report(capsys, "hash_moe", "zero_rows", kind, single_param_rel=single_rel,
           ddp_param_rel=ddp["param_rel"], ddp_factor_rel=ddp["factor_rel"])
    assert rows_of(ranks, 0) == 0 and rows_of(ranks, 1) > 0
    assert all(torch.isfinite(p).all() for p in params.values())
    assert all(torch.equal(params[n], params_skip[n]) for n in params)
    assert equal_factors(factors, factors_skip)
    counters = cc.counters_of(pre)
    assert counters["experts.3"]["no_rows"] == STEPS
    assert all(c["non_finite"] == 0 and c["overflow"] == 0 for c in counters.values())
    assert ddp["param_rel"] <= REORDER_TOL and ddp["factor_rel"] <= REORDER_TOL, describe(ddp)
    for rank in ranks:
        assert isinstance(rank[kind]["counters"], dict), rank[kind]["counters"]
        assert all(c["non_finite"] == 0 for c in rank[kind]["counters"].values())


def rows_of(ranks, rank):
    """Tokens routed to HashMoE's last expert on ``rank`` over the run (from the ids)."""
    total = 0
    for t in range(STEPS):
        ids = cc._split(cc.hash_moe_batch(t), 2)[rank]["input_ids"]
        total += int((ids % 4 == 3).sum())
    return total


# -- Lightning bf16-mixed ---------------------------------------------------------------------
@pytest.mark.parametrize("model,kind", cells("lightning_bf16"))
def test_lightning_bf16(model, kind, capsys):
    """Reference: the hand-written loop with the forward under ``torch.autocast("cpu",
    dtype=torch.bfloat16, cache_enabled=False)`` (the context Lightning's bf16-mixed plugin
    enters; with the cache on, ALBERT's three uses of a shared weight would share one cast
    and sum their gradients in bf16, a different computation), same float32 model.
    Feature: ``pl.Trainer(precision="bf16-mixed")``, MKOR / K-FAC returned by
    ``configure_optimizers`` (Lightning calls ``zero_grad`` between forward and backward, and
    the step through its closure). Assertions: bit-identical parameters and statistics at
    every step, and the statistics equal the Observer's (computed in float32 from the bf16
    rows, float32 bound)."""
    data = batches(model, dtype=torch.float32)
    ref = run(model, "autocast_bf16", kind, data, dtype=torch.float32)
    res = run(model, "lightning_bf16", kind, data, dtype=torch.float32, observe=True)
    numbers = compare(res, ref)
    ratio, where = assert_oracle(res, numbers)
    report(capsys, model, "lightning_bf16", kind, **numbers)
    assert res.pre.steps == STEPS
    assert_same_run(True, numbers)
    assert ratio <= 1, f"{where}: {describe(numbers)}"


# -- the table --------------------------------------------------------------------------------
TABLE = pathlib.Path(__file__).resolve().parents[2] / "paper_notes" / "composition_matrix.md"


def _table_cells():
    """{(model, feature): cell text} from the markdown grid of TABLE."""
    lines = TABLE.read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| model |"))
    columns = [c.strip().strip("`") for c in lines[header].strip("|").split("|")][1:]
    out = {}
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        parts = [c.strip() for c in line.strip("|").split("|")]
        for feature, text in zip(columns, parts[1:]):
            out[(parts[0].strip("*"), feature)] = text
    return out


def test_table_matches_the_matrix():
    """paper_notes/composition_matrix.md's grid has every cell of MODELS x FEATURES; a cell
    says N/A exactly where NOT_APPLICABLE has it, and "default" exactly for DEFAULT."""
    table = _table_cells()
    assert set(table) == {(m, f) for m in MODELS for f in FEATURES}
    for cell, text in table.items():
        assert text.startswith("N/A") == (cell in NOT_APPLICABLE), cell
        assert ("default" in text) == (cell in DEFAULT), cell
    assert math.isfinite(REORDER_TOL)
