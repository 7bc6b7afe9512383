"""Per-layer clipping in the ``bk`` mode on CPU forms a sequence ``Linear``'s per-sample
gradients a few samples at a time (``chunked``), clips and sums them during the backward pass.

Oracle: batch-size-1 autograd in float64, clipped per tensor by hand. The chunk size is made
small so that batches end in a partial chunk; layers called twice, frozen tensors, both loss
reductions, virtual steps and half precision are covered.
"""

import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.data import BatchMemoryManager
from opacus_dp.grad_sample.bookkeeping import chunked_sums
from opacus_dp.grad_sample.bookkeeping.chunked_sums import ChunkBuffer, chunk_size
from opacus_dp.grad_sample.bookkeeping.norm_samplers.linear import linear_prefers_chunks
from opacus_dp.grad_sample.bookkeeping.norm_rules import NORM_RULES
from tests.engine.helpers import clipped_sum_oracle

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
N, T, D = 10, 12, 6
LR = 1.0


class SequenceModel(nn.Module):
    """fc1 and fc2 (called twice) over T positions: chunked; the head on pooled vectors: ghost."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(D, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        h = self.fc2(torch.tanh(self.fc2(h)))
        return self.head(h.mean(dim=1))


def data(seed=0, n=N, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(n, T, D, generator=g)).to(dtype), torch.randint(0, 3, (n,), generator=g)


def private(model, x, y, bounds, batch_size, reduction="mean", mode="bk"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gsm, optimizer, loader = PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=batch_size),
            noise_multiplier=0.0, max_grad_norm=bounds, clipping="per_layer",
            grad_sample_mode=mode, poisson_sampling=False, loss_reduction=reduction)
    return gsm, optimizer, loader


def oracle_update(model, x, y, bounds, divisor):
    """Parameters after one σ = 0 per-layer DP-SGD step (per-sample autograd, clipped by hand)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = [torch.autograd.grad(nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1],
                                                            reduction="sum"), params)
            for i in range(len(x))]
    grads = [torch.stack([r[j] for r in rows]) for j in range(len(params))]
    assert any((g.reshape(len(g), -1).norm(dim=1) > c).any() for g, c in zip(grads, bounds)), \
        "clipping must be active"
    sums = clipped_sum_oracle(grads, bounds, per_layer=True)
    updated = {p: p.detach() - LR * s / divisor for p, s in zip(params, sums)}
    return [updated.get(p, p.detach()) for p in model.parameters()]


@pytest.fixture
def small_chunks(monkeypatch):
    """3 samples per chunk of fc2's weight (8·8 float64 values each): batches of 10 end in a
    partial chunk."""
    monkeypatch.setattr(chunked_sums, "CHUNK_BYTES", 3 * 64 * 8)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_step_equals_the_per_sample_oracle(small_chunks, reduction):
    torch.manual_seed(0)
    model = SequenceModel().double()
    reference = SequenceModel().double()
    reference.load_state_dict(model.state_dict())
    x, y = data()
    bounds = [0.4, 0.2, 0.3, 0.1, 0.5, 0.2]
    gsm, optimizer, _ = private(model, x, y, bounds, N, reduction)
    nn.functional.cross_entropy(gsm(x), y, reduction=reduction).backward()
    modes = gsm.layer_modes()
    assert modes["fc1 (Linear)"] == modes["fc2 (Linear)"] == "chunked"
    assert modes["head (Linear)"] == "ghost"
    optimizer.step()
    expected = oracle_update(reference, x, y, bounds, N if reduction == "mean" else 1)
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("frozen", ["fc1.weight", "fc1.bias", "fc2.bias"])
def test_frozen_tensors_of_a_chunked_layer(small_chunks, frozen):
    torch.manual_seed(1)
    model = SequenceModel().double()
    reference = SequenceModel().double()
    reference.load_state_dict(model.state_dict())
    for m in (model, reference):
        m.get_parameter(frozen).requires_grad_(False)
    x, y = data(1)
    bounds = [0.3] * 5
    gsm, optimizer, _ = private(model, x, y, bounds, N)
    nn.functional.cross_entropy(gsm(x), y).backward()
    optimizer.step()
    for p, e in zip(model.parameters(), oracle_update(reference, x, y, bounds, N)):
        torch.testing.assert_close(p.detach(), e, rtol=1e-10, atol=1e-12)


def test_virtual_steps_concatenate_the_chunked_passes(small_chunks):
    """BatchMemoryManager splits the logical batch of 10 into pieces of 4, 4, 2."""
    torch.manual_seed(2)
    model = SequenceModel().double()
    reference = SequenceModel().double()
    reference.load_state_dict(model.state_dict())
    x, y = data(2)
    bounds = [0.2] * 6
    gsm, optimizer, loader = private(model, x, y, bounds, N)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=optimizer) as pieces:
        for xb, yb in pieces:
            nn.functional.cross_entropy(gsm(xb), yb).backward()
            optimizer.step()
            optimizer.zero_grad()
    for p, e in zip(model.parameters(), oracle_update(reference, x, y, bounds, N)):
        torch.testing.assert_close(p.detach(), e, rtol=1e-10, atol=1e-12)


def test_changing_the_bounds_after_a_chunked_backward_is_refused():
    torch.manual_seed(3)
    model = SequenceModel().double()
    x, y = data(3)
    gsm, optimizer, _ = private(model, x, y, [0.3] * 6, N)
    nn.functional.cross_entropy(gsm(x), y).backward()
    assert "chunked" in gsm.layer_modes().values()
    optimizer.max_grad_norms = [0.1] * 6
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="clip factors changed"):
        optimizer.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_chunked_contribution_stays_within_the_bound(dtype):
    """Per-sample gradients of half-precision layers are formed, clipped and summed in float32:
    one sample's clipped contribution has norm ≤ ‖C‖ to float32 rounding."""
    worst = 0.0
    for seed in range(6):
        torch.manual_seed(seed)
        model = SequenceModel().to(dtype)
        x, y = data(seed, n=1, dtype=dtype)
        bounds = [1e-2 / 6 ** 0.5] * 6
        gsm, optimizer, _ = private(model, x, y, bounds, 1)
        nn.functional.cross_entropy(gsm(x).float(), y).backward()
        assert gsm.layer_modes()["fc1 (Linear)"] == "chunked"
        optimizer.clip_and_accumulate()
        sums = list(optimizer.logical_batch.sums.values())
        assert all(s.dtype == torch.float32 for s in sums)
        worst = max(worst, torch.sqrt(sum(s.double().pow(2).sum() for s in sums)).item())
    assert 0.9e-2 < worst <= 1e-2 * (1 + 1e-6)


def test_autocast_chunked_sums_equal_the_ghost_path(monkeypatch):
    """Under bfloat16 autocast the chunks, like the Gram path, use the inputs as autocast
    rounded them, lifted to float32: the same clipped sums to float32 rounding."""
    results = []
    for chunked in (True, False):
        if not chunked:
            spec = NORM_RULES[nn.Linear]
            monkeypatch.setitem(NORM_RULES, nn.Linear, dataclasses.replace(
                spec, prefers_chunks=None, prefers_ghost=None, materialise_if_kept=None))
        torch.manual_seed(4)
        model = SequenceModel()
        x, y = data(4, dtype=torch.float32)
        gsm, optimizer, _ = private(model, x, y, [0.05] * 6, N)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = gsm(x)
        nn.functional.cross_entropy(out.float(), y).backward()
        assert gsm.layer_modes()["fc2 (Linear)"] == ("chunked" if chunked else "ghost")
        optimizer.clip_and_accumulate()
        results.append([s.clone() for s in optimizer.logical_batch.sums.values()])
    for a, b in zip(*results):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_flat_clipping_does_not_chunk():
    torch.manual_seed(5)
    model = SequenceModel().double()
    x, y = data(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gsm, optimizer, _ = PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=N), noise_multiplier=0.0,
            max_grad_norm=1.0, grad_sample_mode="bk", poisson_sampling=False)
    nn.functional.cross_entropy(gsm(x), y).backward()
    assert "chunked" not in gsm.layer_modes().values()


def test_chunk_rule_follows_the_cost_of_the_gram_products():
    """T²(d + p) ≥ 16 d p: long sequences chunk, short ones and vectors stay ghost."""
    layer = nn.Linear(256, 1024)
    assert linear_prefers_chunks(layer, [torch.zeros(2, 128, 256)])
    assert linear_prefers_chunks(layer, [torch.zeros(2, 64, 256)])  # 20 d p
    assert not linear_prefers_chunks(layer, [torch.zeros(2, 32, 256)])  # 5 d p
    assert not linear_prefers_chunks(layer, [torch.zeros(2, 256)])
    assert linear_prefers_chunks(nn.Linear(8, 8), [torch.zeros(2, 4, 4, 8)])  # 16 positions


def test_chunk_size_and_the_reused_buffer(monkeypatch):
    weight = torch.zeros(1024, 256)
    assert chunk_size([weight], 32, torch.float32) == 4  # 4 MiB of 1 MiB per-sample gradients
    assert chunk_size([weight], 3, torch.float32) == 3
    assert chunk_size([torch.zeros(4096, 4096)], 32, torch.float32) == 1
    buffer = ChunkBuffer()
    (a,) = buffer.views([(4, 1024, 256)], torch.float32, torch.device("cpu"))
    (b, c) = buffer.views([(2, 1024, 256), (2, 256)], torch.float32, torch.device("cpu"))
    assert b.data_ptr() == a.data_ptr() and c.data_ptr() == a.data_ptr() + b.numel() * 4
    (d,) = buffer.views([(4, 1024, 256)], torch.float64, torch.device("cpu"))
    assert d.dtype == torch.float64 and d.data_ptr() != a.data_ptr()
    monkeypatch.setattr(chunked_sums, "KEPT_BUFFER_BYTES", 1 << 20)
    (e,) = buffer.views([(1, 1024, 256)], torch.float64, torch.device("cpu"))
    assert buffer._flat is None  # larger than kept: dropped after this layer
