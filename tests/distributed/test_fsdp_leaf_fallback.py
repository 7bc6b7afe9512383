"""Layers passed to ``fully_shard`` themselves (an ``nn.ModuleList`` of ``Linear`` blocks sharded one
by one) have no per-layer formula of their own type (FSDP2 makes a subclass, ``FSDPLinear``): their
per-sample gradients come from the ``torch.func`` fallback, which calls the layer with its hooks so
that FSDP2's pre-forward hook gathers the weights it reads. Checked against the batch-size-1 oracle of
the unsharded model, also with a user's forward hook that changes a sharded block's output (the
fallback recomputes the output the capture hook saw, the hooked one there)."""

import copy
import gc

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from opacus_dp.grad_sample import BookkeepingGradSampleModule, GradSampleModule
from tests.ghost.helpers import assert_norms_and_sums, model_oracle, run_backward
from tests.grad_sample.oracle import default_loss


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 2)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.out(h)


def _sharded(hooked: bool):
    torch.manual_seed(0)
    model = Blocks().double()
    if hooked:
        model.blocks[0].register_forward_hook(lambda module, args, out: out * 2)
    x = torch.randn(5, 8, dtype=torch.float64)
    oracle = model_oracle(copy.deepcopy(model), (x,))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, x, oracle


@pytest.mark.parametrize("hooked", [False, True])
def test_norms_of_sharded_leaf_layers(group, hooked):
    model, x, oracle = _sharded(hooked)
    wrapper = BookkeepingGradSampleModule(model)
    run_backward(wrapper, (x,), "mean", 5)
    assert wrapper.layer_modes()["blocks.0 (FSDPLinear)"] == "materialised"
    assert_norms_and_sums(wrapper, oracle)
    wrapper.close()
    del wrapper, model
    gc.collect()  # the sharded modules hold the process group (its store's socket) alive


@pytest.mark.parametrize("hooked", [False, True])
def test_functorch_mode_on_sharded_leaf_layers(group, hooked):
    model, x, oracle = _sharded(hooked)
    wrapper = GradSampleModule(model, force_functorch=True, loss_reduction="sum")
    default_loss(wrapper(x)).backward()
    for name, p in wrapper.trainable_parameters():
        grad_sample = p.grad_sample
        grad_sample = grad_sample.full_tensor() if hasattr(grad_sample, "full_tensor") else grad_sample
        torch.testing.assert_close(grad_sample, oracle[name], rtol=1e-9, atol=1e-10)
    wrapper.close()
    del wrapper, model, p
    gc.collect()
