"""Layers passed to ``fully_shard`` themselves (an ``nn.ModuleList`` of ``Linear`` blocks sharded one
by one, an embedding sharded on its own). FSDP2 gives such a layer a class of its own
(``FSDPLinear``: ``FSDPModule`` and ``nn.Linear``, no ``forward`` of its own), whose per-sample
gradients and norms are those of the class it wrapped: they come from that class's formulas (the
capture hook first, as on any layer), not from the ``torch.func`` fallback, which would
materialise every per-sample gradient. A sharded layer of a class without formulas, or of a
subclass that defines its own ``forward``, still takes the fallback, which calls the layer with its
hooks so that FSDP2's pre-forward hook gathers the weights it reads. Everything is checked against
the batch-size-1 oracle of the unsharded model, also with a user's forward hook that changes a
sharded layer's output. A validator registered for a class still applies to its sharded layers."""

import copy
import gc

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard

import opacus_dp.grad_sample.grad_sample_module as grad_sample_module
from opacus_dp.grad_sample import BookkeepingGradSampleModule, GradSampleModule
from opacus_dp.grad_sample.formula_class import formula_class
from tests.ghost.helpers import assert_norms_and_sums, model_oracle, run_backward
from tests.grad_sample.oracle import default_loss


class Scale(nn.Module):
    """A layer without formulas of its own: the fallback's."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x):
        return x * self.weight


class ShiftedLinear(nn.Linear):
    """A subclass with its own forward: ``nn.Linear``'s formulas would be wrong for it."""

    def forward(self, x):
        return super().forward(x) + self.weight.sum()


class Blocks(nn.Module):
    def __init__(self, last: type = nn.Linear):
        super().__init__()
        self.embed, self.out = nn.Embedding(10, 8), nn.Linear(16, 2)
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16), Scale(16), last(16, 16)])

    def forward(self, tokens):
        h = self.inp(self.embed(tokens)).mean(dim=1)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.out(h)


def _sharded(hooked: bool, last: type = nn.Linear):
    torch.manual_seed(0)
    model = Blocks(last).double()
    if hooked:  # registered before the wrapper's hooks, on a Linear and on the fallback's layer
        model.blocks[0].register_forward_hook(lambda module, args, out: out * 2)
        model.blocks[1].register_forward_hook(lambda module, args, out: out + out ** 2)
    tokens = torch.randint(0, 10, (5, 3))
    oracle = model_oracle(copy.deepcopy(model), (tokens,))
    for leaf in [model.embed, *model.blocks]:
        fully_shard(leaf)
    fully_shard(model)
    return model, tokens, oracle


@pytest.fixture
def fallback_calls(monkeypatch):
    """The layers whose per-sample gradients came from the ``torch.func`` fallback."""
    calls, fallback = [], grad_sample_module.functorch_grad_sample

    def counted(layer, *args, **kwargs):
        calls.append(formula_class(layer).__name__)
        return fallback(layer, *args, **kwargs)

    monkeypatch.setattr(grad_sample_module, "functorch_grad_sample", counted)
    return calls


def _close(wrapper, model):
    wrapper.close()
    del wrapper, model
    gc.collect()  # the sharded modules hold the process group (its store's socket) alive


@pytest.mark.parametrize("hooked", [False, True])
def test_norms_of_sharded_leaf_layers(group, fallback_calls, hooked):
    model, tokens, oracle = _sharded(hooked)
    wrapper = BookkeepingGradSampleModule(model)
    run_backward(wrapper, (tokens,), "mean", 5)
    modes = wrapper.layer_modes()
    assert modes["blocks.0 (FSDPLinear)"] == "ghost" and modes["blocks.2 (FSDPLinear)"] == "ghost"
    assert modes["blocks.1 (FSDPScale)"] == "materialised"
    assert fallback_calls == ["Scale"]
    assert_norms_and_sums(wrapper, oracle)
    _close(wrapper, model)


@pytest.mark.parametrize("hooked", [False, True])
@pytest.mark.parametrize("force_functorch, through_fallback", [
    (False, ["Scale"]), (True, ["Embedding", "Linear", "Linear", "Linear", "Linear", "Scale"])])
def test_per_sample_gradients_of_sharded_leaf_layers(group, fallback_calls, hooked, force_functorch, through_fallback):
    model, tokens, oracle = _sharded(hooked)
    wrapper = GradSampleModule(model, force_functorch=force_functorch, loss_reduction="sum")
    default_loss(wrapper(tokens)).backward()
    assert sorted(fallback_calls) == through_fallback
    _assert_grad_samples(wrapper, oracle)
    _close(wrapper, model)


def test_sharded_subclass_with_its_own_forward_takes_the_fallback(group, fallback_calls):
    model, tokens, oracle = _sharded(hooked=True, last=ShiftedLinear)
    assert formula_class(model.blocks[2]) is type(model.blocks[2]).__bases__[1] is ShiftedLinear
    wrapper = BookkeepingGradSampleModule(model)
    run_backward(wrapper, (tokens,), "mean", 5)
    assert wrapper.layer_modes()["blocks.2 (FSDPShiftedLinear)"] == "materialised"
    assert sorted(fallback_calls) == ["Scale", "ShiftedLinear"]
    assert_norms_and_sums(wrapper, oracle)
    _close(wrapper, model)


def _as(cls: type) -> nn.Module:
    layer = nn.Linear(2, 2)
    layer.__class__ = cls  # as fully_shard does
    return layer


def test_formula_class_unwraps_only_what_fully_shard_makes():
    made = type("FSDPLinear", (FSDPModule, nn.Linear), {"__deepcopy__": lambda self, memo: self})
    assert formula_class(_as(made)) is nn.Linear
    own_forward = type("FSDPLinear", (FSDPModule, nn.Linear), {"forward": lambda self, x: x})
    assert formula_class(_as(own_forward)) is own_forward
    renamed = type("Sharded", (FSDPModule, nn.Linear), {})
    assert formula_class(_as(renamed)) is renamed
    assert formula_class(nn.Linear(2, 2)) is nn.Linear and formula_class(ShiftedLinear(2, 2)) is ShiftedLinear


def _assert_grad_samples(wrapper, oracle):
    for name, p in wrapper.trainable_parameters():
        grad_sample = p.grad_sample
        grad_sample = grad_sample.full_tensor() if hasattr(grad_sample, "full_tensor") else grad_sample
        torch.testing.assert_close(grad_sample, oracle[name], rtol=1e-9, atol=1e-10, msg=lambda m: f"{name}: {m}")


def test_a_registered_validator_still_refuses_a_layer_sharded_itself(group):
    from opacus_dp.validators import ModuleValidator, UnsupportedModuleError, register_module_validator

    register_module_validator(Scale)(lambda module: [UnsupportedModuleError("it is not allowed here")])
    try:
        model, _, _ = _sharded(hooked=False)
        errors = [str(e) for e in ModuleValidator.validate(model)]
        assert errors == ["model.blocks.1 (FSDPScale) cannot be private: it is not allowed here"]
    finally:
        ModuleValidator.VALIDATORS.pop(Scale)
        del model
        gc.collect()


def test_sharded_leaves_under_bfloat16_mixed_precision(group):
    """FSDP2's ``MixedPrecisionPolicy`` on every sharded layer: each casts its own inputs in its
    pre-forward hook, which the capture hook (a forward hook) sees; float32 norms and sums within
    bfloat16's rounding of the float32 oracle."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    model = Blocks()
    tokens = torch.randint(0, 10, (5, 3))
    oracle = model_oracle(copy.deepcopy(model), (tokens,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for leaf in [model.embed, *model.blocks, model]:
        fully_shard(leaf, mp_policy=policy)
    wrapper = BookkeepingGradSampleModule(model)
    run_backward(wrapper, (tokens,), "mean", 5)
    assert wrapper.layer_modes()["blocks.0 (FSDPLinear)"] == "ghost"
    assert_norms_and_sums(wrapper, oracle, rtol=3e-2, atol=1e-3)
    _close(wrapper, model)
