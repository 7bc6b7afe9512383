"""``grad_sample_mode="bk"`` / ``"ghost"`` across 2 gloo processes (DDP and DPDDP), different data per rank.

σ = 0 and clipping active: the ranks' parameters must equal one process running the oracle
(batch-size-1 autograd, clipped by hand) on the concatenation of all ranks' batches, with one
all-reduce per logical step.
"""

import pytest
import torch
import torch.nn as nn

from tests.distributed.oracle import clipped_mean_update, per_sample_grads, sgd_step
from tests.distributed.spawn import run_on_ranks
from tests.distributed.workers import FLAT_C, LAYER_C, LR, make_model
from tests.ghost.distributed_workers import bk_job, make_sequence_model

pytestmark = pytest.mark.distributed
CONFIGS = [(w, c, "bk") for w in ("ddp", "dpddp") for c in ("flat", "per_layer")] + [
    ("ddp", "flat", "ghost"), ("dpddp", "flat", "ghost")]


@pytest.fixture(scope="module")
def reports():
    return run_on_ranks(bk_job, 2, timeout=240)


def replay(reports, key, clip, model_fn=make_model):
    """Final parameters of the one-process oracle, and whether any sample was clipped."""
    model = model_fn(seed=0)
    clipped_any = False
    with torch.no_grad():
        for p, value in zip(model.parameters(), reports[0][key]["start"]):
            p.copy_(value)
    for step in range(len(reports[0][key]["batches"])):
        pairs = [pair for r in reports for pair in r[key]["batches"][step]]
        x, y = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
        if len(x):
            norms = [torch.cat([g.flatten() for g in s]).norm() for s in
                     per_sample_grads(model, nn.CrossEntropyLoss(), x, y)]
            clipped_any |= bool(max(norms) > (clip if not isinstance(clip, list) else min(clip)))
            update = clipped_mean_update(model, nn.CrossEntropyLoss(), x, y, clip,
                                         reports[0][key]["global_batch"])
            sgd_step(model, update, LR)
    return [p.detach() for p in model.parameters()], clipped_any


@pytest.mark.parametrize("wrapper,clipping,mode", CONFIGS)
def test_norms_only_modes_equal_one_process_on_the_concatenated_batch(reports, wrapper, clipping, mode):
    key = (wrapper, clipping, mode)
    r0, r1 = reports[0][key], reports[1][key]
    assert r0["mode"] == "BookkeepingGradSampleModule"
    assert r0["skips"], "no weight gradient is formed: DDP's own synchronisation is off"
    assert all(torch.equal(a, b) for a, b in zip(r0["final"], r1["final"]))
    assert r0["all_reduces"] == len(r0["batches"]), "one all-reduce per logical step"
    clip = FLAT_C if clipping == "flat" else [LAYER_C] * 4
    expected, clipped_any = replay(reports, key, clip)
    assert clipped_any, "clipping must be active for this comparison to mean anything"
    for got, want in zip(r0["final"], expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("wrapper", ["ddp", "dpddp"])
def test_chunked_per_layer_sums_equal_one_process_on_the_concatenated_batch(reports, wrapper):
    """Per-layer clipping of a sequence model: its Linear layers' sums formed in chunks on each
    rank, reduced in one all-reduce per step, equal the one-process oracle."""
    key = (wrapper, "per_layer", "bk-sequence")
    r0, r1 = reports[0][key], reports[1][key]
    assert sorted(r0["layer_modes"].values()) == ["chunked", "chunked", "ghost"]
    assert all(torch.equal(a, b) for a, b in zip(r0["final"], r1["final"]))
    assert r0["all_reduces"] == len(r0["batches"]), "one all-reduce per logical step"
    expected, clipped_any = replay(reports, key, [LAYER_C] * 6, make_sequence_model)
    assert clipped_any
    for got, want in zip(r0["final"], expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
