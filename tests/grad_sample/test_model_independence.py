"""Model-level checks at private forwards: samples must not mix, buffers must not be written.

A parameter-free ``h - h.mean(0)`` between two Linears gives every layer mixed inputs: the
per-layer hooks cannot see it. Oracles: the clipped sum's sensitivity by hand (one added sample
moves it by more than ``C``), one autograd pass per sample for the models that are accepted
(``tests.hf.helpers``), and the RNG stream of the same loop with the check turned off.
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
from opacus_dp.grad_sample.batch_independence_check import BufferWrittenError, ModelMixesSamplesError
from opacus_dp.layers import DPLSTM, DPMultiheadAttention
from tests.hf.helpers import assert_private_step_matches_oracle

MODES = ["hooks", "functorch", "ghost", "bk"]


class Mix(nn.Module):
    """The issue's model: a parameter-free batch centring between two Linears."""

    def __init__(self, dim: int = 0):
        super().__init__()
        self.first, self.second, self.dim = nn.Linear(4, 8).double(), nn.Linear(8, 2).double(), dim
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.first(x)
        return self.second(h - h.mean(self.dim, keepdim=True))


class Center(nn.Module):
    def forward(self, h):
        return h - h.mean(0)


class Stats(nn.Module):
    """Keeps the batch mean of its input in a buffer (written from the data, no parameter)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("running", torch.zeros(8, dtype=torch.float64))

    def forward(self, h):
        self.running.mul_(0.9).add_(0.1 * h.detach().mean(0))
        return h


def _data(n=8, features=4):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, features, generator=g, dtype=torch.float64),
                         torch.randint(0, 2, (n,), generator=g))


def _private(model, mode, **options):
    """``(wrapper, optimizer, loader)`` of ``make_private`` in ``mode`` (σ = 0, C = 1)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_data(), batch_size=8), noise_multiplier=0.0, max_grad_norm=1.0,
            poisson_sampling=False, grad_sample_mode=mode, **options)
    return out[0], out[1], out[-1]


def _step(model, mode, **options):
    gsm, optimizer, loader = _private(model, mode, **options)
    x, y = next(iter(loader))
    optimizer.zero_grad()
    F.cross_entropy(gsm(x), y).backward()
    optimizer.step()
    return gsm


def test_the_mixing_model_breaks_the_sensitivity_bound():
    """Why it is refused: with the check off, adding one sample moves the clipped sum by > C."""
    torch.manual_seed(0)
    model, bound = Mix(), 1.0
    x, y = _data().tensors

    def clipped_sum(rows):
        grads = []
        for i in range(len(rows)):  # each sample's own loss term, in the batched forward
            model.zero_grad()
            F.cross_entropy(model(x[rows])[i:i + 1], y[rows][i:i + 1]).backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        return sum(g * min(1.0, bound / float(g.norm())) for g in grads)

    moved = float((clipped_sum(list(range(8))) - clipped_sum(list(range(7)))).norm())
    assert moved > 1.2 * bound


@pytest.mark.parametrize("mode", MODES)
def test_parameter_free_mixing_is_refused_in_every_mode(mode):
    torch.manual_seed(0)
    model = Mix()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ModelMixesSamplesError,
                       match=r"<root module> \(Mix\) \(its own forward.*other samples of the batch.*"
                             r"check_sample_independence=False"):
        _step(model, mode)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "no update"


@pytest.mark.parametrize("mode", MODES)
def test_the_mixing_submodule_is_named(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Tanh(), Center()), nn.Linear(8, 2)).double()
    with pytest.raises(UnsupportedModuleError, match=r"^1\.1 \(Center\): .*Make the layer per-sample"):
        _step(model, mode)


def test_opt_out_trains_the_mixing_model():
    torch.manual_seed(0)
    model = Mix()
    _step(model, "bk", check_sample_independence=False)
    with pytest.raises(TypeError, match="check_sample_independence must be a bool"):
        _private(Mix(), "hooks", check_sample_independence="no")


class BufferNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.stats, self.second = nn.Linear(4, 8).double(), Stats(), nn.Linear(8, 2).double()

    def forward(self, x):
        return self.second(self.stats(self.first(x)))


class Replacing(nn.Module):
    """Replaces its buffer by a new tensor (not in place) from the batch."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2).double()
        self.register_buffer("last", torch.zeros(4, dtype=torch.float64))

    def forward(self, x):
        self.last = x.detach().mean(0)
        return self.lin(x)


@pytest.mark.parametrize("mode", MODES)
def test_a_buffer_written_from_the_batch_is_refused_by_name(mode):
    torch.manual_seed(0)
    with pytest.raises(BufferWrittenError, match=r"^stats \(Stats\) writes in place \(or replaces\) its buffer 'running'.*"
                                                 r"public_buffers=\['stats.running'\]"):
        _step(BufferNet(), mode)


def test_a_replaced_buffer_is_refused_and_public_buffers_allow_it():
    torch.manual_seed(0)
    with pytest.raises(BufferWrittenError, match=r"<root module> \(Replacing\) writes in place \(or replaces\) its buffer 'last'"):
        _step(Replacing(), "hooks")
    model = Replacing()
    x = _data().tensors[0]
    _step(model, "hooks", public_buffers=["last"])
    assert torch.allclose(model.last, x.mean(0))  # written once: by the training forward only


def test_public_buffers_are_validated():
    with pytest.raises(ValueError, match=r"public_buffers names \['stats.nope'\].*'stats.running'"):
        _private(BufferNet(), "hooks", public_buffers=["stats.nope"])
    with pytest.raises(TypeError, match="public_buffers must be a list of buffer names"):
        _private(BufferNet(), "hooks", public_buffers="stats.running")


def test_the_check_leaves_buffers_as_one_forward_leaves_them():
    """A public buffer updated by the forward: after the first (checked) forward it holds one
    update, as without the check (the check's own runs are undone)."""
    torch.manual_seed(0)
    model = BufferNet()
    x = _data().tensors[0]
    with torch.no_grad():
        expected = 0.1 * model.first(x).mean(0)
    gsm = GradSampleModule(model, public_buffers=["stats.running"])
    gsm(x).sum().backward()
    assert torch.allclose(model.stats.running, expected, rtol=1e-12, atol=0)
    gsm.close()


def test_buffers_written_outside_private_forwards_are_allowed():
    model = BufferNet()
    gsm = GradSampleModule(model)
    x = _data().tensors[0]
    with torch.no_grad():
        gsm(x)  # evaluation: nothing recorded
    gsm.disable_hooks()
    gsm(x).sum().backward()  # an ordinary, non-private pass
    gsm.close()


def test_eval_mode_forwards_are_not_checked_and_batches_of_one_wait():
    torch.manual_seed(0)
    model = Mix()
    gsm = GradSampleModule(model)
    x = _data().tensors[0]
    model.eval()
    gsm(x).sum().backward()
    assert model.calls == 1, "eval mode: no check"
    gsm.zero_grad()
    model.train()
    gsm(x[:1]).sum().backward()  # a batch of one proves nothing
    assert model.calls == 2
    gsm.zero_grad()
    with pytest.raises(ModelMixesSamplesError):
        gsm(x)
    gsm.close()


def test_sequence_first_layout_checks_the_batch_dimension():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 4, dtype=torch.float64)  # (T, B, features)
    fine = GradSampleModule(Mix(dim=0), batch_first=False)  # mean over time: per sample
    fine(x).sum().backward()
    fine.close()
    mixed = GradSampleModule(Mix(dim=1), batch_first=False)
    with pytest.raises(ModelMixesSamplesError, match=r"<root module> \(Mix\)"):
        mixed(x)
    mixed.close()


class Dropouts(nn.Module):
    """Dropout as a module, functional dropout and attention dropout, all in training mode."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.drop = nn.Dropout(0.5)
        self.attn = DPMultiheadAttention(8, 2, dropout=0.5, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = self.drop(self.lin(x)).unsqueeze(1).expand(-1, 3, -1)
        h = F.dropout(h, 0.3, training=self.training)
        return self.head(self.attn(h, h, h, need_weights=False)[0].mean(1))


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_dropout_is_not_refused_and_the_rng_stream_is_unchanged(mode):
    streams = []
    for check in (True, False):
        torch.manual_seed(0)
        model = Dropouts()
        gsm, optimizer, loader = _private(model, mode, check_sample_independence=check)
        x, y = next(iter(loader))
        out = gsm(x.float())
        F.cross_entropy(out, y).backward()
        optimizer.step()
        streams.append((out.detach(), torch.rand(5), [p.detach().clone() for p in model.parameters()]))
        gsm.close()
    (out_a, rand_a, params_a), (out_b, rand_b, params_b) = streams
    assert torch.equal(out_a, out_b) and torch.equal(rand_a, rand_b)
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.AdaptiveAvgPool2d(2))
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


class Recurrent(nn.Module):
    def __init__(self, batch_first: bool):
        super().__init__()
        self.lstm, self.head, self.batch_first = DPLSTM(4, 5, batch_first=batch_first), nn.Linear(5, 3), batch_first

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1] if self.batch_first else out[-1])


_IMAGES = torch.randn(4, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
_SEQ = torch.randn(4, 6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
_LABELS = torch.tensor([0, 2, 1, 2])


def _cnn():
    torch.manual_seed(0)
    return CNN().double()


def _lstm():
    torch.manual_seed(0)
    return Recurrent(batch_first=True).double()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("build,inputs", [(_cnn, _IMAGES), (_lstm, _SEQ)], ids=["cnn", "dplstm"])
def test_ordinary_models_are_accepted_and_match_the_oracle(build, inputs, mode):
    loss = lambda model, criterion, rows: criterion(model(inputs[rows]), _LABELS[rows])  # noqa: E731
    assert_private_step_matches_oracle(build, loss, 4, mode)


def test_dplstm_sequence_first_is_accepted():
    torch.manual_seed(0)
    gsm = GradSampleModule(Recurrent(batch_first=False).double(), batch_first=False)
    gsm(_SEQ.transpose(0, 1)).sum().backward()
    assert gsm._module.head.weight.grad_sample.shape == (4, 3, 5)
    gsm.close()


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_tiny_transformers_model_is_accepted_and_matches_the_oracle(mode):
    pytest.importorskip("transformers")
    from tests.hf.matrix_models import causal_lm_loss, lora_gpt2, roberta, classify_tokens_loss

    assert_private_step_matches_oracle(roberta, classify_tokens_loss, 3, mode)
    pytest.importorskip("peft")
    assert_private_step_matches_oracle(lora_gpt2, causal_lm_loss, 3, mode)


def test_transformers_model_with_dropout_in_training_mode_is_accepted():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)  # dropout 0.1 everywhere, attention included
    gsm = GradSampleModule(model)
    ids = torch.randint(0, 50, (3, 6))
    gsm(input_ids=ids, labels=ids).loss.backward()
    assert model.lm_head.weight.grad_sample.shape[0] == 3
    gsm.close()


@pytest.mark.parametrize("check", [True, False])
def test_classic_engine_checks_and_opts_out(check):
    from opacus_dp.engine.classic import PrivacyEngine as ClassicPrivacyEngine

    torch.manual_seed(0)
    model = Mix()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = ClassicPrivacyEngine(model, batch_size=8, sample_size=64, noise_multiplier=0.0, max_grad_norm=1.0,
                                      check_sample_independence=check)
        engine.attach(optimizer)
    x, y = _data().tensors
    if check:
        with pytest.raises(ModelMixesSamplesError, match=r"<root module> \(Mix\)"):
            model(x)
    else:
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    engine.detach()


class AlwaysRandom(nn.Module):
    """Dropout even in eval mode (``training=True``): runs cannot be compared, so not checked."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2).double()

    def forward(self, x):
        return self.lin(F.dropout(x, 0.5, training=True))


def test_a_model_random_even_in_eval_mode_is_not_taken_for_mixing():
    torch.manual_seed(0)
    gsm = GradSampleModule(AlwaysRandom())
    gsm(_data().tensors[0]).sum().backward()
    assert gsm._module.lin.weight.grad_sample.shape == (8, 2, 4)
    gsm.close()


class CentredRecurrent(Recurrent):
    """A batch-first DPLSTM, then the batch mean subtracted from its last output."""

    def forward(self, x):
        out, _ = self.lstm(x)
        h = out[:, -1]
        return self.head(h - h.mean(0))


def test_a_layout_other_than_the_wrappers_is_tried_before_refusing():
    """A DP RNN keeps its own layout whatever the wrapper's batch_first says: such a model is
    refused only if it mixes samples in both layouts."""
    torch.manual_seed(0)
    fine = GradSampleModule(Recurrent(batch_first=True).double(), batch_first=False)
    fine(_SEQ).sum().backward()  # (B, T, F) though the wrapper says sequence-first
    assert fine._module.head.weight.grad_sample.shape == (4, 3, 5)
    fine.close()
    mixed = GradSampleModule(CentredRecurrent(batch_first=True).double(), batch_first=False)
    with pytest.raises(ModelMixesSamplesError, match=r"<root module> \(CentredRecurrent\)"):
        mixed(_SEQ)
    mixed.close()


def test_the_tolerance_is_that_of_the_precision_used():
    from opacus_dp.grad_sample.batch_independence_check import model_tolerance

    t = lambda dtype: torch.zeros(1, dtype=dtype)  # noqa: E731
    assert model_tolerance(t(torch.float32)) == 1.6e-4 == model_tolerance(t(torch.float64))
    assert model_tolerance(t(torch.bfloat16)) == 16 * 2.0 ** -7
    assert model_tolerance(t(torch.float16)) == 16 * 2.0 ** -10


class Weak(nn.Module):
    """Adds 1% of the batch mean between two float32 Linears."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(64, 64), nn.Linear(64, 4)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        return self.second(h + 0.01 * h.mean(0))


def test_a_weak_mixing_is_refused_in_float32_and_wide_models_are_not():
    torch.manual_seed(0)
    gsm = GradSampleModule(Weak())
    with pytest.raises(ModelMixesSamplesError, match=r"<root module> \(Weak\)"):
        gsm(torch.randn(32, 64))
    gsm.close()
    wide = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 8))
    gsm = GradSampleModule(wide)
    gsm(torch.randn(64, 512)).sum().backward()
    assert wide[0].weight.grad_sample.shape == (64, 512, 512)
    gsm.close()
