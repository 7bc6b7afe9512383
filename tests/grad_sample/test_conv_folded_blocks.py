"""The folded convolution in blocks of samples (``FOLDED_BLOCK_BYTES`` on CPU).

Oracles: the same folded convolution over the whole batch in one call (bit for bit in float64, where
each sample's gradient is its own group's convolution by the same kernel; float32 kernels may block
a smaller problem differently) and per-sample autograd (tolerance). The block size is made small so
that small layers are cut into several blocks, the last one partial.
"""

import pytest
import torch
import torch.nn as nn

from opacus_dp.grad_sample import conv
from opacus_dp.grad_sample.conv import folded_block_rows, folded_conv_weight_grad
from tests.grad_sample.test_conv import oracle_per_sample_grads

LAYERS = {
    "conv1d": lambda: nn.Conv1d(3, 4, 3, padding=1),
    "conv2d": lambda: nn.Conv2d(3, 5, 3, padding=1),
    "conv2d-grouped-strided": lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2),
    "conv2d-reflect": lambda: nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"),
    "conv2d-same-even": lambda: nn.Conv2d(2, 3, 4, padding="same", dilation=1),
    "conv3d": lambda: nn.Conv3d(2, 3, 2),
}
SPATIAL = {"conv1d": (9,), "conv3d": (4, 4, 4)}


def _largest(layer, x, gy) -> int:
    """Elements of the largest of one sample's gradient, input and output gradient."""
    return max(layer.weight.numel(), x[0].numel(), gy[0].numel())


def _case(name: str, batch: int, dtype=torch.float64):
    torch.manual_seed(0)
    layer = LAYERS[name]().to(dtype)
    x = torch.randn(batch, layer.in_channels, *SPATIAL.get(name, (7, 7)), dtype=dtype)
    with torch.no_grad():
        gy = torch.randn_like(layer(x))
    return layer, x, gy


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_blocks_give_the_whole_batch_call_bit_for_bit(monkeypatch, name):
    layer, x, gy = _case(name, batch=11)
    whole = conv._folded_block(layer, x, gy)
    monkeypatch.setattr(conv, "FOLDED_BLOCK_BYTES", 3 * _largest(layer, x, gy) * x.element_size())
    assert folded_block_rows(layer, x, gy) == 3  # 11 samples: blocks of 3, 3, 3 and 2
    blocked = folded_conv_weight_grad(layer, x, gy)
    assert blocked.shape == (11, *layer.weight.shape)
    assert torch.equal(blocked, whole)
    torch.testing.assert_close(blocked, oracle_per_sample_grads(layer, x, gy)[layer.weight],
                               rtol=1e-10, atol=1e-12)


def test_a_float32_block_counts_four_byte_gradients(monkeypatch):
    layer, x, gy = _case("conv2d", batch=9, dtype=torch.float32)
    monkeypatch.setattr(conv, "FOLDED_BLOCK_BYTES", 2 * _largest(layer, x, gy) * 4)
    assert folded_block_rows(layer, x, gy) == 2
    blocked = folded_conv_weight_grad(layer, x, gy)
    torch.testing.assert_close(blocked, conv._folded_block(layer, x, gy), rtol=1e-5, atol=1e-5)
    oracle = oracle_per_sample_grads(layer.double(), x.double(), gy.double())[layer.weight]
    torch.testing.assert_close(blocked.double(), oracle, rtol=1e-5, atol=1e-4)


def test_block_rows_default_and_bounds():
    layer, x, gy = _case("conv2d", batch=4, dtype=torch.float32)
    assert folded_block_rows(layer, x, gy) == (2 << 20) // (_largest(layer, x, gy) * 4)
    huge = nn.Conv2d(512, 512, 3)  # one sample's gradient alone is over the block size
    assert folded_block_rows(huge, x, gy) == 1
    on_meta = x.to("meta")  # off the CPU the whole batch is one convolution
    assert folded_block_rows(layer, on_meta, gy.to("meta")) == 4


def test_an_empty_block_is_never_formed(monkeypatch):
    layer, x, gy = _case("conv2d", batch=4)
    monkeypatch.setattr(conv, "FOLDED_BLOCK_BYTES", 1)  # under one sample: one sample per block
    calls = []
    original = conv._folded_block
    monkeypatch.setattr(conv, "_folded_block", lambda *a: calls.append(a[1].shape[0]) or original(*a))
    assert torch.equal(folded_conv_weight_grad(layer, x, gy), original(layer, x, gy))
    assert calls == [1, 1, 1, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channels_last_and_half_precision_blocks(monkeypatch, dtype):
    """Blocks of a channels-last input (each block is copied into the folded layout) and of
    bfloat16 gradients (two bytes each: twice the rows) match the per-sample oracle."""
    layer, x, gy = _case("conv2d", batch=7, dtype=torch.float64)
    oracle = oracle_per_sample_grads(layer, x, gy)[layer.weight]
    layer = layer.to(dtype)
    x = x.to(dtype).contiguous(memory_format=torch.channels_last)
    gy = gy.to(dtype).contiguous(memory_format=torch.channels_last)
    monkeypatch.setattr(conv, "FOLDED_BLOCK_BYTES", 8 * _largest(layer, x, gy))
    assert folded_block_rows(layer, x, gy) == {torch.float32: 2, torch.bfloat16: 4}[dtype]
    blocked = folded_conv_weight_grad(layer, x, gy)
    assert blocked.dtype == dtype and blocked.shape == (7, *layer.weight.shape)
    tolerance = {"rtol": 2e-2, "atol": 1e-1} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(blocked.double(), oracle, **tolerance)


@pytest.mark.parametrize("largest", ["weight", "input", "output gradient"])
def test_the_largest_per_sample_tensor_sets_the_rows(largest):
    """2 MiB over the largest of a sample's gradient, input and output gradient (float32): a
    small kernel over a large image is cut by its input, a strided one by its input too, a wide
    kernel over few positions by its gradient."""
    layer, shape = {
        "weight": (nn.Conv2d(64, 64, 3, padding=1), (4, 64, 4, 4)),  # 36 864 weights, 1 024 inputs
        "input": (nn.Conv2d(8, 8, 3, stride=2, padding=1), (4, 8, 64, 64)),  # 32 768 inputs, 8 192 outputs
        "output gradient": (nn.Conv2d(4, 32, 1), (4, 4, 32, 32)),  # 32 768 outputs, 4 096 inputs
    }[largest]
    x = torch.randn(shape)
    with torch.no_grad():
        gy = torch.randn_like(layer(x))
    sizes = {"weight": layer.weight.numel(), "input": x[0].numel(), "output gradient": gy[0].numel()}
    assert max(sizes, key=sizes.get) == largest
    assert folded_block_rows(layer, x, gy) == (2 << 20) // (sizes[largest] * 4)
