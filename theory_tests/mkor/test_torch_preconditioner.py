"""The MKOR preconditioner object: validation, O(d^2) path, robustness, checkpoints."""
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as Fn

from torch_impl.baselines import LAMB

from torch_impl.mkor import MKOR


f64 = torch.float64


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        self.norm = nn.LayerNorm(12)
        self.fc = nn.Linear(12, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = self.norm(torch.relu(self.conv(x)).flatten(1))
        return self.out(torch.tanh(self.fc(h)))


def make(seed=0, dtype=torch.float32, device="cpu", optimizer="sgd", **kwargs):
    torch.manual_seed(seed)
    model = SmallCNN().to(device=device, dtype=dtype)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    elif optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = LAMB(model.parameters(), lr=1e-2, weight_decay=0.01)
    return model, opt, MKOR(model, opt, **kwargs)


def batch(t, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(1000 + t)
    x = torch.randn(8, 2, 4, 4, generator=g, dtype=dtype)
    y = torch.randn(8, 2, generator=g, dtype=dtype)
    return x.to(device), y.to(device)


def train(model, opt, mkor, steps, start=0, dtype=torch.float32, device="cpu"):
    for t in range(start, start + steps):
        x, y = batch(t, dtype, device)
        loss = Fn.mse_loss(model(x), y)
        loss.backward()
        mkor.step()
        opt.zero_grad()
    return loss.item()


@pytest.mark.parametrize("name,value", [
    ("inv_freq", 0), ("inv_freq", 1.5), ("stat_decay", 1.0), ("stat_decay", 0.0),
    ("variant", "exact"), ("zeta", 1.5), ("threshold", 0.0), ("threshold", float("inf")),
    ("stabilizer_norm", "spectral"), ("stabilizer_timing", "after"),
    ("stabilizer_reset", "zero"), ("stabilizer_coupling", "both"), ("first_update", "skip"),
    ("rescale", "none"), ("factor_dtype", "int8"), ("average", "twice"),
    ("comm_dtype", "float8"), ("warmup_steps", -1), ("grad_accum_steps", 0), ("grad_hook", "x"),
    ("grad_scale", 0.0), ("hybrid_switch", "auto"), ("switch_window", 0),
    ("switch_check_every", 0), ("switch_threshold", float("nan")), ("switch_patience", 0),
    ("switch_step", -1)])
def test_invalid_hyperparameters_raise_value_error_naming_them(name, value):
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=name):
        MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1), **{name: value})


def test_released_variant_selects_the_whole_column():
    model = nn.Linear(2, 2)
    o = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1), variant="released").options
    assert (o.stabilizer_timing, o.stabilizer_reset, o.stabilizer_coupling, o.first_update,
            o.rescale, o.factor_dtype, o.average) == (
        "deferred", "identity", "coupled", "identity", "sum_of_norms", torch.float16, "double")
    o = MKOR(model, torch.optim.SGD(model.parameters(), lr=0.1)).options
    assert (o.stabilizer_timing, o.stabilizer_reset, o.stabilizer_coupling, o.first_update,
            o.rescale, o.factor_dtype, o.average, o.zeta, o.threshold) == (
        "before_sm", "blend", "per_factor", "sm", "joint", torch.float32, "once", 0.9, 2.0)


@pytest.mark.parametrize("variant", ["paper", "released"])
def test_no_cubic_linear_algebra_on_the_mkor_path(monkeypatch, variant):
    """KT11: no inverse, solve, eigendecomposition, SVD or Cholesky during 25 steps
    (factor updates every 2nd step, stabiliser firing with stat_decay 0.5)."""
    model, opt, mkor = make(variant=variant, inv_freq=2, stat_decay=0.5)

    def forbidden(*args, **kwargs):
        raise AssertionError("O(d^3) routine called")

    for name in ("inv", "inv_ex", "solve", "solve_ex", "eigh", "eig", "eigvals", "eigvalsh",
                 "svd", "svdvals", "cholesky", "cholesky_ex", "pinv", "lstsq", "matrix_norm",
                 "lu_factor", "lu"):
        monkeypatch.setattr(torch.linalg, name, forbidden)
    for name in ("inverse", "cholesky_inverse", "pinverse", "svd", "cholesky"):
        monkeypatch.setattr(torch, name, forbidden)
    train(model, opt, mkor, 25)
    if variant == "paper":
        assert sum(int(c["fired"]) for c in mkor.counters().values()) > 0


def test_precondition_makes_no_host_sync(monkeypatch, device):
    """Spec: no .item(), bool(tensor) or float(tensor) inside precondition(), on factor
    update steps (with the stabiliser active) and off-schedule steps alike. On CUDA the
    driver-level check (sync debug mode "error") is armed as well. (The self-check's one
    read on its own steps: the next test.)"""
    for variant in ("paper", "released"):
        model, opt, mkor = make(variant=variant, inv_freq=2, stat_decay=0.5, device=device,
                                self_check=None)
        for t in range(6):
            x, y = batch(t, device=device)
            Fn.mse_loss(model(x), y).backward()
            with monkeypatch.context() as m:
                def boom(*args, **kwargs):
                    raise AssertionError("host synchronisation in precondition()")
                for name in ("__bool__", "item", "__float__", "__int__", "tolist", "__index__"):
                    m.setattr(torch.Tensor, name, boom)
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    mkor.precondition()
                finally:
                    if device.type == "cuda":
                        torch.cuda.set_sync_debug_mode("default")
            opt.step()
            opt.zero_grad()


def test_the_self_check_reads_once_on_its_steps_and_never_otherwise():
    """inv_freq=2: capture steps 0, 2, 4, 6, 8, each checked (every statistic a factor takes
    is verified) with exactly one read (Tensor.tolist) in precondition(); none between."""
    model, opt, mkor = make(inv_freq=2)
    reads = []
    real = torch.Tensor.tolist
    for t in range(9):
        x, y = batch(t)
        Fn.mse_loss(model(x), y).backward()
        count = {"n": 0}

        def counting(self):
            count["n"] += 1
            return real(self)
        torch.Tensor.tolist = counting
        try:
            mkor.precondition()
        finally:
            torch.Tensor.tolist = real
        reads.append(count["n"])
        opt.step()
        opt.zero_grad()
    assert reads == [1, 0, 1, 0, 1, 0, 1, 0, 1]


def test_identity_factors_leave_the_gradient_unchanged():
    """KT7: with factors at I (nothing captured: eval mode) the preconditioned gradient
    equals the raw gradient bit for bit (I G I and a rescale by exactly 1)."""
    model, opt, mkor = make()
    model.eval()
    x, y = batch(0)
    Fn.mse_loss(model(x), y).backward()
    raw = [p.grad.clone() for p in model.parameters()]
    mkor.precondition()
    for p, g in zip(model.parameters(), raw):
        assert torch.equal(p.grad, g)


def test_parameters_of_skipped_modules_reach_the_backbone_untouched():
    """K1: LayerNorm and skip_modules layers keep their raw gradients (bit for bit)."""
    model, opt, mkor = make(skip_modules=["out"])
    assert mkor.preconditioned_modules == ["conv", "fc"]
    assert mkor.skipped_modules == ["norm", "out"]
    x, y = batch(0)
    Fn.mse_loss(model(x), y).backward()
    raw = {n: p.grad.clone() for n, p in model.named_parameters()}
    mkor.precondition()
    for n, p in model.named_parameters():
        # Skipped: identical. Preconditioned (factors updated at t = 0): changed.
        assert torch.equal(p.grad, raw[n]) == n.startswith(("norm", "out"))


def test_zero_gradients_give_no_nan():
    """KT6: a zero loss gradient (loss * 0) keeps every grad exactly zero."""
    model, opt, mkor = make()
    for t in range(3):
        x, y = batch(t)
        (0 * Fn.mse_loss(model(x), y)).backward()
        mkor.step()
        for p in model.parameters():
            assert torch.equal(p.grad, torch.zeros_like(p))
        opt.zero_grad()
    for L, R in mkor.inverse_factors().values():
        assert torch.isfinite(L).all() and torch.isfinite(R).all()


@pytest.mark.parametrize("variant", ["paper", "released"])
def test_non_finite_batch_is_skipped_and_counted(variant, device):
    """A NaN in the input never enters a factor: the update is skipped and counted
    (two factors per hooked layer downstream of the NaN), factors stay finite and SPD,
    and training continues (the caller skips the backbone step on a non-finite loss,
    as GradScaler does; that loss read is the caller's sync)."""
    model, opt, mkor = make(variant=variant, inv_freq=1, factor_dtype="float64", device=device)
    train(model, opt, mkor, 4, device=device)
    x, y = batch(99, device=device)
    x[0, 0, 0, 0] = float("nan")
    loss = Fn.mse_loss(model(x), y)
    loss.backward()
    mkor.precondition()
    assert not torch.isfinite(loss)
    opt.zero_grad()
    counters = mkor.counters()
    assert all(int(c["non_finite"]) == 2 for c in counters.values())
    assert int(mkor.skipped_updates) == 2 * len(counters)
    for L, R in mkor.inverse_factors().values():
        for J in (L, R):
            assert torch.isfinite(J).all()
            assert torch.linalg.eigvalsh(J).min() > 0
    updates_before = {n: int(c["updates_a"]) for n, c in counters.items()}
    final = train(model, opt, mkor, 4, start=5, device=device)
    assert torch.isfinite(torch.tensor(final))
    for n, c in mkor.counters().items():
        assert int(c["updates_a"]) == updates_before[n] + 4 and int(c["non_finite"]) == 2


@pytest.mark.parametrize("factor_dtype", ["bfloat16", "float16"])
def test_low_precision_factor_storage(factor_dtype):
    """Factors stored in 16 bits (arithmetic in float32) stay finite and symmetric, and
    fitting one fixed batch for 20 steps tracks the float32-factor run: the final
    losses agree to 10% (16-bit rounding perturbs each factor by <= 2^-8 relative)."""
    x, y = batch(0)
    finals = {}
    for dtype in (factor_dtype, "float32"):
        model, opt, mkor = make(factor_dtype=dtype, inv_freq=1)
        for _ in range(20):
            loss = Fn.mse_loss(model(x), y)
            if dtype == factor_dtype and _ == 0:
                first = loss.item()
            loss.backward()
            mkor.step()
            opt.zero_grad()
        finals[dtype] = Fn.mse_loss(model(x), y).item()
        if dtype == factor_dtype:
            for L, R in mkor.inverse_factors().values():
                assert L.dtype == R.dtype == getattr(torch, factor_dtype)
                for J in (L.float(), R.float()):
                    assert torch.isfinite(J).all() and torch.equal(J, J.T)
    assert finals[factor_dtype] < 0.5 * first
    assert abs(finals[factor_dtype] - finals["float32"]) <= 0.1 * finals["float32"]


def _checkpoint(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("variant,optimizer", [("paper", "sgd"), ("released", "adamw"),
                                               ("paper", "lamb")])
def test_state_dict_round_trip_is_bit_identical(variant, optimizer, device):
    """Save after 15 steps, load into a fresh model / optimizer / MKOR, then 10 steps in
    lockstep: parameters and factors stay bit-identical (inv_freq 3: the continuation
    crosses factor-update steps; released: deferred flags are part of the state)."""
    kwargs = dict(variant=variant, inv_freq=3, optimizer=optimizer, device=device)
    model, opt, mkor = make(seed=0, **kwargs)
    train(model, opt, mkor, 15, device=device)
    saved = _checkpoint({"model": model.state_dict(), "mkor": mkor.state_dict()})
    model2, opt2, mkor2 = make(seed=123, **kwargs)
    model2.load_state_dict(saved["model"])
    mkor2.load_state_dict(saved["mkor"])
    assert mkor2.steps == 15
    for t in range(15, 25):
        train(model, opt, mkor, 1, start=t, device=device)
        train(model2, opt2, mkor2, 1, start=t, device=device)
        for p, q in zip(model.parameters(), model2.parameters()):
            assert torch.equal(p, q)
    for name, (L, R) in mkor.inverse_factors().items():
        L2, R2 = mkor2.inverse_factors()[name]
        assert torch.equal(L, L2) and torch.equal(R, R2)
    for name, counters in mkor.counters().items():
        for key, value in counters.items():
            assert torch.equal(value, mkor2.counters()[name][key])


def test_load_state_dict_rejects_a_different_model():
    model, opt, mkor = make()
    other = nn.Linear(3, 3)
    mkor_other = MKOR(other, torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="do not match"):
        mkor_other.load_state_dict(mkor.state_dict())


def test_closure_step_returns_the_loss_and_trains():
    model, opt, mkor = make()
    x, y = batch(0)

    def closure():
        opt.zero_grad()
        loss = Fn.mse_loss(model(x), y)
        loss.backward()
        return loss

    first = mkor.step(closure)
    for _ in range(10):
        last = mkor.step(closure)
    assert last < first and mkor.steps == 11


def test_bf16_preconditioning_is_within_its_precision_and_still_preconditions():
    """precondition_dtype=bfloat16 runs L^-1 G R^-1 in bf16: each Delta entry carries a
    relative error of a few 2^-8 (rounded inputs, fp32 accumulation over d = 16 terms, twice),
    so after the norm-preserving rescale the gradient is within 3e-2 (relative, Frobenius) of
    the float32 result; and it differs from the raw gradient, i.e. it still preconditions."""
    grads = {}
    for dtype in (None, torch.bfloat16):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mkor = MKOR(model, opt, inv_freq=1, precondition_dtype=dtype)
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
        for _ in range(3):  # factors away from the identity
            model(x).square().mean().backward()
            raw = [p.grad.clone() for p in model.parameters()]
            mkor.precondition()
            grads[dtype] = [p.grad.clone() for p in model.parameters()]
            mkor.zero_grad()
    for g32, g16, r in zip(grads[None], grads[torch.bfloat16], raw):
        assert g16.dtype == torch.float32
        assert (g16 - g32).norm() <= 3e-2 * g32.norm()
    assert any((g - r).norm() > 0.1 * r.norm() for g, r in zip(grads[torch.bfloat16], raw))


class WideMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(40, 64), nn.Linear(64, 48, bias=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("variant", ["paper", "released"])
def test_steady_state_steps_allocate_no_matrix(variant):
    """Performance contract: after the first step, precondition() (factor update included)
    computes into a reused workspace and writes into .grad, so the largest tensor it
    allocates is a vector: measured at the dispatcher, the peak of new storage stays below
    one factor row block, against a 64 x 64 factor of 16 KiB. (Before the workspace every
    layer allocated three gradient-sized matrices per step.) Factors stored in float32 (the
    released column's float16 storage is cast to the compute dtype on every use)."""
    from figures.bench.step_memory import StepMemory

    torch.manual_seed(0)
    model = WideMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    mkor = MKOR(model, opt, inv_freq=2, variant=variant, factor_dtype=torch.float32)
    x, y = torch.randn(16, 40), torch.randn(16, 48)
    peaks = []
    for t in range(6):
        Fn.mse_loss(model(x), y).backward()
        due = mkor.factor_update_due()
        with StepMemory() as mem:
            mkor.precondition()
        opt.step()
        opt.zero_grad()
        if t >= 2:
            peaks.append((due, mem.peak_bytes))
    assert {due for due, _ in peaks} == {True, False}  # both kinds of step were measured
    smallest_matrix = 48 * 48 * 4
    assert max(p for _, p in peaks) < smallest_matrix / 4, peaks


def test_workspace_results_equal_the_allocating_path_bit_for_bit():
    """The workspace path (out= GEMMs, in-place factor and .grad writes) changes no bit."""
    from torch_impl.mkor.layer_state import Workspace  # noqa: F401  (exported)

    def run(use_workspace):
        model, opt, mkor = make(seed=3, inv_freq=2)
        if not use_workspace:
            mkor._workspace = None
        train(model, opt, mkor, 9)
        return [p.detach().clone() for p in model.parameters()], mkor.inverse_factors()

    (p1, f1), (p2, f2) = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(p1, p2))
    assert all(torch.equal(a, b) for k in f1 for a, b in zip(f1[k], f2[k]))
