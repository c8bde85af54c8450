"""pyproject's ``filterwarnings`` keep a green ``pytest`` from ending in a summary of the
warnings the tests trigger on purpose (issue 45 item 7), and hide nothing else: every filter
that ignores names a message, and the library's own are the library's exact messages, so the
same words from another source, or another warning, still show."""
import pathlib
import warnings

import pytest
import torch
from _pytest.config import parse_warning_filter

from torch_impl import MKOR

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the parser setuptools brings
    from setuptools.compat.py310 import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
FILTERS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
    "ini_options"]["filterwarnings"]


def test_every_ignore_names_a_message():
    """No filter ignores a whole category or module: each names the message it hides."""
    for text in FILTERS:
        action, message, category, module, _ = parse_warning_filter(text, escape=False)
        if action == "ignore":
            assert len(message) > 20, f"{text!r}: an ignore without a precise message"


def _emitted(trigger):
    """The warnings ``trigger()`` emits under pyproject's filters, applied as pytest applies
    them (in order, the last taking precedence)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for text in FILTERS:
            warnings.filterwarnings(*parse_warning_filter(text, escape=False))
        trigger()
    return [str(w.message) for w in caught]


def _skipped():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1), skip_modules=("0",))


def _twice():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    first = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1))
    MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return first


def _in_eval():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2)).eval()
    mkor = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1), inv_freq=1)
    model(torch.ones(4, 3)).square().sum().backward()
    mkor.step()


@pytest.mark.parametrize("trigger, words", [
    (_skipped, "nothing is preconditioned"),
    (_twice, "the model already carried the hooks of an earlier MKOR"),
    (_in_eval, "no statistics were captured for a factor update")])
def test_the_librarys_deliberate_warnings_are_hidden(trigger, words):
    """A library warning a test triggers on purpose, from the library itself: it warns (seen
    without the filters) and the filters hide it."""
    with warnings.catch_warnings(record=True) as unfiltered:
        warnings.simplefilter("always")
        trigger()
    assert any(words in str(w.message) for w in unfiltered), [str(w.message) for w in unfiltered]
    assert _emitted(trigger) == []


def test_the_same_words_from_elsewhere_and_other_warnings_still_show():
    other = _emitted(lambda: (
        warnings.warn("LAMB: nothing is preconditioned, every parameter goes to the backbone",
                      UserWarning),
        warnings.warn("MKOR: a message of its own", UserWarning),
        warnings.warn("`torch.jit.script` is deprecated.", DeprecationWarning)))
    assert len(other) == 3, other
