"""Fresh tensors on huge pages: the advised range is the 2 MiB-aligned interior of the tensor's
memory, only for large CPU tensors, and the tensor is an ordinary one to read and write."""

import sys

import pytest
import torch

from opacus_dp.maths import huge_pages
from opacus_dp.optim.philox_noise import PhiloxGaussianNoise

MIB = 1 << 20


@pytest.mark.parametrize("address,nbytes,expected", [
    (0, 8 * MIB, (0, 8 * MIB)),
    (1, 8 * MIB, (2 * MIB, 6 * MIB)),
    (2 * MIB - 16, 4 * MIB + 16, (2 * MIB, 4 * MIB)),
    (3 * MIB, 2 * MIB, (4 * MIB, 0)),  # no whole huge page inside
])
def test_range_is_the_aligned_interior(address, nbytes, expected):
    start, length = huge_pages.huge_page_range(address, nbytes)
    assert (start, length) == expected
    assert start % huge_pages.HUGE_PAGE == 0 and length % huge_pages.HUGE_PAGE == 0
    assert length == 0 or (address <= start and start + length <= address + nbytes)


def recorder(monkeypatch):
    calls = []
    monkeypatch.setattr(huge_pages, "madvise_function", lambda: lambda *args: calls.append(args) or 0)
    return calls


def test_large_cpu_tensors_are_advised_inside_their_memory(monkeypatch):
    calls = recorder(monkeypatch)
    reference = torch.empty(3, 1 << 20)  # 12 MiB
    out = huge_pages.empty_like_on_huge_pages(reference)
    assert out.shape == reference.shape and out.dtype == reference.dtype and out.is_contiguous()
    assert len(calls) == 1
    start, length, advice = calls[0]
    assert advice == huge_pages.MADV_HUGEPAGE and length >= 2 * huge_pages.HUGE_PAGE
    assert out.data_ptr() <= start and start + length <= out.data_ptr() + out.numel() * 4
    huge_pages.empty_like_on_huge_pages(torch.empty(1000))
    assert len(calls) == 1  # small tensors are left alone


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(2) is Linux's")
def test_the_real_advice_leaves_an_ordinary_tensor():
    out = huge_pages.empty_like_on_huge_pages(torch.empty(4 << 20))
    out.fill_(2.5)
    assert float(out.sum()) == 2.5 * out.numel()
    assert huge_pages.madvise_function() is not None


def test_philox_samples_on_advised_memory_draw_the_same_numbers(monkeypatch):
    """Where the tensor comes from does not change the draws."""
    reference = torch.zeros(1 << 20)
    first = PhiloxGaussianNoise(seed=9)
    first.begin_step(torch.device("cpu"))
    advised = first.sample(reference, 1.5)
    monkeypatch.setattr(huge_pages, "madvise_function", lambda: None)
    second = PhiloxGaussianNoise(seed=9)
    second.begin_step(torch.device("cpu"))
    assert torch.equal(advised, second.sample(reference, 1.5))
    assert abs(float(advised.std()) - 1.5) < 0.01


def test_linear_clipped_sums_are_formed_on_advised_memory(monkeypatch):
    """The weight-sized clipped sum of a Linear layer (bk/ghost) is written into a new tensor advised
    before the product writes it; the numbers are those of a plain product."""
    from opacus_dp.maths.cpu_products import cpu_products_set_to, matrix_product

    calls = recorder(monkeypatch)
    left, right = torch.randn(1024, 6), torch.randn(6, 2048)  # an 8 MiB sum
    with cpu_products_set_to("torch"):  # torch's path, whatever this CPU's default
        out = matrix_product(left, right)
    assert torch.equal(out, left.mm(right))
    assert len(calls) == 1
    start, length, _ = calls[0]
    assert out.data_ptr() <= start and start + length <= out.data_ptr() + out.numel() * 4


@pytest.mark.parametrize("positions", [1, 3])
def test_linear_per_sample_gradients_are_formed_on_advised_memory(monkeypatch, positions):
    """The per-sample gradients of a Linear weight (hooks mode), B copies of the weight: written
    into advised memory when large, the numbers those of the einsum over positions."""
    calls = recorder(monkeypatch)
    left, right = torch.randn(16, positions, 256), torch.randn(16, positions, 512)  # 8 MiB out
    out = huge_pages.batched_outer_sums(left, right)
    assert torch.equal(out, torch.einsum("bto,bti->boi", left, right))
    assert len(calls) == 1
    start, length, _ = calls[0]
    assert out.data_ptr() <= start and start + length <= out.data_ptr() + out.numel() * 4


def test_linear_per_sample_gradients_stay_differentiable():
    """Where autograd records the product (a gradient penalty through the per-sample gradients),
    it is the ordinary product, differentiable."""
    left = torch.randn(4, 2, 3, requires_grad=True)
    right = torch.randn(4, 2, 5)
    out = huge_pages.batched_outer_sums(left, right)
    out.square().sum().backward()
    expected = torch.autograd.grad(torch.einsum("bto,bti->boi", left, right).square().sum(), left)[0]
    assert torch.allclose(left.grad, expected)


def test_embedding_per_sample_tables_are_zeroed_on_advised_memory(monkeypatch):
    """The dense per-sample table of an embedding (B times the weight) comes from advised memory,
    zeroed: rows no sample used are exact zeros, the used rows the sample's gradient."""
    from opacus_dp.grad_sample.embedding import embedding_grad_sample

    calls = recorder(monkeypatch)
    layer = torch.nn.Embedding(2048, 256)  # 2 MiB of weight, 8 MiB of table for B = 4
    indices = torch.tensor([[3, 3, 7], [0, 1, 2], [5, 5, 5], [2047, 9, 9]])
    backprops = torch.randn(4, 3, 256)
    table = embedding_grad_sample(layer, [indices], backprops)[layer.weight]
    assert len(calls) == 1
    expected = torch.zeros(4, 2048, 256)
    for i in range(4):
        for t in range(3):
            expected[i, indices[i, t]] += backprops[i, t]
    assert torch.equal(table, expected)
