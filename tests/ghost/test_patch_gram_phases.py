"""The autocorrelation form of a convolution's patch Gram: the strided input's phases taken from
one de-interleaved copy, and the tap sums started from a full tap's copy, give the numbers of the
per-phase slices and of a zero-started sum (bit for bit) and the Gram of the unfolded patches."""

import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from opacus_dp.grad_sample.bookkeeping.norm_samplers.conv import _dims_taps, _phases, _tap_sum, patch_gram
from opacus_dp.grad_sample.conv import conv_windows

LAYERS = [  # (conv class, kwargs, input spatial sizes): every size divisible by its stride
    (nn.Conv1d, dict(kernel_size=3, stride=2, padding=1), (12,)),
    (nn.Conv2d, dict(kernel_size=3, stride=2, padding=1), (8, 6)),
    (nn.Conv2d, dict(kernel_size=5, stride=2, padding=2), (8, 8)),
    (nn.Conv2d, dict(kernel_size=3, stride=(2, 3), padding=1), (6, 9)),
    (nn.Conv2d, dict(kernel_size=2, stride=2), (6, 4)),
    (nn.Conv3d, dict(kernel_size=3, stride=2, padding=1), (4, 4, 6)),
]


def _layer_and_input(cls, kwargs, sizes, dtype=torch.float64):
    torch.manual_seed(0)
    layer = cls(4, 3, **kwargs).to(dtype)
    return layer, torch.randn(2, 4, *sizes, dtype=dtype)


@pytest.mark.parametrize("cls,kwargs,sizes", LAYERS)
def test_phases_are_views_of_one_deinterleaved_copy_holding_the_strided_slices(cls, kwargs, sizes):
    layer, x = _layer_and_input(cls, kwargs, sizes)
    dims = _dims_taps(layer, x)
    parts = dict(_phases(x, dims, layer.groups))
    assert sorted(parts) == sorted(itertools.product(*(range(t.stride) for t in dims)))
    storages = {part.untyped_storage().data_ptr() for part in parts.values()}
    assert len(storages) == 1 and storages != {x.untyped_storage().data_ptr()}  # one copy, not x
    for phase, part in parts.items():
        expected = x[(slice(None), slice(None), *(slice(r, None, t.stride) for r, t in zip(phase, dims)))]
        assert torch.equal(part, expected)


@pytest.mark.parametrize("cls,kwargs,sizes", LAYERS)
def test_deinterleaved_autocorrelation_is_the_unfolded_patches_gram(cls, kwargs, sizes):
    layer, x = _layer_and_input(cls, kwargs, sizes)
    patches = conv_windows(layer, x).flatten(0, 1)  # (B*G, d, T)
    expected = patches.transpose(1, 2) @ patches
    if cls is nn.Conv2d:  # F.unfold: an independent im2col
        unfolded = F.unfold(F.pad(x, [p for p in reversed(layer.padding) for _ in (0, 1)]), layer.kernel_size,
                            stride=layer.stride)
        torch.testing.assert_close(expected, unfolded.transpose(1, 2) @ unfolded, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(patch_gram(layer, x, method="autocorrelation"), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", ["grouped", "channels_last", "indivisible"])
def test_other_inputs_take_the_strided_slices(layout):
    """Grouped layers, inputs not in the default layout and sizes the stride does not divide
    take one strided slice per phase (no de-interleaved copy): the parts are views of ``x``."""
    groups = 2 if layout == "grouped" else 1
    layer = nn.Conv2d(4, 4, 3, stride=2, padding=1, groups=groups)
    x = torch.randn(2, 4, 7 if layout == "indivisible" else 8, 8)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    for _, part in _phases(x, _dims_taps(layer, x), groups):
        assert part.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def _zero_started_tap_sum(grams, dims, taps):
    """The tap sum written plainly: zeros, then every reaching tap added in order."""
    gram = next(iter(grams.values()))
    shape = list(gram.shape)
    shape[dims[0]] = shape[dims[1]] = taps.outputs
    total = gram.new_zeros(shape)
    for phase, shift in taps.phase_shifts():
        gram = grams[phase]
        first, last = max(0, -shift), min(taps.outputs, gram.shape[dims[0]] - shift)
        if first < last:
            source, target = [slice(None)] * gram.dim(), [slice(None)] * gram.dim()
            source[dims[0]] = source[dims[1]] = slice(first + shift, last + shift)
            target[dims[0]] = target[dims[1]] = slice(first, last)
            total[tuple(target)].add_(gram[tuple(source)])
    return total


@pytest.mark.parametrize("kwargs", [dict(kernel_size=3, padding=1), dict(kernel_size=5, padding=2),
                                    dict(kernel_size=3, padding=1, stride=2), dict(kernel_size=3, padding=3),
                                    dict(kernel_size=3, padding=2, dilation=2)])
def test_tap_sums_give_the_zero_started_sums_bit_for_bit(kwargs):
    """float32 Grams of random inputs: starting from a full tap's copy reorders only the first two
    terms (``b + a == a + b``), so every entry is the zero-started sum's, bit for bit."""
    torch.manual_seed(1)
    layer = nn.Conv2d(5, 2, **kwargs)
    x = torch.randn(3, 5, 8, 8)
    dims = _dims_taps(layer, x)
    grams = {}
    for phase, part in _phases(x, dims, 1):
        flat = part.reshape(x.shape[0], part.shape[1], -1)
        grams[phase] = torch.bmm(flat.transpose(1, 2), flat).view(x.shape[0], *part.shape[2:], *part.shape[2:])
    rest = next(iter(grams))[1:]
    by_phase = {phase[0]: g for phase, g in grams.items() if phase[1:] == rest}  # the first dimension's phases
    total = _tap_sum(by_phase, (1, 3), dims[0])
    assert torch.equal(total, _zero_started_tap_sum(by_phase, (1, 3), dims[0]))
    assert total.abs().sum() > 0
