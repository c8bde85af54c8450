"""Where a hyperparameter lives (issue 22, item 2): it keeps the constructor's name down to the
equation, its default is written once (in the constructor), it travels in named records, and
every optimizer rejects a bad value in one style, ``"<name>: expected ..."``."""
import dataclasses
import inspect

import pytest
import torch

from torch_impl import KFAC, LAMB, MARS, MARSM, MKOR, LossRateSwitch, MKOROptions
from torch_impl.mars import mars_equations, mars_m_equations
from torch_impl.mkor import factors

_NO_DEFAULT = inspect.Parameter.empty


def _defaults(fn):
    return {name: p.default for name, p in inspect.signature(fn).parameters.items()}


def _model():
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


# ---------------------------------------------------------------- MKOR: defaults written once

def test_mkor_defaults_live_in_the_constructor_alone():
    """MKOROptions, the factor functions and the switch rule take MKOR's values, never a
    default of their own: a default written twice can drift."""
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               for f in dataclasses.fields(MKOROptions))
    for fn, names in ((factors.factor_update, ("variant", "stat_decay", "zeta", "threshold")),
                      (factors.rank1_inverse_update, ("variant", "stat_decay")),
                      (factors.needs_stabilising, ("threshold",)),
                      (LossRateSwitch.__init__, ("window", "check_every", "threshold",
                                                 "patience"))):
        assert all(_defaults(fn)[n] is _NO_DEFAULT for n in names), fn.__qualname__
    mkor = _defaults(MKOR.__init__)
    assert mkor["threshold"] == factors.RELEASED_THRESHOLD == 2.0  # the released code's 2
    assert (mkor["stat_decay"], mkor["zeta"], mkor["switch_threshold"]) == (0.95, 0.9, 1e-3)
    assert set(mkor) >= {f.name for f in dataclasses.fields(MKOROptions)}


def test_every_mkor_keyword_reaches_its_option():
    """Each of MKOR's keywords lands in the option of the same name (a swapped pair in the
    hand-over from the constructor to MKOROptions fails here)."""
    chosen = dict(inv_freq=3, stat_decay=0.7, variant="paper", zeta=0.6, threshold=5.0,
                  stabilizer_norm="max_entry", stabilizer_timing="deferred",
                  stabilizer_reset="identity", stabilizer_coupling="coupled",
                  first_update="identity", rescale="sum_of_norms", factor_dtype=torch.float16,
                  average="double", comm_dtype=torch.bfloat16, precondition_dtype=torch.float32,
                  factor_rounding="stochastic", rounding_seed=12345, warmup_steps=4, grad_accum_steps=2, grad_scale=8.0, skip_modules=("2",),
                  grad_hook="module", hybrid_switch="loss_rate", switch_window=7,
                  switch_check_every=5, switch_threshold=0.25, switch_patience=6,
                  switch_step=90, max_factor_dim=77, token_mask="mask", factor_placement="owner",
                  rank=2)
    assert set(chosen) == {f.name for f in dataclasses.fields(MKOROptions)}
    model = _model()
    mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1), **chosen)
    assert mkor.options.as_dict() == chosen


def test_each_consumer_reads_its_options_under_their_names():
    """Options by consumer (issue 44): each part of MKOR receives a small frozen record of what
    it reads, the constructor's values under the constructor's names (a field swapped or
    dropped on the way from the constructor to a record fails here), and MKOR's parts hold
    those records."""
    chosen = dict(inv_freq=3, stat_decay=0.7, variant="paper", zeta=0.6, threshold=5.0,
                  stabilizer_norm="max_entry", stabilizer_timing="deferred",
                  stabilizer_reset="identity", stabilizer_coupling="coupled",
                  first_update="identity", rescale="sum_of_norms", factor_dtype=torch.float64,
                  average="double", comm_dtype=torch.bfloat16, precondition_dtype=torch.float32,
                  hybrid_switch="loss_rate", switch_window=7, switch_check_every=5,
                  switch_threshold=0.25, switch_patience=6, switch_step=90)
    model = _model()
    mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1), **chosen)
    o = mkor.options
    records = (o.factor_rule, o.precondition_rule, o.exchange, o.switch)
    read = set()
    for record in records:
        names = [f.name for f in dataclasses.fields(record)]
        assert len(names) <= 10, type(record).__name__  # small: what one consumer reads
        for name in names:
            expected = torch.float64 if name == "compute_dtype" else chosen[name]
            assert getattr(record, name) == expected, (type(record).__name__, name)
        read |= set(names)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record, names[0], None)
    assert read - {"compute_dtype"} == set(chosen) - {"inv_freq"}  # every option has a reader
    assert mkor._factor_rule == o.factor_rule
    assert mkor._precondition_rule == o.precondition_rule
    assert mkor._hybrid.options == o.switch
    assert (mkor._exchange.average, mkor._exchange.packet.dtype) == ("double", torch.bfloat16)


def test_one_variant_table(monkeypatch):
    """The paper / released columns are written once (``config.COLUMNS``): the options record
    and ``factor_update``'s options left None both read it, so a changed column changes both."""
    from torch_impl.mkor import config
    J, v = torch.eye(3, dtype=torch.float64) * 3, torch.ones(3, dtype=torch.float64)

    def update(**options):
        return factors.factor_update(J, v, variant="paper", stat_decay=0.9, zeta=0.5,
                                     threshold=2.0, **options)[0]
    assert not torch.equal(update(), update(stabilizer_timing="deferred"))
    monkeypatch.setitem(config.COLUMNS["paper"], "stabilizer_timing", "deferred")
    assert torch.equal(update(), update(stabilizer_timing="deferred"))
    model = _model()
    mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert mkor.options.stabilizer_timing == mkor._factor_rule.stabilizer_timing == "deferred"


def test_the_stabiliser_threshold_reaches_the_factor_update():
    """MKOR(threshold=...) is the epsilon of K12 the factor update tests: from J = 3 I, a
    threshold of 2 fires the stabiliser at the first update, one of 4 does not."""
    fired = {}
    for threshold in (2.0, 4.0):
        torch.manual_seed(0)
        model = _model().double()
        mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.0), threshold=threshold,
                    factor_dtype=torch.float64)
        for state in mkor._state.values():
            state["R_inv"].mul_(3.0)
        model(torch.randn(5, 3, dtype=torch.float64)).square().sum().backward()
        mkor.step()
        fired[threshold] = sum(int(c["fired"]) for c in mkor.counters().values())
    assert fired[2.0] >= 2 and fired[4.0] == 0, fired


# ---------------------------------------------------------------- MARS: one record, one name

def test_mars_records_keep_the_constructor_names():
    """The resolvers take the constructors' keywords (MARS's lr_1d travels as the group's
    lr_1d_factor, torch.optim's way of keeping a ratio to a scheduled lr), and the record the
    equations read names gamma, weight_decay and lr as the constructors do."""
    mars = set(_defaults(MARS.__init__)) | {"lr_1d_factor"}
    marsm = set(_defaults(MARSM.__init__))
    for resolver, names in ((mars_equations.resolve_hyperparameters, mars),
                            (mars_m_equations.resolve_hyperparameters, marsm)):
        keywords = [n for n, p in inspect.signature(resolver).parameters.items()
                    if p.kind is p.KEYWORD_ONLY]
        assert keywords and set(keywords) <= names, set(keywords) - names
    assert {"lr", "weight_decay", "gamma", "eps"} <= set(mars_equations.Hyper._fields)
    assert list(inspect.signature(mars_equations.corrected_gradient_).parameters)[2:4] == [
        "gamma", "beta1"]


def test_the_record_on_the_device_is_the_record():
    """``Hyper.packed`` moves every field in one tensor and ``Hyper.unpack`` names them again:
    no field changes place; a field already on the device is written in by its name."""
    h = mars_equations.Hyper(1e-3, 0.1, 0.025, 0.9, 0.99, 1e-8, 0.5, 0.25, 3.0, 7.0)
    packed = h.packed(torch.device("cpu"), torch.float64)
    assert packed.shape == (len(h._fields),)
    back = mars_equations.Hyper.unpack(packed)
    assert back._fields == h._fields and [float(x) for x in back] == list(h)
    divided = h.packed(torch.device("cpu"), torch.float64, clip_divisor=torch.tensor(9.0))
    assert [float(x) for x in mars_equations.Hyper.unpack(divided)] == list(
        h._replace(clip_divisor=9.0))


# ---------------------------------------------------------------- one validation style

def _bad(name, value):
    return pytest.param(name, value, id=f"{name}={value!r}")


def _mars(**kw):
    return MARS(_model().parameters(), **kw)


def _marsm(**kw):
    return MARSM([torch.nn.Parameter(torch.zeros(3, 3))], **kw)


def _mkor(**kw):
    model = _model()
    return MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1), **kw)


def _kfac(**kw):
    model = _model()
    return KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1), **kw)


def _lamb(**kw):
    return LAMB(_model().parameters(), **kw)


def _switch(**kw):
    args = dict(window=5, check_every=2, threshold=1e-3, patience=3)
    return LossRateSwitch(**{**args, **kw})


BAD = [
    (_mars, "gamma", 1.5), (_mars, "eps", -1.0), (_mars, "betas", (0.9,)),
    (_mars, "mars_type", "adam"), (_mars, "orthogonalize_on", "owners"),
    (_marsm, "orthogonalize_on", None), (_marsm, "momentum", 1.0), (_marsm, "ns_steps", 0),
    (_mkor, "inv_freq", 0), (_mkor, "stat_decay", 1.0), (_mkor, "zeta", 1.5),
    (_mkor, "threshold", 0.0), (_mkor, "threshold", float("inf")), (_mkor, "variant", "new"),
    (_mkor, "switch_threshold", float("nan")), (_mkor, "grad_scale", -2.0),
    (_mkor, "comm_overlap", 1), (_mkor, "factor_dtype", "int8"), (_mkor, "max_factor_dim", 0),
    (_mkor, "factor_rounding", "up"), (_mkor, "rounding_seed", -1), (_kfac, "factor_dtype", "int8"),
    (_kfac, "damping", 0.0), (_kfac, "factor_decay", 1.0), (_kfac, "method", "svd"),
    (_kfac, "kl_clip", -1.0), (_kfac, "inv_freq", 1.5), (_lamb, "eps", -1.0),
    (_lamb, "betas", (0.9, 1.0)), (_switch, "window", 0), (_switch, "threshold", float("inf")),
]


@pytest.mark.parametrize("make, name, value", BAD,
                         ids=[f"{m.__name__[1:]}-{n}={v!r}" for m, n, v in BAD])
def test_every_optimizer_rejects_a_bad_value_in_one_style(make, name, value):
    """``ValueError("<name>: expected ..., got <value>")`` from every optimizer, through the
    one helper module (torch_impl/common/validation.py)."""
    with pytest.raises(ValueError) as error:
        make(**{name: value})
    assert str(error.value).startswith(f"{name}: expected") or \
        str(error.value).startswith(f"{name}["), str(error.value)
