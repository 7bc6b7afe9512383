"""The classic engine's detach() on an FSDP2 model removes everything it attached, the ranks'
bounded meeting hooks included: the model then trains as a plain FSDP2 model."""

import warnings

import pytest
import torch
import torch.nn as nn

from tests.distributed import workers_fsdp as w
from tests.distributed.spawn import run_on_ranks

pytestmark = pytest.mark.distributed


def _hook_counts(model: nn.Module):
    return (len(model._forward_pre_hooks), len(model._forward_hooks))


def attach_then_detach(rank, world_size):
    from opacus_dp import PrivacyEngine

    model = w.shard_by_hand(w.make_model(seed=0))
    before = _hook_counts(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=w.LR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(model, batch_size=4, sample_size=w.N_SAMPLES, noise_multiplier=0.0,
                               max_grad_norm=w.FLAT_C)
        engine.attach(optimizer)
    attached = _hook_counts(model)
    engine.detach()
    detached = _hook_counts(model)
    x, y = w.dataset().tensors
    nn.CrossEntropyLoss()(model(x[:4]), y[:4]).backward()  # plain FSDP2 training after detach
    optimizer.step()
    return {"before": before, "attached": attached, "detached": detached,
            "finite": all(bool(torch.isfinite(p.full_tensor()).all()) for p in model.parameters())}


def test_detach_removes_the_meeting_hooks():
    for result in run_on_ranks(attach_then_detach, 2, timeout=90):
        assert result["attached"][0] > result["before"][0], "the meeting hook was not installed"
        assert result["detached"] == result["before"]
        assert result["finite"]
