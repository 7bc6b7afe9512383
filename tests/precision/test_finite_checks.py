"""The finiteness checks of a step read each tensor once through its largest magnitude: any NaN,
+inf or -inf anywhere in any tensor, of any floating dtype, is found (against ``torch.isfinite``
element by element); the outside-use check's peaks and gaps are those of a float64 oracle and
turn non-finite exactly when either side holds a non-finite value."""

import math

import pytest
import torch

from opacus_dp.grad_sample import outside_use_totals
from opacus_dp.grad_sample.outside_use_totals import _checked_stats, _peaks_and_gaps
from opacus_dp.maths.per_sample import JOINED_CHECK_ELEMENTS, all_finite, largest_magnitude

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BAD = (float("nan"), float("inf"), float("-inf"))


def oracle(tensors):
    return all(bool(torch.isfinite(t).all()) for t in tensors)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", BAD)
def test_one_bad_value_anywhere_is_found(dtype, bad):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(5, 7, generator=g).to(dtype), torch.randn(300, generator=g).to(dtype), torch.empty(0)]
    assert all_finite(tensors) and oracle(tensors)
    for which, position in ((0, (4, 6)), (1, (0,)), (1, (299,))):
        spoiled = [t.clone() for t in tensors]
        spoiled[which][position] = bad
        assert all_finite(spoiled) is False and oracle(spoiled) is False


@pytest.mark.parametrize("bad", BAD)
def test_small_tensors_checked_together_and_large_ones_alone(bad):
    """Many small tensors of mixed dtypes (joined into one check) beside one above the joining
    size (checked alone): a bad value in any of them, at any position, is found."""
    g = torch.Generator().manual_seed(1)
    small = [torch.randn(3, generator=g).to(dtype) for dtype in DTYPES for _ in range(5)]
    large = torch.randn(JOINED_CHECK_ELEMENTS + 1, generator=g)
    tensors = small + [large]
    assert all_finite(tensors) and all_finite(small) and all_finite([large])
    for which in range(len(tensors)):
        for position in (0, tensors[which].numel() - 1):
            spoiled = [t.clone() for t in tensors]
            spoiled[which].view(-1)[position] = bad
            assert all_finite(spoiled) is False and oracle(spoiled) is False, (which, position)


def test_large_finite_values_are_finite():
    """Magnitudes, not sums: float32's largest values, many of them, stay finite."""
    big = torch.full((1000,), torch.finfo(torch.float32).max)
    assert all_finite([big, -big, torch.tensor([1e300], dtype=torch.float64)])
    assert float(largest_magnitude(-big)) == torch.finfo(torch.float32).max


def test_no_tensors_or_only_empty_ones_are_finite():
    assert all_finite([]) and all_finite([torch.empty(0), torch.empty(3, 0)])


def test_peaks_and_gaps_match_a_float64_oracle():
    g = torch.Generator().manual_seed(1)
    pairs = [(torch.randn(4, 6, generator=g).half(), torch.randn(4, 6, generator=g)),
             (torch.randn(9, generator=g), torch.randn(9, generator=g))]
    for (peak, gap), (total, expected) in zip(_peaks_and_gaps(pairs), pairs):
        total64 = total.to(torch.float32).double()
        assert peak == pytest.approx(float(total64.abs().max()), rel=1e-7)
        assert gap == pytest.approx(float((expected.double() - total64).abs().max()), rel=1e-6)


@pytest.mark.parametrize("side", ["total", "expected"])
@pytest.mark.parametrize("bad", BAD)
def test_a_bad_value_on_either_side_makes_the_pair_unjudged(side, bad):
    """Both numbers finite exactly when both tensors are: the check skips such a pair."""
    total, expected = torch.ones(3, 4), torch.ones(3, 4)
    (total if side == "total" else expected)[1, 2] = bad
    (peak, gap), (clean_peak, clean_gap) = _peaks_and_gaps([(total, expected), (torch.ones(2), torch.ones(2))])
    assert not (math.isfinite(peak) and math.isfinite(gap))
    assert (clean_peak, clean_gap) == (1.0, 0.0)


def _mixed_pairs(gen, batch=5):
    """``(G, g)`` pairs: small totals of several shapes and dtypes (joined), two above the joining
    size, and one of another batch size."""
    shapes = [(3,), (4, 6), (2, 3, 5), (JOINED_CHECK_ELEMENTS,), (JOINED_CHECK_ELEMENTS + 1,), (70, 70), (7,)]
    pairs = []
    for i, shape in enumerate(shapes):
        rows = batch + 2 if i == len(shapes) - 1 else batch
        g = torch.randn(rows, *shape, generator=gen)
        dtype = torch.float16 if i == 1 else torch.float32
        total = (g.sum(dim=0) + 0.01 * i * torch.randn(shape, generator=gen)).to(dtype)
        pairs.append((total, g.to(dtype) if i == 2 else g))
    return pairs


@pytest.mark.parametrize("undo_mean", [False, True])
def test_checked_stats_of_small_and_large_totals_match_a_float64_oracle(undo_mean):
    pairs = _mixed_pairs(torch.Generator().manual_seed(4))
    for (peak, gap), (total, g) in zip(_checked_stats(pairs, undo_mean), pairs):
        total64 = total.to(torch.float32).double()
        expected = g.double().sum(dim=0) / (g.shape[0] if undo_mean else 1)
        assert peak == pytest.approx(float(total64.abs().max()), rel=1e-7)
        assert gap == pytest.approx(float((expected - total64).abs().max()), rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("index", [0, 2, 4])
@pytest.mark.parametrize("side", ["total", "per-sample"])
@pytest.mark.parametrize("bad", BAD)
def test_a_bad_value_leaves_only_its_own_pair_unjudged(index, side, bad):
    """A NaN or inf in a joined total (or its per-sample gradients) stays in that pair's row."""
    pairs = _mixed_pairs(torch.Generator().manual_seed(5))
    clean = _checked_stats(pairs, undo_mean=True)
    target = pairs[index][0] if side == "total" else pairs[index][1]
    target.view(-1)[-1] = bad
    for i, (peak, gap) in enumerate(_checked_stats(pairs, undo_mean=True)):
        if i == index:
            assert not (math.isfinite(peak) and math.isfinite(gap))
        else:
            assert (peak, gap) == clean[i]


def test_joined_copies_stay_within_their_bound_and_agree_with_single_tensors(monkeypatch):
    """Many small tensors are joined in groups of at most JOINED_PER_SAMPLE_ELEMENTS per-sample
    entries (a tensor above the bound alone), with the same stats as taken one by one."""
    gen = torch.Generator().manual_seed(6)
    pairs = [(torch.randn(n, generator=gen), torch.randn(4, n, generator=gen)) for n in (3, 20, 1, 9, 30, 2, 7)]
    alone = [_checked_stats([pair], undo_mean=True)[0] for pair in pairs]
    joined_sizes, original = [], outside_use_totals._joined_stats

    def spied(group, undo_mean):
        joined_sizes.append((sum(g.numel() for _, g in group), len(group)))
        return original(group, undo_mean)

    monkeypatch.setattr(outside_use_totals, "JOINED_PER_SAMPLE_ELEMENTS", 60)
    monkeypatch.setattr(outside_use_totals, "_joined_stats", spied)
    stats = _checked_stats(pairs, undo_mean=True)
    assert len(joined_sizes) > 2 and all(size <= 60 or count == 1 for size, count in joined_sizes)
    assert sum(count for _, count in joined_sizes) == len(pairs)
    for (peak, gap), (peak_alone, gap_alone) in zip(stats, alone):
        assert peak == peak_alone and gap == pytest.approx(gap_alone, rel=1e-5, abs=1e-6)
