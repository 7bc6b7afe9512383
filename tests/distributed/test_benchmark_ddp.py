"""``scripts/benchmark.py --ddp`` times each variant with its model in ``DistributedDataParallel``
(a process group of one process): the step is the update its name says (σ = 0: the per-sample
autograd oracle of ``tests/ghost/test_benchmark_script.py``), compiled or not."""

import math

import pytest
import torch

from tests.distributed.spawn import run_on_ranks
from tests.distributed.workers_benchmark_ddp import ddp_steps
from tests.ghost.test_benchmark_script import _expected_gradient, _per_sample_grads, _workload
from tests.script_loading import load_script

pytestmark = pytest.mark.distributed
VARIANTS = ["non-private", "bk", "hooks", "bk@aot_eager"]
CLIP = 1.3


def test_ddp_variants_train_their_model_in_ddp_with_the_update_they_name():
    results = run_on_ranks(ddp_steps, 1, VARIANTS, CLIP, timeout=300)[0]
    x, y = _workload(load_script("benchmark.py", "benchmark_for_oracle")).batch()
    grads = _per_sample_grads(x, y)
    assert min(math.sqrt(sum(float(g.pow(2).sum()) for g in s)) for s in grads) < CLIP  # some unclipped
    for variant in VARIANTS:
        assert results[variant]["ddp"]
        expected = _expected_gradient(variant.split("@")[0], grads, CLIP)
        for got, want in zip(results[variant]["grads"], expected):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-8)
