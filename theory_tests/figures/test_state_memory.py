"""LP6: the state-memory table's closed forms (``figures.bench.state_closed_form``) are what
each optimizer and option keeps in its ``state_dict()``, key by key, on a tiny GPT; the closed
forms give the issue's numbers by hand; the bench is reachable from ``python -m figures.bench``
and writes its page between the markers. Timings are never asserted (``test_benchmark_scripts``'s
rule)."""
import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from figures.bench import state_closed_form as cf
from figures.bench import state_memory as sm
from figures.bench.state_rows import ROWS
from figures.models import GPT


def _tiny_gpt():
    """Matrices above and below the 8-bit block (256; some of a whole number of blocks, some
    not), biases, LayerNorms, embeddings."""
    model = GPT(vocab=32, block=8, width=24, depth=1, heads=2)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32, (2, 9), generator=g)
    return model, (ids[:, :-1],), ids[:, 1:].flatten(), \
        lambda out, y: F.cross_entropy(out.flatten(0, 1), y)


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_every_row_keeps_what_its_closed_form_counts(row):
    """Two steps (a Kronecker row with a fresh backward before each, so its inverse factors
    and decompositions exist): the measured bytes per state key equal the closed form's."""
    if row.missing():
        pytest.skip(f"not in this tree yet: {', '.join(row.missing())}")
    c = sm.Contender(row, _tiny_gpt, torch.device("cpu"), torch.float32)
    for _ in range(2):
        c.prepare()
        c.step()
    measured, scalars = sm.measured_bytes(c.opt)
    assert measured == row.closed_form(c.model)
    assert scalars > 0  # the step counters exist and are counted apart
    c.close()


def test_closed_forms_give_the_issues_numbers():
    """By hand, on one bias-free float32 matrix of n = 30 x 64 = 1920 entries (7.5 blocks of
    256; no 1-D fallback): AdamW 8 B/param, MARS-AdamW 12, MARS-Lion and MARS-Shampoo 8, exact
    mode + 4, bf16 state half, 8-bit n + 4 ceil(n / 256) bytes per quantized moment, Kahan + 2
    on a bf16 parameter; MKOR (d_out^2 + d_in^2) 4 bytes + AdamW's, K-FAC A, G plus
    eigenvalues and eigenvectors."""
    model = nn.Sequential(nn.Linear(64, 30, bias=False))
    w = model[0].weight
    n = w.numel()
    per = lambda counts: sum(counts.values()) / n  # noqa: E731
    assert per(cf.adamw([w])) == 8 and per(cf.lamb([w])) == 8
    assert per(cf.mars([w])) == 12 and per(cf.mars([w], exact=True)) == 16
    assert per(cf.mars([w], "mars-lion")) == 8 == per(cf.mars([w], "mars-shampoo"))
    assert per(cf.mars_m([w])) == 8 and per(cf.mars_m([w], efficient=True)) == 4
    bf16 = [([w], {"state_dtype": torch.bfloat16})]
    assert per(cf.mars(bf16)) == 6 and per(cf.mars(bf16, exact=True)) == 10
    assert per(cf.mars_m(bf16)) == 4 and per(cf.lamb(bf16)) == 4
    q8 = [([w], {"quantized": True, "block_size": 256})]
    quantized = n + 4 * 8  # codes, and 8 block scales (the last block half full)
    # m and v quantized, the last gradient in float32
    assert cf.mars(q8) == {"exp_avg_codes": n, "exp_avg_absmax": 32, "exp_avg_sq_codes": n,
                           "exp_avg_sq_absmax": 32, "last_grad": 4 * n}
    assert sum(cf.mars(q8, "mars-lion").values()) == quantized + 4 * n
    assert sum(cf.mars_m(q8).values()) == quantized + 4 * n
    w16 = w.detach().to(torch.bfloat16)
    assert per(cf.mars([([w16], {"kahan_sum": True})])) == 3 * 2 + 2
    assert per(cf.mars([([w], {"kahan_sum": True})])) == 12  # float32 needs no compensation
    assert sum(cf.mkor(model, {}).values()) == (30 ** 2 + 64 ** 2) * 4
    assert sum(cf.mkor(model, {}, torch.bfloat16).values()) == (30 ** 2 + 64 ** 2) * 2
    assert sum(cf.kfac(model, {}).values()) == (64 ** 2 + 30 ** 2) * 4 * 2 + (64 + 30) * 4
    assert sum(cf.kfac(model, {}, "inverse", torch.bfloat16).values()) == \
        (64 ** 2 + 30 ** 2) * (2 + 4)
    biased = nn.Sequential(nn.Linear(64, 30))  # the bias is R's extra column
    assert sum(cf.mkor(biased, {}).values()) == (30 ** 2 + 65 ** 2) * 4


def test_a_module_without_a_closed_form_is_named():
    with pytest.raises(ValueError, match="'0'.*Conv2d"):
        cf.linear_shapes(nn.Sequential(nn.Conv2d(1, 2, 3)))
    with pytest.raises(ValueError, match="mars_type"):
        cf.mars([], "mars-sgd")


def _tiny_sizes(monkeypatch):
    monkeypatch.setitem(sm.SIZES, "tiny", ("tiny GPT", _tiny_gpt))
    rows = [r for r in ROWS if r.name in ("AdamW (torch, foreach)", "MARS-AdamW",
                                          "MARS-AdamW exact (is_approx=False)",
                                          "MKOR (AdamW backbone)")]
    monkeypatch.setattr(sm, "ROWS", rows)


def test_figures_bench_only_state_memory_prints_the_table(monkeypatch, capsys):
    """``python -m figures.bench --only state_memory`` runs the bench (tiny model, four rows,
    one round) and puts its report in the JSON line."""
    from figures.bench import optimizer_step as bench
    _tiny_sizes(monkeypatch)
    main = sm.main
    monkeypatch.setattr(sm, "main", lambda argv: main(list(argv) + ["--sizes", "tiny"]))
    bench.main(["--only", "state_memory", "--repeats", "1"])
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])["state_memory"]
    rows = report["sizes"]["tiny"]["rows"]
    assert list(rows) == ["AdamW (torch, foreach)", "MARS-AdamW",
                          "MARS-AdamW exact (is_approx=False)", "MKOR (AdamW backbone)"]
    assert all(e["matches"] for e in rows.values())
    assert rows["MARS-AdamW exact (is_approx=False)"]["seconds"] is None  # memory only
    mkor = rows["MKOR (AdamW backbone)"]
    assert mkor["ratio"] == mkor["seconds"] / mkor["adamw_seconds"] > 0
    assert rows["AdamW (torch, foreach)"]["ratio"] == 1.0
    assert "| MKOR (AdamW backbone) |" in out and "equals its closed form" in out


def test_the_page_is_written_between_its_markers_and_a_mismatch_is_shown(tmp_path):
    entry = {"bytes_per_param": 12.0, "closed_form_bytes_per_param": 12.0, "matches": True,
             "seconds": 0.002, "ratio": 1.5}
    report = {"date": "d", "device": "cpu", "cpu": "x", "threads": 2, "torch": "t",
              "load_average": 1.0, "repeats": 1, "ns_dtype": "float32",
              "not_available": {"R": ["MARS(kahan_sum)"]},
              "sizes": {"s": {"label": "S", "rows": {"MARS": entry}}}}
    page = tmp_path / "README.md"
    page.write_text(f"intro\n{sm.BEGIN}\nold\n{sm.END}\noutro\n")
    sm.write_page(report, page, tmp_path / "out.json")
    text = page.read_text()
    assert "old" not in text and text.startswith("intro\n") and text.endswith(f"{sm.END}\noutro\n")
    assert "| MARS | 12.000 | 2.00 | 1.50 |" in text and "R (needs MARS(kahan_sum))" in text
    assert json.loads((tmp_path / "out.json").read_text()) == report
    report["sizes"]["s"]["rows"]["MARS"] = dict(entry, matches=False,
                                                closed_form_bytes_per_param=8.0)
    assert "| MARS | 12.000 ≠ 8.000 |" in sm.table(report)
    assert "differs from its closed form" in sm.table(report)
    page.write_text("no markers")
    with pytest.raises(ValueError, match="state_memory: begin"):
        sm.write_page(report, page, tmp_path / "out.json")
