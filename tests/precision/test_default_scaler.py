"""Float16 autocast with torch's default ``GradScaler`` (``init_scale = 2¹⁶``), in every mode.

With a mean loss the scaled output gradient of one sample is ``s · ∂ℓ_i/∂out / B``; the
per-sample gradients undo the mean (``× B``), which puts ``s · ∂ℓ_i/∂out`` — up to ``2¹⁶`` for a
cross-entropy — beyond float16's 65504. The per-sample products must not overflow there: the
update must match a float32 per-sample autograd oracle (σ = 0, clipping active) step after step,
and the scaler must never back off (no data-dependent skipped step). An overflow is never blamed
on a use of a parameter outside its module, and ``scaler.scale`` of the ``ghost`` criterion's
loss names the supported way.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import opacus_dp
from opacus_dp.grad_sample.functorch_fallback import functorch_grad_sample

pytestmark = [pytest.mark.filterwarnings("ignore:GradScaler is going to stop"),
              pytest.mark.filterwarnings("ignore:secure_mode"),
              pytest.mark.filterwarnings("ignore:Optimal RDP order"),
              pytest.mark.filterwarnings("ignore:the accountant assumes Poisson sampling")]

MODES = ("hooks", "functorch", "ghost", "bk")
BATCH, STEPS, LR, C = 16, 3, 0.5, 0.5
# relative to each tensor's largest entry of the total update over STEPS steps: 8 units of
# float16's rounding (2⁻¹¹) of the model's own forward and backward; measured ≤ 5.2e-4 (1 unit)
TOLERANCE = 4e-3


class _Tokens(nn.Module):
    """Embedding, then a Linear on every position ``(B, T, d)``, then a head on the flattened."""

    def __init__(self, vocab: int = 20, length: int = 6, width: int = 8):
        super().__init__()
        self.embedding, self.mix = nn.Embedding(vocab, width), nn.Linear(width, width)
        self.head = nn.Linear(length * width, 4)
        nn.init.normal_(self.embedding.weight, std=4.0)

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embedding(tokens))).flatten(1))


NETS = ("mlp", "conv", "tokens")


def _model(net: str = "mlp", seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if net == "conv":
        return nn.Sequential(nn.Conv1d(2, 6, 3), nn.Tanh(), nn.Flatten(), nn.Linear(6 * 6, 4))
    if net == "tokens":
        return _Tokens()
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def _data(net: str = "mlp"):
    g = torch.Generator().manual_seed(3)
    shape = {"mlp": (BATCH, 8), "conv": (BATCH, 2, 8)}.get(net)
    x = torch.randint(0, 20, (BATCH, 6), generator=g) if shape is None else 3 * torch.randn(*shape, generator=g)
    return x, torch.randint(0, 4, (BATCH,), generator=g)


def _private(mode: str, model: nn.Module, x, y, loss_reduction="mean", lr=LR, policy=None):
    engine = opacus_dp.PrivacyEngine(accountant="rdp")
    criterion = nn.CrossEntropyLoss(reduction=loss_reduction)
    out = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=len(x)), noise_multiplier=0.0,
        max_grad_norm=C, grad_sample_mode=mode, poisson_sampling=False, loss_reduction=loss_reduction,
        **({"criterion": criterion} if mode == "ghost" else {}))
    module, optimizer = out[0], out[1]
    if policy is not None:
        optimizer.non_finite_samples = policy
    return engine, module, optimizer, (out[2] if mode == "ghost" else criterion)


def _oracle_parameters(net, x, y):
    """STEPS steps of SGD on the float32 model: ``θ ← θ − lr · Σ_i f_i g_i / B``, ``g_i`` by
    autograd on sample ``i`` alone, ``f_i = min(1, C / (‖g_i‖ + 1e-6))``."""
    model = _model(net)
    params = list(model.parameters())
    for _ in range(STEPS):
        rows = [torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params)
                for i in range(len(x))]
        with torch.no_grad():
            for j, p in enumerate(params):
                total = torch.zeros_like(p, dtype=torch.float64)
                for row in rows:
                    norm = torch.sqrt(sum(r.double().pow(2).sum() for r in row))
                    total += min(1.0, C / (float(norm) + 1e-6)) * row[j].double()
                p -= (LR * total / len(x)).to(p.dtype)
    return [p.detach() for p in params]


def _scaled_steps(net: str, mode: str, x, y):
    """STEPS private steps under float16 autocast with ``torch.amp.GradScaler("cpu")`` at its
    defaults; the parameters and the scale after each step."""
    _, module, optimizer, criterion = _private(mode, _model(net), x, y)
    scaler = torch.amp.GradScaler("cpu")
    scales = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = module(x)
        loss = criterion(out.float(), y)
        scaler.scale(getattr(loss, "value", loss)).backward()  # ghost: its plain loss tensor
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return [p.detach() for p in optimizer.params], scales


def _relative_update_error(got, want, start):
    return max(float(((a.double() - b.double()).abs().max()) / (b.double() - s.double()).abs().max())
               for a, b, s in zip(got, want, start))


@pytest.mark.parametrize("net", NETS)
@pytest.mark.parametrize("mode", MODES)
def test_the_default_scaler_matches_the_float32_oracle(mode, net):
    x, y = _data(net)
    got, scales = _scaled_steps(net, mode, x, y)
    want = _oracle_parameters(net, x, y)
    start = [p.detach() for p in _model(net).parameters()]
    assert scales == [2.0 ** 16] * STEPS  # no step skipped, no back-off
    assert _relative_update_error(got, want, start) < TOLERANCE


@pytest.mark.parametrize("net", NETS)
def test_the_scaled_per_sample_gradients_are_beyond_float16(net):
    """The premise of the test above: some entry of a scaled per-sample gradient ``s · g_i``
    (what the per-sample products form, the mean undone) exceeds float16's largest value."""
    x, y = _data(net)
    model = _model(net)
    largest = max(float(g.abs().max()) for i in range(len(x))
                  for g in torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]),
                                               list(model.parameters())))
    assert 2.0 ** 16 * largest > torch.finfo(torch.float16).max


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_an_overflow_is_not_blamed_on_an_outside_use(mode):
    """A float16 model (no autocast) whose per-sample gradients overflow where the batch's
    total does not (the mean's ``× B``, in float16): the backward pass names no outside use; the
    step drops the overflowing samples (``"drop"``) or, for debugging, refuses naming the
    overflow (``"refuse"``)."""
    g = torch.Generator().manual_seed(5)
    x, y = 10 * torch.randn(64, 8, generator=g).half(), torch.randint(0, 4, (64,), generator=g)
    for policy in ("drop", "refuse"):
        engine, module, optimizer, _ = _private(mode, _model().half(), x, y, policy=policy)
        loss = F.cross_entropy(module(x).float(), y) * 2.0 ** 15  # a loss scale, by hand
        loss.backward()  # before: "received a gradient from a use outside the module"
        samples = optimizer.params[0].grad_sample
        assert not bool(torch.isfinite(samples).all())
        assert bool(torch.isfinite(optimizer.params[0].grad).all())
        if policy == "drop":
            optimizer.step()
            assert all(bool(torch.isfinite(p).all()) for p in optimizer.params)
            assert len(engine.accountant) == 1
        else:
            with pytest.raises(ValueError, match="overflow"):
                optimizer.step()


def test_the_fallback_recomputes_large_output_gradients_within_float16():
    """``torch.func`` under float16 autocast with output gradients up to ``2²⁰``: each sample's
    weight gradient is ``g_iᵀ x_i`` (x as autocast rounds it) to float16's rounding, and a sample
    with an inf output gradient stays non-finite (the step drops it) without touching the others."""
    g = torch.Generator().manual_seed(7)
    layer = nn.Linear(8, 4)
    x = torch.randn(6, 3, 8, generator=g)
    grads = torch.randn(6, 3, 4, generator=g) * 2.0 ** torch.arange(15, 21).view(6, 1, 1)
    grads[5, 0, 0] = float("inf")
    with torch.autocast("cpu", dtype=torch.float16):
        got = functorch_grad_sample(layer, [x], grads)[layer.weight]
    want = torch.einsum("bto,bti->boi", grads.double(), x.half().double())
    assert got.dtype == torch.float32
    assert bool(torch.isfinite(got[:5]).all()) and not bool(torch.isfinite(got[5]).all())
    for i in range(5):
        assert float((got[i].double() - want[i]).abs().max() / want[i].abs().max()) < TOLERANCE


class _OutsideUse(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.head = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.inner(x) + F.linear(x, self.inner.weight))  # a use outside `inner`


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_a_real_outside_use_is_still_named_under_the_default_scaler(mode):
    """Finite values are compared as before: the check still finds a use outside the module."""
    x, y = _data()
    torch.manual_seed(0)
    _, module, _, criterion = _private(mode, _OutsideUse(), x, y)
    with torch.autocast("cpu", dtype=torch.float16):
        out = module(x)
    with pytest.raises(RuntimeError, match=r"inner\.weight received a gradient from a use outside"):
        torch.amp.GradScaler("cpu").scale(criterion(out.float(), y)).backward()


def test_scaler_scale_of_the_ghost_loss_names_the_fix():
    x, y = _data()
    _, module, optimizer, criterion = _private("ghost", _model(), x, y)
    with torch.autocast("cpu", dtype=torch.float16):
        out = module(x)
    loss = criterion(out.float(), y)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(TypeError, match=r"scaler\.scale\(loss\.value\)\.backward\(\)"):
        scaler.scale(loss)
    scaler.scale(loss.value).backward()  # the supported way still works afterwards
    scaler.step(optimizer)
    assert optimizer.steps_taken == 1
