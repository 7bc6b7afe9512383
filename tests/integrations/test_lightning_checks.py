"""The model checks of a private Lightning run (:mod:`opacus_dp.integrations.lightning_checks`):
``check_sample_independence`` and ``public_buffers`` of ``DPCallback``, on by default.

Oracles: models that mix samples or write buffers by construction (a batch mean, a counter), and
a run with the checks off, which the run with them on must equal bitwise (the checks draw no
random numbers and change no state).
"""

import pytest
import torch
import torch.nn.functional as F

pl = pytest.importorskip("lightning.pytorch", reason="the Lightning integration needs the 'lightning' package")

from opacus_dp.grad_sample.batch_independence_check import ModelMixesSamplesError  # noqa: E402
from opacus_dp.grad_sample.buffer_writes import BufferWrittenError  # noqa: E402
from opacus_dp.integrations.lightning import DPCallback  # noqa: E402
from tests.integrations.lightning_support import CLASSES, FEATURES, N, BATCH, Recorder, data, fit  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:secure_mode")

STEPS = 2 * N // BATCH


def callback(**options):
    settings = dict(target_delta=1e-5, max_grad_norm=1.0, noise_multiplier=0.7, accountant="rdp")
    settings.update(options)
    return DPCallback(**settings)


class Centre(torch.nn.Module):
    """Subtracts the batch mean: each sample's output depends on the others."""

    def forward(self, h):
        return h - h.mean(dim=0, keepdim=True)


class Counter(torch.nn.Module):
    """Counts the examples it has seen in a buffer (released by state_dict() without noise)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, h):
        self.seen += h.shape[0]
        return h


def with_layer(layer):
    module = Recorder(*data())
    module.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), layer, torch.nn.Tanh(),
                                     torch.nn.Linear(16, CLASSES))
    return module


class OwnForward(Recorder):
    """training_step calls self(x); forward centres between two submodules (``mix``) or not."""

    def __init__(self, mix: bool):
        torch.manual_seed(1)
        super().__init__(*data())
        self.first, self.second, self.mix = torch.nn.Linear(FEATURES, 16), torch.nn.Linear(16, CLASSES), mix

    def forward(self, x):
        h = self.first(x)
        return self.second(torch.tanh(h - h.mean(dim=0) if self.mix else h))

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.records.append((None, x.clone(), y.clone()))
        return F.cross_entropy(self(x), y)


class CountsInTrainingStep(Recorder):
    def __init__(self):
        super().__init__(*data())
        self.register_buffer("batches_seen", torch.zeros(()))

    def training_step(self, batch, batch_idx):
        self.batches_seen += 1
        return super().training_step(batch, batch_idx)


def trained(module, **options):
    pl.seed_everything(0)
    fit(module, [callback(**options)])
    return module


def test_a_submodule_that_mixes_samples_is_refused_unless_the_check_is_off():
    with pytest.raises(ModelMixesSamplesError, match=r"submodule 'net': 1 \(Centre\).*check_sample_independence"):
        trained(with_layer(Centre()))
    assert len(trained(with_layer(Centre()), check_sample_independence=False).records) == STEPS


def test_a_forward_that_mixes_between_submodules_is_refused():
    with pytest.raises(ModelMixesSamplesError, match="LightningModule's forward"):
        trained(OwnForward(mix=True))
    assert len(trained(OwnForward(mix=False)).records) == STEPS


def test_buffer_writes_are_refused_unless_public():
    with pytest.raises(BufferWrittenError, match=r"net\.1 \(Counter\).*'seen'.*DPCallback\(public_buffers"):
        trained(with_layer(Counter()))
    module = trained(with_layer(Counter()), public_buffers=["net.1.seen"])
    assert len(module.records) == STEPS and float(module.net[1].seen) == sum(len(y) for _, _, y in module.records)
    with pytest.raises(BufferWrittenError, match="'batches_seen'"):
        trained(CountsInTrainingStep())
    assert len(trained(CountsInTrainingStep(), check_sample_independence=False).records) == STEPS


class CountsAfterTwoBatches(Recorder):
    """Writes a buffer from its third batch on: in a compiled run, in a step traced into a graph
    (the first step runs eagerly, to learn the hooked calls)."""

    def __init__(self):
        super().__init__(*data())
        self.register_buffer("batches_seen", torch.zeros(()))

    def training_step(self, batch, batch_idx):
        if batch_idx >= 2:
            self.batches_seen += 1
        return super().training_step(batch, batch_idx)


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_checks_hold_for_a_compiled_module(backend, monkeypatch):
    from tests.compile.helpers import count_tapped_calls

    def compiled_fit(module):
        pl.seed_everything(0)
        fit(torch.compile(module, backend=backend), [callback()])

    with pytest.raises(ModelMixesSamplesError, match=r"submodule 'net': 1 \(Centre\)"):
        compiled_fit(with_layer(Centre()))
    with pytest.raises(ModelMixesSamplesError, match="LightningModule's forward"):
        compiled_fit(OwnForward(mix=True))
    module, tapped = CountsAfterTwoBatches(), count_tapped_calls(monkeypatch)
    with pytest.raises(BufferWrittenError, match="'batches_seen'"):
        compiled_fit(module)
    assert len(module.records) == 3  # refused in the third step, before its backward pass
    assert tapped == [2, 2]  # the second and third steps ran tapped (compiled)


def test_checks_leave_training_unchanged():
    checked, unchecked = trained(OwnForward(mix=False)), trained(OwnForward(mix=False), check_sample_independence=False)
    for a, b in zip(checked.parameters(), unchecked.parameters()):
        assert torch.equal(a, b)
    assert not any(m._forward_pre_hooks for m in checked.modules())  # hooks removed at teardown


def test_bad_check_settings_are_refused():
    with pytest.raises(ValueError, match="not buffers of the model"):
        trained(Recorder(*data()), public_buffers=["net.0.nothing"])
    with pytest.raises(TypeError, match="list of buffer names"):
        callback(public_buffers="net.1.seen")
    with pytest.raises(TypeError, match="check_sample_independence must be a bool"):
        callback(check_sample_independence=1)
