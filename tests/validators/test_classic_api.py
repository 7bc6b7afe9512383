"""Opacus 0.x entry points: DPModelInspector and utils.module_modification."""

import pytest
import torch
import torch.nn as nn

from opacus_dp.dp_model_inspector import DPModelInspector, IncompatibleModuleException
from opacus_dp.utils import module_modification as mm


def model_with_problems():
    return nn.Sequential(
        nn.Conv2d(3, 50, 1),
        nn.BatchNorm2d(50),
        nn.Sequential(nn.Conv1d(50, 6, 1), nn.BatchNorm1d(6)),
        nn.LSTM(3, 3),
    )


def test_inspector_accepts_valid_model():
    assert DPModelInspector().validate(nn.Sequential(nn.Linear(3, 2), nn.GroupNorm(1, 2))) is True


def test_inspector_lists_every_violation():
    with pytest.raises(IncompatibleModuleException) as info:
        DPModelInspector().validate(model_with_problems())
    text = str(info.value)
    for expected in ("model.1 (BatchNorm2d)", "model.2.1 (BatchNorm1d)", "model.3 (LSTM)"):
        assert expected in text
    assert "fix: ModuleValidator.fix(model)" in text and len(info.value.errors) == 3


def test_inspector_without_throwing():
    inspector = DPModelInspector(should_throw=False)
    assert inspector.validate(model_with_problems()) is False and len(inspector.violations) == 3


def test_convert_batchnorm_modules_in_place():
    model = model_with_problems()
    conv = model[0]
    returned = mm.convert_batchnorm_modules(model)
    assert returned is model and model[0] is conv
    assert isinstance(model[1], nn.GroupNorm) and model[1].num_groups == 25 and model[1].num_channels == 50
    assert isinstance(model[2][1], nn.GroupNorm) and model[2][1].num_groups == 6
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def test_convert_with_other_converters_and_root():
    model = mm.convert_batchnorm_modules(model_with_problems(), converter=mm._batchnorm_to_instancenorm)
    assert isinstance(model[1], nn.InstanceNorm2d) and isinstance(model[2][1], nn.InstanceNorm1d)
    assert isinstance(mm.nullify_batchnorm_modules(model_with_problems())[1], nn.Identity)
    root = mm.convert_batchnorm_modules(nn.BatchNorm1d(96))
    assert isinstance(root, nn.GroupNorm) and root.num_groups == 32
    assert isinstance(mm._batchnorm_to_groupnorm(nn.BatchNorm2d(3)), nn.GroupNorm)


def test_replace_all_modules_with_custom_class():
    model = nn.Sequential(nn.ReLU(), nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    mm.replace_all_modules(model, nn.ReLU, lambda m: nn.Tanh())
    assert isinstance(model[0], nn.Tanh) and isinstance(model[1][1], nn.Tanh)
    x = torch.randn(3, 2)
    torch.testing.assert_close(model(x), torch.tanh(model[1][0](torch.tanh(x))))


def test_classic_attach_refuses_an_invalid_model_with_opacus_0x_error_type():
    """Opacus 0.x's attach raised IncompatibleModuleException listing every offending module
    (still an UnsupportedModuleError for code written against 1.x); nothing is attached."""
    import warnings

    from opacus_dp import PrivacyEngine
    from opacus_dp.errors import UnsupportedModuleError

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2), nn.BatchNorm1d(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(model, sample_rate=0.1, noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(IncompatibleModuleException, match=r"(?s)2 module\(s\).*model.1 \(BatchNorm1d\).*model.3") as error:
        engine.attach(optimizer)
    assert isinstance(error.value, UnsupportedModuleError) and len(error.value.errors) == 2
    assert engine.optimizer is None and not hasattr(optimizer, "privacy_engine")
