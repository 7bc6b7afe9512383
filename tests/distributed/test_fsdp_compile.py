"""``torch.compile`` of a model sharded with FSDP2, on 2 gloo processes: ``private.compile()`` and
``model.compile()`` (before ``make_private``) train as the eager private model does, on every rank.

The eager FSDP2 training is checked against the one-process oracle in ``test_fsdp.py``; here the
compiled runs are compared with it. Before the FSDP2 meeting hooks ran eagerly, dynamo traced
them into the compiled call and the backward pass failed (a weak reference traced as the object).
"""

import pytest
import torch

from tests.distributed.spawn import run_on_ranks
from tests.distributed.workers_fsdp import make_model
from tests.distributed.workers_fsdp_compile import WAYS, fsdp_compile_job

pytestmark = [pytest.mark.distributed,
              pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")]
WORLD = 2
MODES = ("bk", "hooks")


@pytest.fixture(scope="module")
def reports():
    return run_on_ranks(fsdp_compile_job, WORLD, MODES, "aot_eager", timeout=600)


@pytest.mark.parametrize("way", [w for w in WAYS if w != "eager"])
@pytest.mark.parametrize("mode", MODES)
def test_compiled_fsdp2_trains_as_eager_on_every_rank(reports, mode, way):
    start = [p.detach() for p in make_model(seed=0).parameters()]
    for report in reports:
        eager = report[(mode, "eager")]
        assert any(not torch.equal(a, b) for a, b in zip(eager, start))  # it trained
        for got, want in zip(report[(mode, way)], eager):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for got, want in zip(reports[1][(mode, way)], reports[0][(mode, way)]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # one model on every rank
