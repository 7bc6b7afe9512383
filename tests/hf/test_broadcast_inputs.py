"""Layer calls on one sample broadcast over the batch (position ids of shape ``(1, T)``).

Such a call is expanded to the batch (a view), so its layer gets exact per-sample gradients in
every mode; what cannot be told apart is refused with a message naming the fix.
"""

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from opacus_dp.errors import UnsupportedModuleError
from opacus_dp.grad_sample import BookkeepingGradSampleModule, GradSampleModule
from tests.grad_sample.oracle import assert_grad_samples_close, gsm_grad_samples, oracle_grad_samples
from tests.hf.helpers import MODES, assert_private_step_matches_oracle

VOCAB, D, MAX_LEN, CLASSES = 13, 6, 8, 3


class PositionModel(nn.Module):
    """Token + position embeddings (positions ``(1, T)``), a Linear on a ``(1, T, d)`` buffer,
    then LayerNorm, Linear and a pooled head; ``positions_first``: the position embedding is
    called before the token embedding; ``checkpointed``: the position layers run in a
    (non-reentrant) activation checkpoint."""

    def __init__(self, positions_first=False, checkpointed=False, batch_first=True):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, D), nn.Embedding(MAX_LEN, D)
        self.table = nn.Linear(D, D)
        self.register_buffer("sinus", torch.randn(1, MAX_LEN, D))
        self.ln, self.fc, self.head = nn.LayerNorm(D), nn.Linear(D, D), nn.Linear(D, CLASSES)
        self.positions_first, self.checkpointed, self.batch_first = positions_first, checkpointed, batch_first

    def _positional(self, positions, length):
        return self.pos(positions) + self.table(self.sinus[:, :length])

    def forward(self, ids):
        length = ids.shape[1 if self.batch_first else 0]
        positions = torch.arange(length)[None]
        if not self.batch_first:  # (T, 1), and the table as (T, 1, d)
            positions = positions.t()
            return self.head(torch.tanh(self.fc(self.ln(
                self.tok(ids) + self.pos(positions) + self.table(self.sinus[0, :length, None])))).mean(0))
        extra = self.pos(positions) if self.positions_first else None
        h = self.tok(ids)
        if self.checkpointed:
            h = h + checkpoint(self._positional, positions, length, use_reentrant=False)
        else:
            h = h + (extra if extra is not None else self.pos(positions)) + self.table(self.sinus[:, :length])
        return self.head(torch.tanh(self.fc(self.ln(h))).mean(dim=1))


def _batch(batch_size: int, length: int):
    g = torch.Generator().manual_seed(batch_size * 100 + length)
    return torch.randint(0, VOCAB, (batch_size, length), generator=g), \
        torch.randint(0, CLASSES, (batch_size,), generator=g)


def _make(**options):
    def make():
        torch.manual_seed(0)
        return PositionModel(**options).double()
    return make


def _loss(ids, labels):
    def loss(model, criterion, rows):
        return criterion(model(ids[rows]), labels[rows])
    return loss


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch_size, length", [(4, 7), (5, 5)])  # (5, 5): T == B
def test_positions_of_one_row_get_exact_per_sample_gradients(mode, batch_size, length):
    assert_private_step_matches_oracle(_make(), _loss(*_batch(batch_size, length)), batch_size, mode)


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_positions_embedded_before_the_tokens(mode):
    """The first hooked call has one sample: the model's inputs give the batch size."""
    assert_private_step_matches_oracle(_make(positions_first=True), _loss(*_batch(4, 6)), 4, mode)


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_positions_inside_an_activation_checkpoint(mode):
    """The recomputation during backward is expanded as the forward was."""
    assert_private_step_matches_oracle(_make(checkpointed=True), _loss(*_batch(4, 6)), 4, mode)


def test_checkpoint_recomputation_with_autograd_weight_gradients():
    """Without skipped weight gradients torch checks the recomputed saved tensors' shapes."""
    model = _make(checkpointed=True)()
    ids = _batch(4, 6)[0]
    expected = oracle_grad_samples(model, (ids,))
    assert_grad_samples_close(gsm_grad_samples(model, (ids,)), expected)


def test_sequence_first_positions_of_one_column():
    """``batch_first=False``: positions ``(T, 1)`` are expanded on dimension 1."""
    model = _make(batch_first=False)()
    ids = _batch(4, 6)[0].t().contiguous()
    expected = oracle_grad_samples(model, (ids,), batch_dim=1)
    assert_grad_samples_close(gsm_grad_samples(model, (ids,), batch_first=False), expected)


class Probe(nn.Module):
    """A layer without a dedicated sampler that notes the strides of its inputs."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(D, dtype=torch.float64))
        self.strides = []

    def forward(self, x):
        self.strides.append(x.stride())
        return x * self.weight


def test_the_expansion_is_a_view_and_only_while_recording():
    probe = Probe()
    model = nn.ModuleDict({"tok": nn.Embedding(VOCAB, D).double(), "probe": probe})
    table = torch.randn(1, 3, D, dtype=torch.float64)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, ids):
            return self.m["tok"](ids) + self.m["probe"](table)

    wrapper = GradSampleModule(Net())
    ids = _batch(4, 3)[0]
    try:
        assert wrapper(ids).shape == (4, 3, D) and probe.strides[-1][0] == 0  # after the model check's runs
        assert probe(table).shape == (1, 3, D)  # not the wrapped model's forward: left alone
        with torch.no_grad():
            wrapper(ids)
        wrapper.disable_hooks()
        wrapper(ids)
        assert [s[0] for s in probe.strides[-2:]] == [3 * D, 3 * D]
    finally:
        wrapper.close()


class SideInput(nn.Module):
    """Gets a second tensor whose first dimension is not the batch."""

    def __init__(self):
        super().__init__()
        self.tok, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, CLASSES)

    def forward(self, ids, mask):
        return self.head((self.tok(ids) * mask.sum(0)[None, :, None]).mean(1))


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_the_first_input_holds_the_samples(mode):
    """One sample and a ``(K, T)`` side tensor: nothing is expanded to ``K``."""
    ids, labels = _batch(1, 5)
    mask = torch.ones(3, 5, dtype=torch.float64)

    def make():
        torch.manual_seed(0)
        return SideInput().double()

    def loss(model, criterion, rows):
        return criterion(model(ids[rows], mask), labels[rows])

    assert_private_step_matches_oracle(make, loss, 1, mode)


@pytest.mark.parametrize("wrapper_class", [GradSampleModule, BookkeepingGradSampleModule])
def test_positions_first_when_the_inputs_do_not_tell_the_batch_are_refused(wrapper_class):
    """Positions embedded before any layer saw the batch, and inputs of two sizes (``(B, T)``
    ids, a ``(d,)`` scale): nothing tells ``B`` at that call, so the pass is refused."""
    class ScaledPositionsFirst(PositionModel):
        def forward(self, ids, scale):
            h = self.pos(torch.arange(ids.shape[1])[None]) + self.tok(ids)
            return self.head((h * scale).mean(1))

    wrapper = wrapper_class(ScaledPositionsFirst().double())
    try:
        with pytest.raises(ValueError, match="has batch size 1 but .*call the wrapped model itself"):
            wrapper(_batch(4, 6)[0], torch.ones(D, dtype=torch.float64)).sum().backward()
    finally:
        wrapper.close()


@pytest.mark.parametrize("wrapper_class", [GradSampleModule, BookkeepingGradSampleModule])
def test_positions_without_a_batch_dimension_are_refused_with_the_fix(wrapper_class):
    """Positions of shape ``(T,)`` with ``T ≠ B`` are not a batch of one: refused, and the
    message says to give them a batch dimension."""
    class FlatPositions(PositionModel):
        def forward(self, ids):
            return self.head((self.tok(ids) + self.pos(torch.arange(ids.shape[1]))).mean(1))

    wrapper = wrapper_class(FlatPositions().double())
    try:
        with pytest.raises(ValueError, match=r"positions\[None\]"):
            wrapper(_batch(4, 6)[0]).sum().backward()
    finally:
        wrapper.close()


def test_parts_called_outside_the_wrapped_model_are_refused_with_the_fix():
    model = PositionModel().double()
    wrapper = GradSampleModule(model)
    ids = _batch(4, 6)[0]
    try:
        with pytest.raises(ValueError, match="call the wrapped model itself"):
            (model.tok(ids) + model.pos(torch.arange(6)[None])).sum().backward()
    finally:
        wrapper.close()


class RelativeBias(nn.Module):
    """A T5-style attention: a position table looked up with (T, T) ids, added to every sample."""

    def __init__(self, length: int = 4):
        super().__init__()
        self.proj = nn.Linear(3, 3)
        self.relative_attention_bias = nn.Embedding(2 * length, 1)
        self.length = length

    def forward(self, x):
        ids = (torch.arange(self.length)[:, None] - torch.arange(self.length)[None, :]).abs()
        bias = self.relative_attention_bias(ids)[..., 0]  # (T, T), no batch dimension
        scores = self.proj(x) @ self.proj(x).transpose(1, 2) + bias
        return scores.sum(dim=(1, 2))


@pytest.mark.parametrize("frozen", [False, True])
def test_a_trainable_table_looked_up_without_a_batch_is_refused_by_structure(frozen):
    """With T = B = 4 the (T, T) ids would pass for a batch: refused whatever T and B, by name."""
    model = RelativeBias()
    model.relative_attention_bias.requires_grad_(not frozen)
    if frozen:
        GradSampleModule(model).close()
        return
    with pytest.raises(UnsupportedModuleError, match=r"relative_attention_bias \(Embedding\) cannot be trained "
                                                     r"privately.*freeze it"):
        GradSampleModule(model)


class PositionsOfOneRow(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos, self.fc = nn.Embedding(10, 4), nn.Embedding(6, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.fc((self.tok(x) + self.pos(torch.arange(x.shape[1])[None])).mean(1))


@pytest.mark.parametrize("mode", MODES)
def test_an_empty_batch_with_broadcast_positions_is_a_step_on_zero_samples(mode):
    """Poisson batches may be empty: the (1, T) positions expand to 0 rows, no sample contributes,
    and the update is the noise alone (σ = 0: nothing moves)."""
    import warnings

    from torch.utils.data import DataLoader, TensorDataset

    from opacus_dp import PrivacyEngine

    model = PositionsOfOneRow()
    data = TensorDataset(torch.randint(0, 10, (8, 5)), torch.randint(0, 2, (8,)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, batch_size=4),
            noise_multiplier=0.0, max_grad_norm=1.0, grad_sample_mode=mode, poisson_sampling=False)
    module, optimizer = result[0], result[1]
    before = [p.detach().clone() for p in model.parameters()]
    out = module(torch.zeros(0, 5, dtype=torch.long))
    loss = nn.functional.cross_entropy(out, torch.zeros(0, dtype=torch.long), reduction="sum")
    (result[2](out, torch.zeros(0, dtype=torch.long)) if mode == "ghost" else loss).backward()
    optimizer.step()
    assert optimizer.steps_taken == 1
    assert all(torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
