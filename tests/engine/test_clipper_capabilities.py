"""The capabilities every clipper answers (per_tensor, factor_of, bounds, with_bound, with_bounds,
shared_settings, releases_statistic): what the optimizer asks instead of testing types."""

import math

import pytest
import torch
import torch.nn as nn

from opacus_dp.optim import DPOptimizer
from opacus_dp.optim.adaptive_clipping import SETTINGS, AdaptiveClipper
from opacus_dp.optim.clipping import SHARED_SETTING_NAMES, Clipper, FlatClipper, PerLayerClipper

ADAPTIVE = dict(target_unclipped_quantile=0.4, clipbound_learning_rate=0.3, max_clipbound=10.0,
                min_clipbound=0.1, unclipped_num_std=2.0)


class Doubling(Clipper):
    """A user's clipper that overrides nothing but the abstract parts: the defaults apply."""

    sensitivity = 3.0

    def clip_factors(self, per_param_norms):
        return [torch.full_like(n, 0.5) for n in per_param_norms]


def test_flat_clipping():
    flat = FlatClipper(2.0)
    assert not flat.per_tensor and not flat.releases_statistic and flat.bounds == [2.0]
    moved = flat.with_bound(3.5)
    assert type(moved) is FlatClipper and moved.max_grad_norm == 3.5 and flat.max_grad_norm == 2.0
    per_layer = flat.with_bounds([1.0, 2.0])
    assert type(per_layer) is PerLayerClipper and per_layer.max_grad_norms == [1.0, 2.0]
    with pytest.raises(TypeError, match="FlatClipper is not a per-tensor clipper"):
        flat.factor_of(0, torch.ones(2))
    with pytest.raises(ValueError, match="max_grad_norm must be > 0"):
        flat.with_bound(-1.0)


def test_per_layer_clipping_factors_by_hand():
    per_layer = PerLayerClipper([0.5, 2.0])
    assert per_layer.per_tensor and not per_layer.releases_statistic and per_layer.bounds == [0.5, 2.0]
    norms = torch.tensor([0.25, 1.0, 4.0], dtype=torch.float64)
    for index, bound in enumerate([0.5, 2.0]):
        expected = torch.tensor([min(1.0, bound / (n + 1e-6)) for n in norms.tolist()], dtype=torch.float64)
        assert torch.equal(per_layer.factor_of(index, norms), expected)
        assert torch.equal(per_layer.factor(index, norms), expected)  # the earlier name
    half = per_layer.factor_of(0, norms.half())
    assert half.dtype == torch.float32
    with pytest.raises(ValueError, match="only be changed for flat clipping; set max_grad_norms"):
        per_layer.with_bound(1.0)
    assert per_layer.with_bounds([3.0, 4.0]).bounds == [3.0, 4.0]
    per_layer.bounds.append(9.0)  # a copy: the clipper's bounds are unchanged
    assert per_layer.max_grad_norms == [0.5, 2.0]


def _adaptive_optimizer():
    model = nn.Linear(3, 2)
    clipper = AdaptiveClipper(1.0, **ADAPTIVE)
    return DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                       expected_batch_size=8, clipping=clipper)


@pytest.mark.parametrize("name", ["max_grad_norm", "max_grad_norms"])
def test_adaptive_clipping_refuses_a_new_bound_with_the_optimizers_message(name):
    optimizer = _adaptive_optimizer()
    with pytest.raises(ValueError) as from_optimizer:
        setattr(optimizer, name, 2.0 if name == "max_grad_norm" else [2.0, 2.0])
    with pytest.raises(ValueError) as from_clipper:
        if name == "max_grad_norm":
            optimizer.clipper.with_bound(2.0)
        else:
            optimizer.clipper.with_bounds([2.0, 2.0])
    assert str(from_clipper.value) == str(from_optimizer.value)
    assert f"optimizer.{name} cannot be set with clipping='adaptive'" in str(from_clipper.value)


def test_adaptive_clipping_capabilities():
    adaptive = AdaptiveClipper(1.5, **ADAPTIVE)
    assert not adaptive.per_tensor and adaptive.releases_statistic and adaptive.bounds == [1.5]
    with pytest.raises(TypeError, match="AdaptiveClipper is not a per-tensor clipper"):
        adaptive.factor_of(0, torch.ones(2))
    shared = adaptive.shared_settings()
    assert list(shared) == list(SHARED_SETTING_NAMES)
    assert {f"adaptive clipping {n}": shared[f"adaptive clipping {n}"] for n in SETTINGS} == \
        {f"adaptive clipping {n}": v for n, v in ADAPTIVE.items()}
    assert [v for k, v in shared.items() if not k.startswith("adaptive")] == [None, None]


def test_shared_settings_have_one_shape_and_match_what_ranks_share_today():
    """The same names for every clipper (a distributed agreement table keeps its shape); the
    adaptive entries are those the optimizer's settings_ranks_share() lists."""
    for clipper in (FlatClipper(1.0), PerLayerClipper([1.0]), Doubling(), AdaptiveClipper(1.0, **ADAPTIVE)):
        assert list(clipper.shared_settings()) == list(SHARED_SETTING_NAMES)
    assert all(v is None for v in FlatClipper(1.0).shared_settings().values())
    optimizer = _adaptive_optimizer()
    ranks_share = optimizer.settings_ranks_share()
    for key, value in optimizer.clipper.shared_settings().items():
        if key.startswith("adaptive clipping"):
            assert ranks_share[key] == value


def test_a_user_clipper_gets_the_defaults_of_a_fixed_flat_bound():
    user = Doubling()
    assert not user.per_tensor and not user.releases_statistic and user.bounds == [3.0]
    with pytest.raises(ValueError, match="only be changed for flat clipping"):
        user.with_bound(1.0)
    assert user.with_bounds([1.0]).bounds == [1.0]
    with pytest.raises(TypeError, match="Doubling is not a per-tensor clipper"):
        user.factor_of(0, torch.ones(1))
    assert math.isclose(user.gradient_noise_multiplier(0.7), 0.7)
