"""GradSampleModule: wrapping, hook removal, memory, attribute passthrough, validation."""

import gc
import weakref

import pytest
import torch
import torch.nn as nn

from opacus_dp.errors import UnsupportedModuleError
from opacus_dp.grad_sample import GradSampleModule
from opacus_dp.state_views import OPACUS_0X, is_consumed

HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_is_full_backward_hook",
)


def make_model():
    return nn.Sequential(
        nn.Conv1d(2, 3, 3), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(6, 4),
        nn.Tanh(), nn.Linear(4, 2),
    )


def snapshot(model):
    modules = {
        name: (sorted(m.__dict__), {k: dict(v) if isinstance(v, dict) else v
                                    for k, v in ((k, getattr(m, k)) for k in HOOK_DICTS)})
        for name, m in model.named_modules()
    }
    params = {name: sorted(p.__dict__) for name, p in model.named_parameters()}
    return modules, params


def train_step(gsm, batch=4):
    gsm(torch.randn(batch, 2, 4)).sum().backward()


def test_close_restores_the_module_exactly():
    model = make_model()
    before = snapshot(model)
    gsm = GradSampleModule(model)
    train_step(gsm)
    assert model[0].weight.grad_sample.shape == (4, 3, 2, 3)
    gsm.close()
    assert snapshot(model) == before
    out = model(torch.randn(4, 2, 4))
    out.sum().backward()
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())


def test_graph_built_before_close_adds_nothing_after_close():
    model = make_model()
    gsm = GradSampleModule(model)
    out = gsm(torch.randn(4, 2, 4))
    gsm.close()
    out.sum().backward()
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())


def test_wrapper_and_original_module_both_record():
    model = make_model()
    gsm = GradSampleModule(model)
    model(torch.randn(3, 2, 4)).sum().backward()
    assert model[3].weight.grad_sample.shape == (3, 4, 6)
    gsm.close()


def test_pop_grad_samples_frees_memory():
    model = make_model()
    gsm = GradSampleModule(model)
    train_step(gsm)
    refs = [weakref.ref(p.grad_sample) for p in model.parameters()]
    popped = gsm.pop_grad_samples()
    assert set(map(id, popped)) == set(map(id, model.parameters()))
    # Opacus 1.x's lifecycle: still readable, marked consumed, never popped twice
    assert all(p.grad_sample is popped[p] and is_consumed(p.grad_sample) for p in model.parameters())
    assert gsm.pop_grad_samples() == {}
    del popped
    gsm.zero_grad_sample()
    gc.collect()
    assert all(r() is None for r in refs)
    assert all(p.grad_sample is None for p in model.parameters())
    gsm.close()


def test_pop_grad_samples_in_the_0x_lifecycle_deletes_the_views():
    model = make_model()
    gsm = GradSampleModule(model)
    gsm.use_state_views(OPACUS_0X)
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())
    train_step(gsm)
    refs = [weakref.ref(p.grad_sample) for p in model.parameters()]
    popped = gsm.pop_grad_samples()
    assert set(map(id, popped)) == set(map(id, model.parameters()))
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())
    del popped
    gc.collect()
    assert all(r() is None for r in refs)
    train_step(gsm, batch=3)  # the next backward pass starts afresh
    assert all(p.grad_sample.shape[0] == 3 for p in model.parameters())
    gsm.close()


@pytest.mark.parametrize("clear", ["zero_grad", "zero_grad_sample", "consumer_sets_none"])
def test_clearing_starts_a_fresh_batch(clear):
    model = make_model()
    gsm = GradSampleModule(model)
    train_step(gsm, batch=4)
    if clear == "consumer_sets_none":
        for p in model.parameters():
            p.grad_sample = None
    else:
        getattr(gsm, clear)()
    assert all(p.grad_sample is None for p in model.parameters())
    if clear == "zero_grad":
        assert all(p.grad is None for p in model.parameters())
    train_step(gsm, batch=2)
    assert all(p.grad_sample.shape[0] == 2 for p in model.parameters())
    assert all(gsm.grad_sample(p) is p.grad_sample for p in model.parameters())
    gsm.close()


def test_no_state_from_unused_calls_eval_or_no_grad():
    model = make_model()
    gsm = GradSampleModule(model)
    gsm(torch.randn(5, 2, 4))  # output never used
    with torch.no_grad():
        gsm(torch.randn(6, 2, 4))
    gsm.eval()
    gsm(torch.randn(7, 2, 4))
    gsm.train()
    train_step(gsm, batch=3)
    assert all(p.grad_sample.shape[0] == 3 for p in model.parameters())
    gsm.close()


def test_frozen_layers_are_skipped_and_unfrozen_ones_recorded():
    model = make_model()
    model[0].requires_grad_(False)
    gsm = GradSampleModule(model)
    train_step(gsm)
    assert not hasattr(model[0].weight, "grad_sample")
    assert [n for n, _ in gsm.trainable_parameters()] == ["3.weight", "3.bias", "5.weight", "5.bias"]
    model[0].weight.requires_grad_(True)
    gsm.zero_grad()
    train_step(gsm)
    assert model[0].weight.grad_sample.shape == (4, 3, 2, 3)
    gsm.close()


def test_disable_hooks():
    model = make_model()
    gsm = GradSampleModule(model)
    gsm.disable_hooks()
    train_step(gsm)
    assert all(p.grad_sample is None for p in model.parameters())  # None from wrapping, as Opacus 1.x
    gsm.enable_hooks()
    train_step(gsm)
    assert all(p.grad_sample.shape[0] == 4 for p in model.parameters())
    gsm.close()


def test_empty_batch_through_conv_linear_and_embedding():
    model = nn.ModuleDict({"conv": nn.Conv1d(2, 3, 3), "fc": nn.Linear(6, 2), "emb": nn.Embedding(5, 2)})
    gsm = GradSampleModule(model)
    out = model["fc"](model["conv"](torch.randn(0, 2, 4)).flatten(1)) + model["emb"](torch.zeros(0, dtype=torch.long))
    out.sum().backward()
    for name, p in model.named_parameters():
        assert p.grad_sample.shape == (0, *p.shape), name
    gsm.close()


class WithExtras(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.note = "kept"

    def describe(self):
        return "model"


def test_attribute_passthrough_and_state_dict_prefix():
    model = WithExtras()
    gsm = GradSampleModule(model)
    assert gsm.note == "kept" and gsm.describe() == "model" and gsm.fc is model.fc
    assert list(gsm.state_dict()) == ["_module.fc.weight", "_module.fc.bias"]
    assert [p for p in gsm.parameters()] == [p for p in model.parameters()]
    assert gsm.loss_reduction == "mean" and gsm.batch_first is True
    with pytest.raises(AttributeError):
        gsm.missing_attribute
    gsm.close()


def test_wrapping_twice_is_refused_until_closed():
    model = make_model()
    gsm = GradSampleModule(model)
    with pytest.raises(ValueError, match="already"):
        GradSampleModule(model)
    with pytest.raises(ValueError, match="already"):
        GradSampleModule(gsm)
    gsm.close()
    GradSampleModule(model).close()


def test_bad_arguments():
    with pytest.raises(ValueError, match="loss_reduction"):
        GradSampleModule(nn.Linear(2, 2), loss_reduction="avg")
    with pytest.raises(TypeError, match="batch_first"):
        GradSampleModule(nn.Linear(2, 2), batch_first=None)
    with pytest.raises(TypeError, match="nn.Module"):
        GradSampleModule(lambda x: x)


def test_unsupported_modules_strict_and_non_strict():
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.LSTM(3, 2))
    with pytest.raises(UnsupportedModuleError) as error:
        GradSampleModule(model)
    assert "1 (BatchNorm1d)" in str(error.value) and "2 (LSTM)" in str(error.value)
    errors = GradSampleModule.validate(model, strict=False)
    assert len(errors) == 2 and not GradSampleModule.is_supported(model)
    gsm = GradSampleModule(model, strict=False)
    assert gsm.unsupported == [str(e) for e in errors]
    model[1].eval()
    model[0](torch.randn(4, 2)).sum().backward()
    assert model[0].weight.grad_sample.shape == (4, 3, 2)
    gsm.close()
    model[1].requires_grad_(False)
    model[2].requires_grad_(False)
    assert GradSampleModule.is_supported(model)


def test_second_backward_through_a_retained_graph_is_refused():
    model = make_model()
    gsm = GradSampleModule(model)
    loss = gsm(torch.randn(3, 2, 4)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()
    gsm.close()
