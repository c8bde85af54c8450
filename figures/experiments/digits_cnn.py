"""Figure 4: a small CNN on scikit-learn's bundled 8x8 digits -- MKOR's Conv2d path against
SGD, AdamW and K-FAC (MKOR and K-FAC on the SGD backbone; every lr tuned).

Two 3x3 convolutions (16 and 32 channels, the second with stride 2) and a linear classifier;
1,797 images split 80/20 by a fixed seed.
"""
from .. import common as C
from .. import data, models
from .mnist1d_mlp import classification_figure

NAME = "digits_cnn"
BUDGET = {
    "tiny": dict(steps=4, eval_every=2, batch=16, channels=(4, 8), seeds=1),
    "quick": dict(steps=300, eval_every=20, batch=64, channels=(16, 32), seeds=2),
    "full": dict(steps=3000, eval_every=100, batch=64, channels=(32, 64), seeds=5),
}
SPECS = [
    C.Spec("SGD", "SGD"),
    C.Spec("AdamW", "AdamW"),
    C.Spec("K-FAC", "K-FAC"),
    C.Spec("MKOR", "MKOR"),
    C.Spec("MKOR @ SGD's lr", "MKOR", lr_from="SGD"),
]


def run(ctx):
    b = BUDGET[ctx.mode]
    return classification_figure(
        ctx, NAME, "CNN on scikit-learn digits", data.digits(),
        lambda: models.digits_cnn(b["channels"]), SPECS, BUDGET)
