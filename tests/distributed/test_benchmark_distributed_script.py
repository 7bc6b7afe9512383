"""``scripts/benchmark_distributed.py`` counts what each mode sends: on 2 gloo processes, DP-SGD
on DDP with the no-op hook and on DPDDP, in the hooks and the ``bk`` mode, all-reduce the clipped
sums once (one gradient's bytes per step, like non-private DDP, plus the step's settings checked
in the same all-reduce); without the hook DDP also sends the unclipped gradients (twice)."""

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from opacus_dp.distributed.step_clock import CLOCK_COLUMNS
from opacus_dp.optim.dp_optimizer_parts import STEP_SETTINGS

SCRIPTS = str(Path(__file__).resolve().parents[2] / "scripts")


@pytest.fixture(scope="module")
def bench():
    """Imported by name from ``scripts/`` (on ``sys.path``, which spawned workers inherit), so
    that ``mp.spawn`` can pickle its worker function."""
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    return importlib.import_module("benchmark_distributed")


def test_bytes_per_step_of_each_mode_on_two_processes(bench):
    args = SimpleNamespace(width=16, batch_size=8, steps=2)
    gradient_bytes = 4 * sum(p.numel() for p in bench.make_model(args.width).parameters())
    settings_bytes = 4 * 2 * (len(STEP_SETTINGS) + CLOCK_COLUMNS)  # the step's settings and its clock per rank, in the same all-reduce
    results = bench.run_world(2, args)
    assert set(results) == set(bench.MODES)
    assert results["ddp"]["bytes_per_step"] == gradient_bytes
    assert results["dp-ddp"]["bytes_per_step"] == gradient_bytes + settings_bytes
    assert results["dp-dpddp"]["bytes_per_step"] == gradient_bytes + settings_bytes
    assert results["dp-2x"]["bytes_per_step"] == 2 * gradient_bytes + settings_bytes
    assert results["bk-ddp"]["bytes_per_step"] == gradient_bytes + settings_bytes
    assert results["bk-dpddp"]["bytes_per_step"] == gradient_bytes + settings_bytes
    assert all(r["step_s"] > 0 for r in results.values())
