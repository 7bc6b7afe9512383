"""FSDP2 (2 gloo processes): a step whose ghost norms were checked at the step, after the layers'
parameters were sharded again, recomputes the suspect norms of its kept calls and updates the
parameters bit for bit as immediate checks in the backward pass do (oracle: the same step with
the checks read at once, itself checked against float64 norms in ``tests/ghost``)."""

import pytest
import torch

from tests.distributed.spawn import run_on_ranks
from tests.distributed.workers_deferred_checks import deferred_against_immediate

pytestmark = pytest.mark.distributed


def test_deferred_checks_under_fsdp2_update_as_immediate_checks():
    reports = run_on_ranks(deferred_against_immediate, 2, timeout=120)
    for report in reports:
        assert report["recomputed"] >= 1  # the cancelling positions were caught at the step
        for got, expected in zip(report["deferred"], report["immediate"], strict=True):
            assert torch.equal(got, expected)
    for got, other in zip(reports[0]["deferred"], reports[1]["deferred"]):
        assert torch.equal(got, other)  # one model on both ranks
    assert not any(torch.equal(p, q) for p, q in zip(reports[0]["deferred"], reports[0]["start"]))  # a step ran
