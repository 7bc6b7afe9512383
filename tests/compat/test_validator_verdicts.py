"""The verdicts of the two validators are Opacus's: ``DPModelInspector`` those of Opacus 0.15,
``ModuleValidator`` those of Opacus 1.6, except where Opacus lets a privacy problem through
(refused here; docs/compatibility.md)."""

import pytest
import torch
import torch.nn as nn
from torchvision import models

from opacus_dp.dp_model_inspector import DPModelInspector, IncompatibleModuleException
from opacus_dp.utils.module_modification import convert_batchnorm_modules
from opacus_dp.validators import ModuleValidator
from opacus_dp.validators.errors import (IllegalModuleConfigurationError, UnsupportedError,
                                         UnsupportedModuleError)


class ExtraParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.extra_param = nn.Parameter(torch.randn(16, 2))

    def forward(self, x):
        return self.fc(x).matmul(self.extra_param)


def classic(model) -> bool:
    return DPModelInspector(should_throw=False).validate(model)


def test_0x_resnet_verdicts():
    with pytest.raises(IncompatibleModuleException):
        DPModelInspector().validate(models.resnet18())
    fixed = convert_batchnorm_modules(models.resnet18())
    assert classic(fixed) is True
    assert classic(fixed.eval()) is False  # every trainable layer must be in training mode


@pytest.mark.parametrize("in_channels, out_channels, groups, valid", [(3, 6, 1, True), (3, 6, 3, True),
                                                                      (6, 6, 2, False)])
def test_0x_conv2d_group_verdicts(in_channels, out_channels, groups, valid):
    assert classic(nn.Conv2d(in_channels, out_channels, kernel_size=1, groups=groups)) is valid


def test_0x_extra_parameter_verdicts():
    model = ExtraParam()
    inspector = DPModelInspector(should_throw=False)
    assert inspector.validate(model) is False
    assert "model (ExtraParam)" in str(inspector.violations[0]) and "register_grad_sampler" in str(inspector.violations[0])
    model.extra_param.requires_grad = False
    assert classic(model) is True


def test_0x_running_stats_verdicts_and_the_privacy_exception():
    assert classic(nn.InstanceNorm1d(16)) and classic(nn.InstanceNorm1d(16, affine=True))
    assert not classic(nn.InstanceNorm1d(16, affine=True, track_running_stats=True))
    # 0.15 accepted this one (no parameter); its running statistics average the batch without noise
    assert not classic(nn.InstanceNorm1d(16, track_running_stats=True))


def test_0x_unsupported_layer_verdict():
    model = nn.Sequential(nn.Linear(8, 16), nn.Transformer(d_model=16, nhead=2, num_encoder_layers=1,
                                                           num_decoder_layers=1, dim_feedforward=8,
                                                           batch_first=True))  # (torch warns without it)
    assert classic(model) is False


def test_1x_eval_mode_is_invalid():
    model = nn.Sequential(nn.Linear(3, 3), nn.GroupNorm(1, 3))
    assert ModuleValidator.is_valid(model)
    model.eval()
    assert not ModuleValidator.is_valid(model)
    (error,) = ModuleValidator.validate(model)
    assert isinstance(error, IllegalModuleConfigurationError)
    with pytest.raises(UnsupportedModuleError):
        ModuleValidator.validate(model, strict=True)


def test_1x_verdicts_on_layers_opacus_accepts():
    assert ModuleValidator.is_valid(nn.Bilinear(2, 2, 2))  # generic per-sample gradients
    assert ModuleValidator.is_valid(ExtraParam())
    frozen_bn = nn.Sequential(nn.Conv2d(8, 3, 4, 4), nn.BatchNorm2d(3), nn.Conv2d(3, 3, 1),
                              nn.BatchNorm2d(3, affine=False))
    assert not ModuleValidator.is_valid(frozen_bn)
    frozen_bn[1].requires_grad_(False)
    assert ModuleValidator.is_valid(frozen_bn)


def test_error_classes_have_opacus_hierarchy_and_paths():
    import opacus_dp.validators.errors as errors

    assert issubclass(errors.UnsupportedModuleError, UnsupportedError) and issubclass(UnsupportedError, ValueError)
    for name in ("UnsupportableModuleError", "NotYetSupportedModuleError", "ShouldReplaceModuleError",
                 "IllegalModuleConfigurationError"):
        assert issubclass(getattr(errors, name), errors.UnsupportedModuleError)
    assert issubclass(IncompatibleModuleException, UnsupportedModuleError)
