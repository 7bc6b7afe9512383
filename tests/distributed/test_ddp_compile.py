"""A private model compiled under DDP (2 gloo processes, CPU): its hooked layers are traced into
the compiled graph (``traced_taps``), and it trains as the single-process oracle and as the same
run uncompiled, with the same ε.

One spawned job runs every case of ``workers_compile.CASES``: DDP and DPDDP, ``bk``/``hooks``/
``ghost``, flat and per-layer clipping, a DDP with ``static_graph=True`` (its own gradient
synchronisation kept) and one with ``find_unused_parameters=True``, the ``aot_eager`` and
``inductor`` backends.
"""

import pytest
import torch

from tests.distributed.oracle import replay_on_one_process
from tests.distributed.spawn import run_on_ranks
from tests.distributed.workers import FLAT_C, LAYER_C, LR
from tests.distributed.workers_compile import CASES, compile_job, model_of

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORLD = 2


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(compile_job, WORLD, timeout=600)


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_compiled_ddp_trains_as_the_oracle_with_its_layers_in_the_graph(ranks, case):
    reports = [r[case] for r in ranks]
    clip = FLAT_C if case[2] == "flat" else [LAYER_C] * 4
    expected = replay_on_one_process(model_of(seed=0), reports, clip, LR)
    for report in reports:
        for got, want, start in zip(report["final"], expected, report["start"]):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
            assert not torch.equal(got, start)
        assert report["tapped"] and all(n == 2 for n in report["tapped"])  # both Linear calls, every forward
    assert reports[0]["epsilon"] == reports[1]["epsilon"]


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_compiled_ddp_equals_the_same_run_uncompiled(ranks, case):
    for r in ranks:
        compiled, eager = r[case], r[case + ("eager",)]
        assert compiled["batches"] and len(compiled["batches"]) == len(eager["batches"])
        for got, want in zip(compiled["final"], eager["final"]):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        assert compiled["epsilon"] == eager["epsilon"]
