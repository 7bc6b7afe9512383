"""One mode table read by every entry point; the classic engine composes the shared wiring."""

import warnings

import pytest
import torch
import torch.nn as nn

from opacus_dp import PrivacyEngine
from opacus_dp.engine.model import wrap_module
from opacus_dp.grad_sample import GradSampleModule
from opacus_dp.grad_sample.mode_selection import MODE_NAMES, MODES, mode_of, wrap_for_engine
from opacus_dp.grad_sample.utils import get_gsm_class, wrap_model
from opacus_dp.engine.classic import ClassicPrivacyEngine


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


@pytest.mark.parametrize("name", MODE_NAMES)
def test_make_private_and_attach_build_the_tables_wrapper(name):
    expected = mode_of(name, model())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(model(), batch_size=4, sample_size=16, noise_multiplier=1.0,
                               max_grad_norm=1.0, grad_sample_mode=name)
        optimizer = torch.optim.SGD(engine.module.parameters(), lr=0.1)
        engine.attach(optimizer)
    classic = engine.grad_sample_module
    modern = wrap_module(model(), grad_sample_mode=name, batch_first=True, loss_reduction="mean")
    for wrapper in (classic, modern):
        assert type(wrapper) is expected.wrapper
        assert wrapper.skips_weight_grads == expected.skips_weight_grads
        assert wrapper.force_functorch == expected.options.get("force_functorch", False)
    engine.detach()
    modern.close()


def test_auto_is_the_resolved_mode_with_the_same_options():
    auto = wrap_for_engine(model(), "auto", batch_first=True, loss_reduction="mean")
    resolved = wrap_for_engine(model(), "bk", batch_first=True, loss_reduction="mean")
    assert type(auto) is type(resolved) and auto.skips_weight_grads == resolved.skips_weight_grads
    assert auto.layer_rule == resolved.layer_rule
    parallel = wrap_for_engine(nn.DataParallel(model()), "auto", batch_first=True, loss_reduction="mean")
    assert type(parallel) is GradSampleModule  # DataParallel: the hooks row (its skip is not applied to replicas)


@pytest.mark.parametrize("name", list(MODES))
def test_opacus_entry_points_read_the_same_table(name):
    assert get_gsm_class(name) is MODES[name].opacus_class()
    wrapped = wrap_model(model(), name)
    assert isinstance(wrapped, MODES[name].wrapper)
    if name in ("hooks", "ew", "functorch"):  # Opacus keeps autograd's gradient beside grad_sample
        wrapped(torch.randn(5, 4)).sum().backward()
        assert wrapped._module[0].weight.grad is not None
        assert wrapped._module[0].weight.grad_sample.shape == (5, 3, 4)
    wrapped.close()


def test_unknown_mode_is_named():
    with pytest.raises(ValueError, match="grad_sample_mode must be one of .*'auto'.*got 'fast'"):
        wrap_module(model(), grad_sample_mode="fast", batch_first=True, loss_reduction="mean")


def test_classic_engine_composes_instead_of_subclassing():
    assert not issubclass(ClassicPrivacyEngine, PrivacyEngine)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = PrivacyEngine(model(), batch_size=4, sample_size=16, noise_multiplier=1.0, max_grad_norm=1.0)
    assert type(engine) is ClassicPrivacyEngine and isinstance(engine, PrivacyEngine)
    assert not isinstance(PrivacyEngine(secure_mode=True), ClassicPrivacyEngine)
    notice = [w for w in caught if "secure_mode is off" in str(w.message)]
    assert len(notice) == 1 and notice[0].filename == __file__  # points at the user's line
    with pytest.raises(TypeError, match="attach"):
        engine.make_private(module=model())
