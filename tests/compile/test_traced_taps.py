"""Traced taps (``opacus_dp.grad_sample.traced_taps``): the hooked calls of a compiled forward stay
in its graph, and training is the eager training (the oracle) in every mode."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrizations
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.grad_sample import GradSampleModule
from opacus_dp.grad_sample.bookkeeping.weight_grad_skipping import OutsideUseCheck
from opacus_dp.grad_sample.detached_forwards import detached_forward
from opacus_dp.grad_sample.traced_taps import TracedTaps, input_signature
from tests.compile import helpers
from tests.compile.helpers import (assert_same_training, batch, build, compile_after, compile_in_place, count_tapped_calls,
                                   eager_training, initial, make_private, steps, train)

pytestmark = pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")

SEQUENTIAL_CALLS = 3  # two convolutions and the head of tests.compile.helpers.sequential_cnn


@pytest.fixture
def tapped(monkeypatch):
    """The number of tapped calls of each compiled forward that was tapped."""
    return count_tapped_calls(monkeypatch)


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost", "bk"])
def test_every_call_of_a_layer_loop_is_tapped_and_training_is_eager_training(mode, tapped):
    sizes = (8, 6, 8, 1)
    expected = eager_training("sequential_cnn", mode, sizes=sizes)
    got = train("sequential_cnn", mode, after=compile_after("aot_eager"), sizes=sizes)
    assert_same_training(got, expected, initial("sequential_cnn"))
    assert tapped == [SEQUENTIAL_CALLS] * (len(sizes) - 1)  # the first forward learns the calls


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_empty_batches_are_tapped_too(mode, tapped):
    sizes = (8, 0, 5)
    expected = eager_training("sequential_cnn", mode, sizes=sizes)
    assert_same_training(train("sequential_cnn", mode, after=compile_after("aot_eager"), sizes=sizes), expected,
                         initial("sequential_cnn"))
    assert tapped == [SEQUENTIAL_CALLS] * 2


@pytest.mark.slow
def test_inductor(tapped):
    """Inductor gives the output gradients in its own layouts (channels-last convolutions)."""
    expected = eager_training("sequential_cnn", "bk")
    got = train("sequential_cnn", "bk", after=compile_in_place("inductor"))
    assert_same_training(got, expected, initial("sequential_cnn"))
    assert tapped == [SEQUENTIAL_CALLS] * 2


def test_the_batch_size_is_not_part_of_what_is_learned():
    model = build("sequential_cnn")
    private, optimizer, criterion = make_private(model, "bk", "sequential_cnn")
    private.compile(backend="eager")
    steps(private, optimizer, criterion, "sequential_cnn", sizes=(8, 6, 3))
    (layouts,) = private._taps.layouts.values()
    assert [layout.path for layout in layouts] == ["0", "3", "6"]


BLOCK_CALLS = 6  # the Block's two embeddings, LayerNorm and three Linear layers


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost", "bk"])
@pytest.mark.parametrize("sizes", [(8, 6, 8, 1), (1, 6, 8)], ids=["learned on a batch", "learned on one sample"])
def test_a_call_on_one_sample_broadcast_over_the_batch_is_tapped(mode, sizes, tapped):
    """The Block's position embedding is called on one row, broadcast over the batch: its traced
    pre-hook expands the call to its tap's batch size, as the eager pre-hook does, also where the
    forward that learned the calls had one sample (nothing expanded then)."""
    expected = eager_training("block", mode, sizes=sizes)
    assert_same_training(train("block", mode, after=compile_after("aot_eager"), sizes=sizes), expected,
                         initial("block"))
    assert tapped == [BLOCK_CALLS] * (len(sizes) - 1)


def test_a_forward_with_a_call_that_cannot_be_tapped_keeps_its_hooks_outside(tapped):
    """In bk a layer of its own type with a buffer has no detached forward: the forward is not tapped."""
    expected = eager_training("block_with_buffer", "bk")
    model = build("block_with_buffer")
    private, optimizer, criterion = make_private(model, "bk", "block_with_buffer")
    private.compile(backend="eager")
    steps(private, optimizer, criterion, "block_with_buffer")
    assert list(private._taps.layouts.values()) == [None] and tapped == []
    assert_same_training([p.detach() for p in model.parameters()], expected, initial("block_with_buffer"))


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_evaluation_and_disabled_hooks_between_steps_keep_the_taps(mode, tapped):
    """A forward without grad, or with the hooks disabled, records nothing and taps nothing; it
    must not leave the layer loop running eagerly afterwards."""
    model = build("sequential_cnn")
    private, optimizer, criterion = make_private(model, mode, "sequential_cnn")
    private.compile(backend="eager")
    x, y = batch("sequential_cnn", 8)
    steps(private, optimizer, criterion, "sequential_cnn", sizes=(8, 8))
    with torch.no_grad():
        evaluated = private(x)
    private.disable_hooks()
    optimizer.zero_grad()
    criterion(private(x), y).backward()  # ordinary gradients
    plain = build("sequential_cnn")
    plain.load_state_dict(model.state_dict())
    criterion(plain(x), y).backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    torch.testing.assert_close(evaluated, plain(x))
    private.enable_hooks()
    optimizer.zero_grad()
    steps(private, optimizer, criterion, "sequential_cnn", sizes=(8,))
    assert tapped == [SEQUENTIAL_CALLS] * 2


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_two_forwards_into_one_loss_and_two_passes_before_a_step(mode, tapped):
    def run(compiled: bool):
        model = build("sequential_cnn")
        private, optimizer, criterion = make_private(model, mode, "sequential_cnn")
        if compiled:
            private.compile(backend="aot_eager")
        steps(private, optimizer, criterion, "sequential_cnn", sizes=(8,))
        (x1, y1), (x2, y2) = batch("sequential_cnn", 8), batch("sequential_cnn", 7)
        optimizer.zero_grad()
        (criterion(private(x1), y1) + criterion(private(x1.flip(0)), y1.flip(0))).backward()
        criterion(private(x2), y2).backward()  # a second pass: more rows, clipped on their own
        optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    assert_same_training(run(True), run(False), initial("sequential_cnn"))
    assert tapped == [SEQUENTIAL_CALLS] * 3


class OutsideUse(nn.Module):
    """The head's weight used once more outside the head, from the second forward on."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 5), nn.ReLU())
        self.head = nn.Linear(5, 3)
        self.outside = False

    def forward(self, x):
        h = self.body(x)
        out = self.head(h)
        return out + F.linear(h, self.head.weight) if self.outside else out


def test_a_use_outside_the_layer_is_refused_in_a_tapped_forward():
    torch.manual_seed(0)
    model = OutsideUse()
    private, optimizer, criterion = make_private(model, "bk", "mlp", module=None)
    private.compile(backend="aot_eager")
    steps(private, optimizer, criterion, "mlp", sizes=(8, 8))
    model.outside = True
    x, y = batch("mlp", 8)
    with pytest.raises(RuntimeError, match="head.weight received a gradient from a use outside"):
        criterion(private(x), y).backward()


def test_a_compiled_backward_that_gives_no_gradient_is_not_an_outside_use():
    """AOT autograd runs the accumulation hooks of every parameter its graph takes, also of one it
    gives no gradient; a gradient that did arrive changes ``p.grad`` (new tensor or new version)."""
    weight = nn.Parameter(torch.ones(3))
    check = OutsideUseCheck({id(weight): "weight"})
    check.watch(weight)
    check.note_grad(weight)
    check._accumulated(weight)  # nothing arrived: p.grad is still None
    weight.grad = torch.zeros(3)
    check.note_grad(weight)
    check._accumulated(weight)  # the same tensor, the same version
    weight.grad.add_(1.0)
    with pytest.raises(RuntimeError, match="weight received a gradient"):
        check._accumulated(weight)
    check.note_grad(weight)
    weight.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="weight received a gradient"):
        check._accumulated(weight)


def test_input_signature_leaves_out_the_batch_size_only():
    ids = torch.zeros(4, 7, dtype=torch.long)
    signature, batch_size = input_signature((ids,), {"mask": torch.ones(4, 7), "flag": True}, 0)
    assert batch_size == 4
    assert input_signature((ids[:2],), {"mask": torch.ones(2, 7), "flag": True}, 0)[0] == signature
    for args, kwargs in [((ids[:, :5],), {"mask": torch.ones(4, 5), "flag": True}),
                         ((ids,), {"mask": torch.ones(4, 7), "flag": False}),
                         ((ids.float(),), {"mask": torch.ones(4, 7), "flag": True}),
                         ((ids,), {"mask": torch.ones(4, 7)})]:
        assert input_signature(args, kwargs, 0)[0] != signature
    assert input_signature((torch.zeros(7, 3, 2),), {}, 1)[1] == 3  # batch_first=False


class ChangedInput(nn.Module):
    """The head's input changed after the head's call: in place, or (the oracle) out of place."""

    def __init__(self, in_place: bool):
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)
        self.in_place = in_place

    def forward(self, x):
        h = self.body(x) * 1.0
        out = self.head(h)
        h = h.mul_(2.0) if self.in_place else h * 2.0
        return out + h[:, :3]


def test_a_tapped_call_keeps_the_inputs_it_used():
    """Eagerly an input changed in place after the call is refused (its old values are gone);
    a tapped call records the values it used, and trains as the model without the change in place."""
    def run(in_place: bool, compiled: bool):
        torch.manual_seed(0)
        model = ChangedInput(in_place=False)
        private, optimizer, criterion = make_private(model, "bk", "mlp")
        if compiled:
            private.compile(backend="aot_eager")
        steps(private, optimizer, criterion, "mlp", sizes=(8,))  # compiled: learns the calls eagerly
        model.in_place = in_place
        steps(private, optimizer, criterion, "mlp", sizes=(8, 6))
        return [p.detach().clone() for p in model.parameters()]

    with pytest.raises(RuntimeError, match="modified in place after the layer's forward call"):
        run(True, compiled=False)
    torch.manual_seed(0)
    start = [p.detach().clone() for p in ChangedInput(in_place=False).parameters()]
    assert_same_training(run(True, compiled=True), run(False, compiled=False), start)


class AnySize(nn.Module):
    """Inputs of any spatial size; the head runs twice when ``twice`` (not part of the inputs)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)
        self.twice = False

    def forward(self, x):
        h = torch.relu(self.conv(x)).mean(dim=(2, 3))
        return self.head(h) + self.head(h.flip(0)) if self.twice else self.head(h)


def _any_size_training(compiled: bool, monkeypatch=None):
    """Steps on 4x4 inputs, the last one with the head called twice, then on 6x6 (a second
    signature)."""
    torch.manual_seed(0)
    model = AnySize()
    private, optimizer, criterion = make_private(model, "bk", "sequential_cnn")
    if compiled:
        private.compile(backend="aot_eager")
    for size, twice in ((4, False), (4, False), (4, True), (6, False), (6, False)):
        model.twice = twice
        x, y = batch("sequential_cnn", 8)
        x = F.interpolate(x, size=(size, size))
        optimizer.zero_grad()
        criterion(private(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def test_signatures_past_the_limit_and_calls_that_differ_from_the_learned_ones(monkeypatch, tapped):
    """With one signature allowed, the 6x6 inputs keep their hooks outside the graph; a forward
    that calls the head once more than learned falls back to the eager hooks; both train as
    eagerly."""
    expected = _any_size_training(compiled=False)
    monkeypatch.setattr("opacus_dp.grad_sample.traced_taps.MAX_SIGNATURES", 1)
    torch.manual_seed(0)
    assert_same_training(_any_size_training(compiled=True), expected, [p.detach() for p in AnySize().parameters()])
    assert tapped == [2, 2]  # the 4x4 forwards after the first; the second taps two of its three calls


class Scale(nn.Module):
    """A layer type of its own (its per-sample gradients from the torch.func fallback)."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x, factor: float = 1.0):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * factor


@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_a_layer_type_of_its_own_is_tapped(mode, tapped, monkeypatch):
    """In the modes that skip weight gradients the graph calls the layer's own forward with
    detached parameters; its parameter gets no gradient from autograd, and training is eager."""
    monkeypatch.setitem(helpers.MODELS, "mlp", lambda: nn.Sequential(nn.Linear(6, 5), Scale(5), nn.Linear(5, 3)))
    expected = train("mlp", mode)
    assert_same_training(train("mlp", mode, after=compile_after("aot_eager")), expected, initial("mlp"))
    assert tapped == [3, 3]


def test_the_detached_forwards_give_the_layer_output_and_no_weight_gradient():
    """Which layers the graph can call from detached parameters (others keep their hooks outside
    the graph in the modes that skip weight gradients)."""
    torch.manual_seed(0)
    with_buffer = Scale(4)
    with_buffer.register_buffer("offset", torch.zeros(4))
    for layer, x in [(nn.Linear(4, 3), torch.randn(2, 4)), (nn.Conv1d(4, 2, 3), torch.randn(2, 4, 5)),
                     (nn.Embedding(7, 3), torch.tensor([[1, 6]])), (nn.LayerNorm(4), torch.randn(2, 4)),
                     (nn.GroupNorm(2, 4), torch.randn(2, 4, 3)), (Scale(4), torch.randn(2, 4))]:
        x = x.requires_grad_() if x.is_floating_point() else x
        y = detached_forward(layer)(layer, x)
        torch.testing.assert_close(y, layer(x))
        if x.requires_grad:  # the input's gradient is the layer's
            expected = torch.autograd.grad(layer(x).sum(), x)[0]
            y.sum().backward()
            torch.testing.assert_close(x.grad, expected)
        assert all(p.grad is None for p in layer.parameters())
    for layer in [parametrizations.weight_norm(nn.Linear(4, 3)), nn.Embedding(7, 3, max_norm=1.0), with_buffer]:
        assert detached_forward(layer) is None


def test_models_with_replicas_inside_are_not_tapped():
    assert GradSampleModule(nn.Sequential(nn.Linear(6, 3)))._taps.enabled
    assert not GradSampleModule(nn.DataParallel(nn.Sequential(nn.Linear(6, 3))))._taps.enabled


def _cnn_training(compiled: bool, autocast: bool, per_layer: bool):
    model = build("sequential_cnn")
    x, y = batch("sequential_cnn", 8)
    clipping = dict(clipping="per_layer", max_grad_norm=[0.05] * 6) if per_layer else dict(max_grad_norm=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        private, optimizer, _ = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=0.0,
            poisson_sampling=False, grad_sample_mode="bk", **clipping)
    if compiled:
        private.compile(backend="aot_eager")
    for n in (8, 6, 8):
        x, y = batch("sequential_cnn", n)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(private(x).float(), y)
        loss.backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("autocast, per_layer", [(True, False), (False, True)])
def test_autocast_and_per_layer_clipping(autocast, per_layer, tapped):
    expected = _cnn_training(False, autocast, per_layer)
    assert_same_training(_cnn_training(True, autocast, per_layer), expected, initial("sequential_cnn"))
    assert tapped == [SEQUENTIAL_CALLS] * 2


class WithKeyword(nn.Module):
    """A layer called as ``layer(x)`` while the calls are learned, later with a keyword."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 5)
        self.scale = Scale(5)
        self.head = nn.Linear(5, 3)
        self.factor = None

    def forward(self, x):
        h = self.body(x)
        return self.head(self.scale(h) if self.factor is None else self.scale(h, factor=self.factor))


def test_a_call_unlike_the_learned_one_keeps_its_eager_hook():
    """The graph computes a tapped call again from detached parameters with the learned call's
    arguments only: a call with other arguments runs its eager hook."""
    def run(compiled: bool):
        torch.manual_seed(0)
        model = WithKeyword()
        private, optimizer, criterion = make_private(model, "bk", "mlp")
        if compiled:
            private.compile(backend="aot_eager")
        steps(private, optimizer, criterion, "mlp", sizes=(8, 8))
        model.factor = 3.0
        steps(private, optimizer, criterion, "mlp", sizes=(8, 6))
        return [p.detach().clone() for p in model.parameters()]

    torch.manual_seed(0)
    start = [p.detach().clone() for p in WithKeyword().parameters()]
    assert_same_training(run(True), run(False), start)


class ThreeProjections(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(6, 4), nn.Linear(6, 4), nn.Linear(6, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = x * 2.0
        return self.head(self.q(h) * self.k(h) + self.v(h))


@pytest.mark.slow
def test_calls_of_one_input_record_one_copy(monkeypatch):
    """docs/compile.md, memory: inductor merges the copies of an input that several tapped calls
    take into one tensor."""
    recorded = []
    finish = TracedTaps.finish

    def keeping(self):
        records = finish(self)
        recorded.append({path: args[0] for path, args, *_ in records})
        return records

    monkeypatch.setattr(TracedTaps, "finish", torch.compiler.disable(keeping))
    torch.manual_seed(0)
    private, optimizer, criterion = make_private(ThreeProjections(), "bk", "mlp")
    private.compile()  # inductor
    steps(private, optimizer, criterion, "mlp", sizes=(8, 8))
    (inputs,) = recorded
    storage = {path: value.untyped_storage().data_ptr() for path, value in inputs.items()}
    assert storage["q"] == storage["k"] == storage["v"] != storage["head"]
    torch.testing.assert_close(inputs["q"], batch("mlp", 8)[0] * 2.0)
