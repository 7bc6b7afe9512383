"""Frozen BatchNorm (fine-tuning a pretrained backbone): trained privately only while it applies
its running statistics. Oracle: per-sample gradients of the head from a batch-size-1 autograd
loop through the same frozen, eval-mode BatchNorm, clipped by hand (σ = 0)."""

import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.errors import UnsupportedModuleError
from tests.distributed.oracle import clipped_mean_update, per_sample_grads, sgd_step

MODES = ["hooks", "functorch", "ghost", "bk"]


def _model(seed=0):
    torch.manual_seed(seed)
    backbone = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten()).double()
    with torch.no_grad():  # "pretrained" statistics
        backbone[1].running_mean.uniform_(-1, 1)
        backbone[1].running_var.uniform_(0.5, 2)
    backbone.requires_grad_(False)
    return nn.Sequential(backbone, nn.Linear(4 * 4 * 4, 3).double())


def _private(model, mode, **kwargs):
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(24, 3, 6, 6, generator=g, dtype=torch.float64) * 3,
                         torch.randint(0, 3, (24,), generator=g))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine()
        out = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                  data_loader=DataLoader(data, batch_size=8), noise_multiplier=0.0,
                                  max_grad_norm=0.05, poisson_sampling=False, grad_sample_mode=mode, **kwargs)
    return engine, out[0], out[1], out[-1]


@pytest.mark.parametrize("mode", MODES)
def test_frozen_batchnorm_in_eval_mode_trains_the_head_exactly(mode):
    model = _model()
    oracle = _model()
    engine, gsm, optimizer, loader = _private(model, mode)
    model[0].eval()
    oracle[0].eval()
    stats = [b.clone() for b in model[0][1].buffers()]
    for x, y in loader:
        optimizer.zero_grad()
        nn.CrossEntropyLoss()(gsm(x), y).backward()
        optimizer.step()
        sgd_step(oracle, clipped_mean_update(oracle, nn.CrossEntropyLoss(), x, y, 0.05, 8), 0.5)
    assert len(engine.accountant) == 3
    assert all(torch.equal(a, b) for a, b in zip(stats, model[0][1].buffers())), "no statistics update"
    for got, want in zip(model.parameters(), oracle.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    norms = [torch.cat([g.flatten() for g in s]).norm() for s in per_sample_grads(oracle, nn.CrossEntropyLoss(), x, y)]
    assert max(norms) > 0.05, "clipping must be active"


@pytest.mark.parametrize("mode", MODES)
def test_batch_statistics_are_refused_before_anything_is_recorded(mode):
    model = _model()
    engine, gsm, optimizer, loader = _private(model, mode)
    x, y = next(iter(loader))
    stats = [b.clone() for b in model[0][1].buffers()]
    with pytest.raises(UnsupportedModuleError, match=r"0\.1 \(BatchNorm2d\) is frozen but .*training mode.*\.eval\(\)"):
        gsm(x)  # model.train() is the default
    assert all(torch.equal(a, b) for a, b in zip(stats, model[0][1].buffers()))
    no_stats = _model()
    no_stats[0][1].track_running_stats = False
    no_stats[0][1].running_mean = no_stats[0][1].running_var = None
    with pytest.raises(UnsupportedModuleError, match=r"0\.1 \(BatchNorm2d\)"):
        _private(no_stats, mode)  # validation: it can never apply running statistics
    from opacus_dp.grad_sample.utils import wrap_model

    gsm2 = wrap_model(no_stats, "bk" if mode == "ghost" else mode)  # built directly: no validation
    no_stats[0].eval()
    with pytest.raises(UnsupportedModuleError, match="no running statistics"):
        gsm2(x)


def test_batchnorm_unfrozen_after_wrapping_is_refused():
    model = _model()
    _, gsm, _, loader = _private(model, "hooks")
    model[0].eval()
    model[0][1].weight.requires_grad_(True)
    with pytest.raises(UnsupportedModuleError, match="has trainable parameters"):
        gsm(next(iter(loader))[0])


def test_forward_with_hooks_disabled_is_not_checked():
    """E.g. a GAN's generator step: nothing of that call reaches the private step."""
    model = _model()
    _, gsm, _, loader = _private(model, "hooks")
    gsm.disable_hooks()
    gsm(next(iter(loader))[0])
    gsm.enable_hooks()
    with pytest.raises(UnsupportedModuleError):
        gsm(next(iter(loader))[0])


def test_batchnorm_without_running_statistics_is_flagged_and_replaced():
    """It normalises with the batch's statistics in every mode: never private as it is."""
    from opacus_dp.validators import ModuleValidator

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, affine=False, track_running_stats=False))
    (error,) = ModuleValidator.validate(model)
    assert str(error).startswith("model.1 (BatchNorm1d)")
    assert isinstance(ModuleValidator.fix(model)[1], nn.GroupNorm)


def test_instance_norm_with_running_statistics_is_refused_in_training_mode():
    """A wrapper built directly (no ModuleValidator): the running statistics would be learned
    from the batch without noise; in eval mode they are only applied."""
    from opacus_dp.grad_sample import GradSampleModule

    norm = nn.InstanceNorm1d(3, affine=True, track_running_stats=True)
    gsm = GradSampleModule(nn.Sequential(norm), strict=False)
    x = torch.randn(4, 3, 5)
    stats = norm.running_mean.clone()
    with pytest.raises(UnsupportedModuleError, match=r"0 \(InstanceNorm1d\) has track_running_stats=True"):
        gsm(x)
    assert torch.equal(stats, norm.running_mean)
    norm.eval()
    gsm(x).sum().backward()
    assert norm.weight.grad_sample.shape == (4, 3)


def test_frozen_batchnorm_inside_data_parallel_trains_exactly():
    """Frozen layers inside nn.DataParallel need no grad sampler (CPU: DataParallel calls the
    model directly; the replica path is covered on GPUs)."""
    model = _model()
    oracle = _model()
    engine, gsm, optimizer, loader = _private(nn.DataParallel(model), "hooks")
    model[0].eval()
    oracle[0].eval()
    for x, y in loader:
        optimizer.zero_grad()
        nn.CrossEntropyLoss()(gsm(x), y).backward()
        optimizer.step()
        sgd_step(oracle, clipped_mean_update(oracle, nn.CrossEntropyLoss(), x, y, 0.05, 8), 0.5)
    for got, want in zip(model.parameters(), oracle.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model[1].weight.zero_()
    gsm.load_state_dict(saved)  # the user's keys, through GradSampleModule and DataParallel
    assert torch.equal(model[1].weight, saved["1.weight"])
