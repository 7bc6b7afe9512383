"""Ghost norms and weighted gradients of ``nn.Conv1d/2d/3d``.

A convolution with ``G`` groups is, per group, a Linear layer applied at every output
position to the unfolded input patch: with ``A_i`` (``T × d``, ``d = C/G · Π k``) the patches of
sample ``i`` and ``G_i`` (``T × p``, ``p = O/G``) its output gradients at the ``T`` output
positions, the group's weight gradient is ``G_iᵀ A_i`` (Bu et al. 2022, "Scalable and
Efficient Training of Large Convolutional Neural Networks with Differential Privacy"), so

    ‖∇W_i‖²_F = Σ_groups ⟨A_i A_iᵀ, G_i G_iᵀ⟩     (ghost identity per group),

and the bias gradient is ``Σ_t g_t``. The weighted sum ``Σ_i f_i ∇W_i`` is the ordinary batch
weight gradient of the convolution with each sample's output gradient scaled by ``f_i``.
The patches are the im2col windows of :func:`opacus_dp.grad_sample.conv.conv_windows`
(padding applied as the layer's forward applies it).

The patch Gram ``A_i A_iᵀ`` has two forms (:func:`patch_gram`, the cheaper one is used):

* **windows**: unfold the patches (a copy of ``K`` times the input) and multiply,
  ``T² · d`` per sample and group;
* **autocorrelation**: patch ``t`` holds the input at positions ``t·s + k·δ`` (stride ``s``,
  dilation ``δ``, tap ``k`` of ``K``), so with ``R = X_iᵀ X_i`` the Gram of the padded input's
  ``P`` positions (``P² · C/G``),

      (A_i A_iᵀ)[t, t'] = Σ_k R[t·s + k·δ, t'·s + k·δ],

  a sum of strided views of ``R`` and no unfolded copy; the taps ``k = (k_1, …, k_n)`` shift
  each spatial dimension on its own, so the sum is taken one dimension at a time (``Σ_d k_d``
  views, each pass on an array already reduced along the dimensions before it, instead of
  ``K`` full ones: 3 + 3 instead of 9 for 3x3 kernels). With zero padding, the padded
  positions' rows and columns of ``R`` are zeros: ``R`` is the Gram of the unpadded input's
  positions (``n² · C/G``, 64² instead of 10² · 10² for an 8x8 input padded by 1), and a tap
  adds into the outputs whose window position falls inside the input. With stride ``s`` both
  positions of a term ``t·s + k·δ`` and ``t'·s + k·δ`` lie in the same *phase* of the input
  (the positions ``r, r + s, r + 2s, …`` with ``r = k·δ mod s``, per spatial dimension), so
  only the Grams within each phase are needed (polyphase decomposition): ``(P/s)²`` entries per
  phase, ``P²/s`` in all for one dimension, the phases one de-interleaved copy of the input
  (a strided copy each where the strides do not divide its sizes); a tap
  reads its phase's Gram at ``t + c_k`` (``c_k = (k·δ − r)/s``) with stride 1. Cheaper for
  layers with many channels per group (``P/s ≈ T``, so ``P² · C/G / s ≪ T² · d``).
"""

import itertools
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch.nn import grad as conv_grad

from opacus_dp.grad_sample.conv import _prepare_input, conv_windows, padded_input, side_padding
from opacus_dp.grad_sample.bookkeeping.norm_rules import register_norm_rule
from opacus_dp.grad_sample.bookkeeping.norm_samplers.trust import (
    bound_from_diagonal, materialised_sq_norms, trusted_sq_norms)
from opacus_dp.maths.layouts import positions_by_channels
from opacus_dp.module_parameters import trainable
from opacus_dp.grad_sample.registry import PerSampleGrads, register_norm_sampler

ConvNd = Union[nn.Conv1d, nn.Conv2d, nn.Conv3d]
CONV_TYPES = [nn.Conv1d, nn.Conv2d, nn.Conv3d]
_WEIGHT_GRAD = {1: conv_grad.conv1d_weight, 2: conv_grad.conv2d_weight, 3: conv_grad.conv3d_weight}


def _check_batched(layer: ConvNd, x: torch.Tensor) -> None:
    if x.dim() != len(layer.kernel_size) + 2:
        raise ValueError(
            f"{type(layer).__name__} ghost norms need batched input (B, C, ...) with the batch "
            f"first; got shape {tuple(x.shape)}. Add a batch dimension to unbatched inputs."
        )


@register_norm_sampler(CONV_TYPES)
def conv_norm_sample(layer: ConvNd, activations: List[torch.Tensor],
                     backprops: torch.Tensor) -> Dict[torch.Tensor, torch.Tensor]:
    """Per-sample squared norms of the weight (ghost identity per group); the bias's per-sample
    gradients ``Σ_t g_t`` themselves (as small as their norms' inputs)."""
    x = activations[0].to(backprops.dtype)
    _check_batched(layer, x)
    norms = {}
    batch = backprops.shape[0]
    if trainable(layer.weight):
        if batch == 0:
            norms[layer.weight] = backprops.new_zeros(0)
        else:
            norms[layer.weight] = _trusted_weight_sq_norms(layer, x, backprops)
    if trainable(layer.bias):
        norms[layer.bias] = PerSampleGrads(backprops.flatten(start_dim=2).sum(dim=2))
    return norms


def _trusted_weight_sq_norms(layer: ConvNd, x: torch.Tensor, backprops: torch.Tensor) -> torch.Tensor:
    """Per-sample ``Σ_groups ⟨A Aᵀ, G Gᵀ⟩``, checked against the Gram form's rounding
    (:func:`~opacus_dp.grad_sample.bookkeeping.norm_samplers.trust.trusted_sq_norms`; the bound of a sample
    is the sum of its groups' ``N²``; the fallback materialises from the unfolded patches)."""
    sq_norms, bound_sq = _weight_sq_norms_and_bound(layer, x, backprops)
    batch, groups = backprops.shape[0], layer.groups
    positions = math.prod(backprops.shape[2:])
    taps = math.prod(layer.kernel_size)
    # a chunk holds each sample's gradients (O · C/G · K) and unfolded patches (C · K · T)
    elements = layer.out_channels * layer.in_channels // groups * taps + layer.in_channels * taps * positions

    def pieces(chunk):
        patches = conv_windows(layer, x[chunk]).flatten(0, 1).transpose(1, 2)        # (k*G, T, d)
        g = backprops[chunk].reshape(patches.shape[0], -1, positions).transpose(1, 2)  # (k*G, T, p)
        return patches, g

    def materialise(index: torch.Tensor):
        return materialised_sq_norms(index, batch, elements, pieces, units_per_sample=groups)

    return trusted_sq_norms(sq_norms, bound_sq, materialise, positions)


def _weight_sq_norms_and_bound(layer: ConvNd, x: torch.Tensor, backprops: torch.Tensor):
    batch = backprops.shape[0]
    gram_a = patch_gram(layer, x)                                          # (B*G, T, T)
    g = backprops.reshape(batch * layer.groups, -1, gram_a.shape[-1])     # (B*G, p, T)
    product = gram_a.mul_(torch.bmm(g.transpose(1, 2), g))
    sq_norms = product.sum(dim=(1, 2)).view(batch, -1).sum(dim=1)
    bound_sq = bound_from_diagonal(product.diagonal(dim1=1, dim2=2)).view(batch, -1).sum(dim=1)
    return sq_norms, bound_sq


def _padded_sizes(layer: ConvNd, x: torch.Tensor) -> List[int]:
    """Spatial sizes of ``x`` after the layer's padding."""
    return [n + a + b for n, (a, b) in zip(x.shape[2:], side_padding(layer))]


def _gram_sizes(layer: ConvNd, x: torch.Tensor) -> List[int]:
    """Spatial sizes of the input whose Gram :func:`_autocorrelation_gram` forms: ``x``'s own
    under zero padding (the padded positions' Gram entries are zeros), else the padded ones."""
    return list(x.shape[2:]) if layer.padding_mode == "zeros" else _padded_sizes(layer, x)


def _output_sizes(layer: ConvNd, padded: Sequence[int]) -> List[int]:
    """Output positions per spatial dimension for an input of ``padded`` sizes."""
    return [max(0, (size - d * (k - 1) - 1) // s + 1)
            for size, k, s, d in zip(padded, layer.kernel_size, layer.stride, layer.dilation)]


# Costs of one element of the strided tap sums, of the unfolded windows' copy and of the phases'
# copies, relative to one multiply-add of a batched matrix product. All three are memory-bound
# elementwise passes (the tap sums over strided, non-contiguous views), while the product does
# many multiply-adds per element it loads; the windows' constant also carries the product's poor
# efficiency on their long, thin per-sample matrices. Fitted to CPU timings of 62 layers (3 to
# 128 channels, 4x4 to 32x32 inputs, 3x3 and 5x5 kernels, stride 1 and 2); near the crossover
# both forms cost about the same, so rough constants suffice.
TAP_SUM_COST = 25
UNFOLD_COST = 80
PHASE_COPY_COST = 10


def _phase_sizes(layer: ConvNd, x: torch.Tensor) -> List[List[int]]:
    """Per spatial dimension, the sizes of the input phases the taps read (:class:`_Taps`)."""
    return [[len(range(r, n, taps.stride)) for r in taps.phases()]
            for n, taps in zip(_gram_sizes(layer, x), _dims_taps(layer, x))]


def _tap_sum_elements(taps: Sequence[int], phases: Sequence[Sequence[int]], outputs: Sequence[int]) -> int:
    """Elements the per-dimension tap sums of :func:`_autocorrelation_gram` add, per sample:
    dimension ``d`` adds ``k_d`` views of ``Π_{e≤d} T_e² · Π_{e>d} Σ_r m_{e,r}²`` elements
    (``m_{e,r}``: the sizes of dimension ``e``'s phases)."""
    total, done = 0, 1
    for dim, k in enumerate(taps):
        done *= outputs[dim] ** 2
        total += k * done * math.prod(sum(m * m for m in sizes) for sizes in phases[dim + 1:])
    return total


def _prefers_autocorrelation(layer: ConvNd, x: torch.Tensor) -> bool:
    """Autocorrelation iff its cost ``c · Π_d Σ_r m_{d,r}²`` (the phases' Grams) ``+
    PHASE_COPY_COST`` · (the phases' copies, strided layers) ``+ TAP_SUM_COST`` · (tap-sum
    elements) is below the windows' ``T²·c·K + UNFOLD_COST · c·K·T`` (matrix product and unfolded
    copy; ``c = C/G`` channels per group, ``K`` taps, ``T`` output positions). A 1x1 kernel's
    windows are the input itself: the autocorrelation form could only add its tap sum."""
    if math.prod(layer.kernel_size) == 1:
        return False
    outputs = _output_sizes(layer, _padded_sizes(layer, x))
    phases = _phase_sizes(layer, x)
    positions_out = math.prod(outputs)
    channels, taps = layer.in_channels // layer.groups, math.prod(layer.kernel_size)
    windows = positions_out * channels * taps * (positions_out + UNFOLD_COST)
    grams = channels * math.prod(sum(m * m for m in sizes) for sizes in phases)
    copies = PHASE_COPY_COST * channels * math.prod(sum(sizes) for sizes in phases) if max(layer.stride) > 1 else 0
    tap_sums = TAP_SUM_COST * _tap_sum_elements(layer.kernel_size, phases, outputs)
    return grams + copies + tap_sums < windows


def _dims_taps(layer: ConvNd, x: torch.Tensor) -> List["_Taps"]:
    """The :class:`_Taps` of each spatial dimension for the input of :func:`_gram_sizes`."""
    outputs = _output_sizes(layer, _padded_sizes(layer, x))
    offsets = ([before for before, _ in side_padding(layer)] if layer.padding_mode == "zeros"
               else [0] * len(layer.kernel_size))
    return [_Taps(k, d, s, o, p)
            for k, d, s, o, p in zip(layer.kernel_size, layer.dilation, layer.stride, outputs, offsets)]


def _autocorrelation_gram(layer: ConvNd, x: torch.Tensor) -> torch.Tensor:
    """``A_i A_iᵀ`` per sample and group from the Grams of the input's phases, summing the taps
    one spatial dimension at a time (module doc); under zero padding of the unpadded input."""
    dims = _dims_taps(layer, x)
    if layer.padding_mode != "zeros":
        x = padded_input(layer, x)
    rows, spatial = x.shape[0] * layer.groups, len(dims)
    grams = {}
    for phase, part in _phases(x, dims, layer.groups):
        by_position = positions_by_channels(part, layer.groups)
        grams[phase] = torch.bmm(by_position, by_position.transpose(1, 2)).view(rows, *part.shape[2:], *part.shape[2:])
    for dim, taps in enumerate(dims):  # the phases of dimension dim summed out, those after it kept
        grams = {rest: _tap_sum({phase[0]: g for phase, g in grams.items() if phase[1:] == rest},
                                (1 + dim, 1 + spatial + dim), taps)
                 for rest in dict.fromkeys(phase[1:] for phase in grams)}
    return grams[()].reshape(rows, math.prod(t.outputs for t in dims), -1)


def _phases(x: torch.Tensor, dims: Sequence["_Taps"], groups: int):
    """``(phase, part)`` for each phase the taps read: ``part`` the input at the phase's positions,
    ``(B, C, m_1, …)``. A strided ungrouped layer's default-layout input whose every phase is read
    and whose sizes the strides divide is de-interleaved by one copy, ``(B, s_1, …, C, m_1, …)``, of
    which each phase is a view (its rows laid out as a copy of its own: the same products);
    strided slices copied one phase at a time cost about four times as long on CPU."""
    phases = list(itertools.product(*(taps.phases() for taps in dims)))
    strides, sizes = [taps.stride for taps in dims], x.shape[2:]
    if (len(phases) == 1 or groups != 1 or not x.is_contiguous()
            or any(taps.phases() != list(range(taps.stride)) or n % taps.stride for n, taps in zip(sizes, dims))):
        for phase in phases:
            yield phase, x[(slice(None), slice(None), *(slice(r, None, s) for r, s in zip(phase, strides)))]
        return
    spatial = len(sizes)
    split = x.reshape(*x.shape[:2], *[v for n, s in zip(sizes, strides) for v in (n // s, s)])  # (B, C, m_1, s_1, …)
    order = [0, *(3 + 2 * d for d in range(spatial)), 1, *(2 + 2 * d for d in range(spatial))]
    deinterleaved = split.permute(order).contiguous()  # (B, s_1, …, C, m_1, …)
    for phase in phases:
        yield phase, deinterleaved[(slice(None), *phase)]


@dataclass(frozen=True)
class _Taps:
    """One spatial dimension of a convolution: output ``t``'s tap ``k`` reads input position
    ``t·stride + k·dilation − padding`` (zero padding: outside ``[0, n)`` it reads a zero), which
    is position ``t + c_k`` of the input's phase ``r_k`` (the positions ``r_k + j·stride``)."""
    taps: int
    dilation: int
    stride: int
    outputs: int
    padding: int

    def phase_shifts(self) -> List[Tuple[int, int]]:
        """``(r_k, c_k)`` of each tap ``k``: ``k·dilation − padding = r_k + c_k·stride``."""
        shifts = [divmod(k * self.dilation - self.padding, self.stride) for k in range(self.taps)]
        return [(phase, shift) for shift, phase in shifts]

    def phases(self) -> List[int]:
        """The phases some tap reads, in order."""
        return sorted({r for r, _ in self.phase_shifts()})


def _tap_sum(grams: Dict[int, torch.Tensor], dims, taps: _Taps) -> torch.Tensor:
    """``Σ_k grams[r_k][.., t + c_k, .., t' + c_k, ..]`` over one spatial dimension's taps (its two
    positions at ``dims``; ``grams`` by phase), terms outside the phase being zero: that dimension
    shrinks from the phase's size to ``T`` in both. The taps are added in order, each into the
    outputs it reaches (with zero padding the same numbers as summing the padded Gram's zeros too);
    a first tap reaching only some outputs and a second reaching all start the sum as the second's
    copy (``b + a`` is ``a + b``: the same numbers without a zero-filled start)."""
    terms = []  # (view, first, last) of the taps that reach some output
    for phase, shift in taps.phase_shifts():
        gram = grams[phase]
        first, last = max(0, -shift), min(taps.outputs, gram.shape[dims[0]] - shift)
        if first < last:
            terms.append((gram[_in_both(gram, dims, first + shift, last + shift)], first, last))
    if not terms:
        return _zeros_of_outputs(next(iter(grams.values())), dims, taps.outputs)
    if len(terms) > 1 and terms[0][1:] != (0, taps.outputs) and terms[1][1:] == (0, taps.outputs):
        terms[0], terms[1] = terms[1], terms[0]
    view, first, last = terms[0]
    if (first, last) == (0, taps.outputs):
        total = view.clone()
    else:
        total = _zeros_of_outputs(view, dims, taps.outputs)
        total[_in_both(total, dims, first, last)].add_(view)
    for view, first, last in terms[1:]:
        total[_in_both(total, dims, first, last)].add_(view)
    return total


def _in_both(gram: torch.Tensor, dims, start: int, stop: int) -> tuple:
    """The index of ``[start, stop)`` in both positions ``dims`` of ``gram``."""
    index = [slice(None)] * gram.dim()
    index[dims[0]] = index[dims[1]] = slice(start, stop)
    return tuple(index)


def _zeros_of_outputs(gram: torch.Tensor, dims, outputs: int) -> torch.Tensor:
    shape = list(gram.shape)
    shape[dims[0]] = shape[dims[1]] = outputs
    return gram.new_zeros(shape)


def _windows_gram(layer: ConvNd, x: torch.Tensor) -> torch.Tensor:
    a = conv_windows(layer, x).flatten(0, 1)  # (B*G, d, T)
    return torch.bmm(a.transpose(1, 2), a)


def patch_gram(layer: ConvNd, x: torch.Tensor, method: str = "auto") -> torch.Tensor:
    """``A_i A_iᵀ`` of every sample and group, shape ``(B*G, T, T)``; ``method``:
    ``"windows"``, ``"autocorrelation"`` or ``"auto"`` (the cheaper, module doc)."""
    if method not in ("auto", "windows", "autocorrelation"):
        raise ValueError(f"method must be 'auto', 'windows' or 'autocorrelation', got {method!r}")
    if method == "auto":
        method = "autocorrelation" if _prefers_autocorrelation(layer, x) else "windows"
    return _autocorrelation_gram(layer, x) if method == "autocorrelation" else _windows_gram(layer, x)


def _cuda_float32(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and x.dtype == torch.float32


@contextmanager
def products_as_exact_as_the_norms(x: torch.Tensor):
    """Float32 convolutions on CUDA without cuDNN, whose default is TF32 products on Ampere and
    later GPUs (``torch.backends.cudnn.allow_tf32``): the norms come from matrix products (full
    float32 unless the user lowers their precision), and a clipped sum rounded more coarsely
    than its norms could let a sample's contribution exceed the clipping bound (~2⁻¹¹ relative).
    Without cuDNN, torch's own CUDA convolution runs on the same matrix products."""
    if not (_cuda_float32(x) and torch.backends.cudnn.enabled):
        yield
        return
    torch.backends.cudnn.enabled = False
    try:
        yield
    finally:
        torch.backends.cudnn.enabled = True


def conv_weighted_grad(layer: ConvNd, activations: List[torch.Tensor], backprops: torch.Tensor,
                       factors: Dict[torch.Tensor, torch.Tensor]) -> Dict[torch.Tensor, torch.Tensor]:
    """``Σ_i f_i ∇W_i`` as one weight-gradient convolution (products as exact as the norms':
    :func:`products_as_exact_as_the_norms`); ``Σ_i f_i Σ_t g_it`` for the bias."""
    sums = {}
    if trainable(layer.weight) and layer.weight in factors:
        x, padding = _prepare_input(layer, activations[0].to(backprops.dtype))
        f = factors[layer.weight].to(backprops.dtype).view(-1, *[1] * (backprops.dim() - 1))
        x, gy = (x * f, backprops) if x.numel() <= backprops.numel() else (x, backprops * f)
        with products_as_exact_as_the_norms(x):
            sums[layer.weight] = _WEIGHT_GRAD[x.dim() - 2](
                x, layer.weight.shape, gy, stride=layer.stride, padding=padding,
                dilation=layer.dilation, groups=layer.groups)
    if trainable(layer.bias) and layer.bias in factors:
        per_sample = backprops.flatten(start_dim=2).sum(dim=2)
        sums[layer.bias] = factors[layer.bias].to(per_sample.dtype) @ per_sample
    return sums


def conv_prefers_ghost(layer: ConvNd, activations: List[torch.Tensor]) -> bool:
    """Mixed ghost clipping rule per group: ghost iff ``2 T² < d · p`` (module doc)."""
    positions = math.prod(_output_sizes(layer, _padded_sizes(layer, activations[0])))
    d_in = layer.in_channels // layer.groups * math.prod(layer.kernel_size)
    p_out = layer.out_channels // layer.groups
    return 2 * positions * positions < d_in * p_out


register_norm_rule(CONV_TYPES, weighted_grad=conv_weighted_grad, prefers_ghost=conv_prefers_ghost)
