"""The torch.func fallback refuses a layer whose outputs depend on other samples.

Its per-sample gradients assume ``f(theta, x)_i = f(theta, x_i)``; ``(x - x.mean(0)) * w`` breaks
that and used to be trained with a wrong private gradient. Oracle for the accepted layers: one
autograd pass per sample (``tests.grad_sample.oracle``).
"""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.errors import UnsupportedModuleError
from opacus_dp.grad_sample import GradSampleModule
from opacus_dp.grad_sample.sample_independence import relative_gap, tolerance
from tests.grad_sample.oracle import assert_grad_samples_close, gsm_grad_samples, oracle_grad_samples

MODES = ["hooks", "functorch", "ghost", "bk"]
MIXED = r"other samples of the batch.*Make the layer per-sample"


class Centered(nn.Module):
    """``(x - mean) * w``, the mean over ``mean_dim`` (the batch's: mixes samples; -1: per sample)."""

    def __init__(self, mean_dim: int, features: int = 3):
        super().__init__()
        self.w = nn.Parameter(torch.randn(features, dtype=torch.float64))
        self.mean_dim = mean_dim
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return (x - x.mean(self.mean_dim, keepdim=True)) * self.w


class Net(nn.Module):
    def __init__(self, mean_dim: int):
        super().__init__()
        self.block = nn.Sequential()
        self.block.add_module("proj", nn.Linear(4, 3).double())
        self.block.add_module("mix", Centered(mean_dim=mean_dim))
        self.head = nn.Linear(3, 2).double()

    def forward(self, x):
        return self.head(torch.tanh(self.block(x)))


def _private_step(model, mode):
    """One forward/backward/step of ``make_private(model)`` in ``mode`` (σ = 0)."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randint(0, 2, (8,), generator=g))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=8), noise_multiplier=0.0, max_grad_norm=1.0,
            poisson_sampling=False, grad_sample_mode=mode)
    gsm, optimizer, loader = out[0], out[1], out[-1]  # ghost also returns its criterion
    x, y = next(iter(loader))
    optimizer.zero_grad()
    F.cross_entropy(gsm(x), y).backward()
    optimizer.step()


@pytest.mark.parametrize("mode", MODES)
def test_mixing_layer_is_refused_by_path_in_every_mode(mode):
    torch.manual_seed(0)
    model = Net(mean_dim=0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UnsupportedModuleError, match=r"block\.mix \(Centered\).*" + MIXED):
        _private_step(model, mode)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "no update"


@pytest.mark.parametrize("mode", MODES)
def test_per_sample_variant_trains_in_every_mode(mode):
    torch.manual_seed(0)
    _private_step(Net(mean_dim=-1), mode)


@pytest.mark.parametrize("force_functorch", [False, True])
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_per_sample_variant_matches_the_oracle(force_functorch, loss_reduction):
    torch.manual_seed(0)
    model, x = Net(mean_dim=-1), torch.randn(5, 4, dtype=torch.float64)
    got = gsm_grad_samples(model, (x,), loss_reduction=loss_reduction, force_functorch=force_functorch)
    assert_grad_samples_close(got, oracle_grad_samples(model, (x,)))


def test_sequence_first_layout_refuses_the_batch_mean_but_not_the_time_mean():
    """batch_first=False: dim 0 is time (a per-sample mean), dim 1 the batch."""
    torch.manual_seed(0)
    x = torch.randn(6, 5, 3, dtype=torch.float64)  # (T, B, features)
    over_time = nn.Sequential(Centered(mean_dim=0))
    got = gsm_grad_samples(over_time, (x,), batch_first=False, force_functorch=True)
    assert_grad_samples_close(got, oracle_grad_samples(over_time, (x,), batch_dim=1))
    gsm = GradSampleModule(nn.Sequential(Centered(mean_dim=1)), batch_first=False)
    with pytest.raises(UnsupportedModuleError, match=r"0 \(Centered\).*" + MIXED):
        gsm(x).square().sum().backward()
    gsm.close()


class TwoOutputs(nn.Module):
    """A per-sample output and, with ``mixed``, a second output centred on the batch's mean."""

    def __init__(self, mixed: bool):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, dtype=torch.float64))
        self.mixed = mixed

    def forward(self, x, *, shift=None):
        h = torch.tanh(x * self.w) + (0 if shift is None else shift)
        side = (x * self.w).sum(-1)
        return h, (side - side.mean(0) if self.mixed else side)


def test_tuple_outputs_with_keyword_are_checked_output_by_output():
    torch.manual_seed(0)
    x, shift = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    loss = lambda out: out[0].square().sum() + out[1].square().sum()  # noqa: E731
    fine = TwoOutputs(mixed=False)
    got = gsm_grad_samples(fine, (x,), {"shift": shift}, loss_reduction="sum", loss_fn=loss)
    assert_grad_samples_close(got, oracle_grad_samples(fine, (x,), {"shift": shift}, loss_fn=loss))
    gsm = GradSampleModule(nn.ModuleDict({"pair": TwoOutputs(mixed=True)}))
    with pytest.raises(UnsupportedModuleError, match=r"pair \(TwoOutputs\).*other samples.*output #1:.*per-sample"):
        loss(gsm._module["pair"](x, shift=shift)).backward()
    gsm.close()


def test_batch_of_one_proves_nothing_the_first_larger_batch_is_checked():
    torch.manual_seed(0)
    gsm = GradSampleModule(nn.Sequential(Centered(mean_dim=0)), force_functorch=True)
    gsm(torch.randn(1, 3, dtype=torch.float64)).square().sum().backward()  # exact for B = 1
    assert gsm._module[0].w.grad_sample.shape == (1, 3)
    gsm.zero_grad()
    with pytest.raises(UnsupportedModuleError, match=r"0 \(Centered\).*" + MIXED):
        gsm(torch.randn(4, 3, dtype=torch.float64)).square().sum().backward()
    gsm.close()


def test_the_check_runs_once_per_layer():
    """Forward calls of the layer: the call itself, the vmapped per-sample one, and the batched
    recomputation of the check only on the first call with B >= 2 (the model-level check, which
    runs the model three more times once, is off here)."""
    layer = Centered(mean_dim=-1)
    gsm = GradSampleModule(nn.Sequential(layer), check_sample_independence=False)
    counts = []
    for batch in (1, 4, 4, 3):
        before = layer.calls
        gsm(torch.randn(batch, 3, dtype=torch.float64)).square().sum().backward()
        counts.append(layer.calls - before)
        gsm.zero_grad()
    assert counts == [2, 3, 2, 2]
    gsm.close()


class Slight(nn.Module):
    """Mixes by a small fraction of the batch mean: still refused in float32."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64) / 8)

    def forward(self, x):
        return (x + 1e-3 * x.mean(0)) @ self.w


class Wide(nn.Module):
    """A legit layer with long float reductions (different order batched and per sample)."""

    def __init__(self, dtype):
        super().__init__()
        self.w = nn.Parameter(torch.randn(512, 256, dtype=dtype) / 16)

    def forward(self, x):
        return torch.tanh(x @ self.w).cumsum(-1) - (x @ self.w).mean(-1, keepdim=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_float_reductions_are_not_taken_for_mixing(dtype):
    torch.manual_seed(0)
    gsm = GradSampleModule(nn.Sequential(Wide(dtype)))
    gsm(torch.randn(32, 512, dtype=dtype)).float().square().sum().backward()
    assert gsm._module[0].w.grad_sample.shape == (32, 512, 256)
    gsm.close()


def test_a_small_mixture_is_refused_in_float32():
    torch.manual_seed(0)
    gsm = GradSampleModule(nn.Sequential(Slight()))
    with pytest.raises(UnsupportedModuleError, match=MIXED):
        gsm(torch.randn(16, 64)).square().sum().backward()
    gsm.close()


def test_tolerance_and_gap_rules():
    cpu = torch.device("cpu")
    assert tolerance(torch.float32, cpu) == 1e-5 and tolerance(torch.float64, cpu) == 1e-5
    assert tolerance(torch.bfloat16, cpu) == 8 * 2.0 ** -7
    a = torch.tensor([1.0, float("nan"), float("inf")])
    assert relative_gap(a, a.clone()) == 0.0
    assert relative_gap(a, torch.tensor([1.0, 0.0, float("inf")])) == float("inf")
    assert relative_gap(torch.zeros(0), torch.zeros(0)) == 0.0


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return F.dropout(x * self.w, 0.5, training=self.training)


def test_dropout_layer_gets_the_randomness_message_not_the_mixing_one():
    """Randomness is refused by the fallback itself (vmap's randomness="error") before the check;
    the same layer in eval mode is accepted."""
    layer = Noisy()
    gsm = GradSampleModule(nn.Sequential(layer))
    with pytest.raises(ValueError, match=r"0 \(Noisy\).*random operation") as info:
        gsm(torch.randn(4, 3)).sum().backward()
    assert "other samples" not in str(info.value)
    gsm.zero_grad()
    layer.eval()
    gsm(torch.randn(4, 3)).sum().backward()
    assert layer.w.grad_sample.shape == (4, 3)
    gsm.close()
