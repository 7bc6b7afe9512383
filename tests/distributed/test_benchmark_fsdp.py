"""``scripts/benchmark_fsdp.py`` (``benchmark_distributed.py --fsdp``) measures what FSDP2 shards:
on 1 and 2 gloo processes, a rank's parameters, gradients and Adam state under
``make_private(..., fsdp=True, grad_sample_mode="bk")`` are its ``Shard(0)`` rows of every
tensor (half of them, dim 0 padded to an even split), under DDP the whole model on every rank;
the DP step reduce-scatters once per ``fully_shard`` module."""

import importlib
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

SCRIPTS = str(Path(__file__).resolve().parents[2] / "scripts")
ARGS = SimpleNamespace(width=16, layers=2, classes=3, batch_size=8, steps=2, warmup=1,
                       optimizer="adam", device="cpu")
MODES = ("dp-fsdp-bk", "ddp")

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def bench():
    """Imported by name from ``scripts/`` (on ``sys.path``, which spawned workers inherit), so
    that ``mp.spawn`` can pickle its worker function."""
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    return importlib.import_module("benchmark_fsdp")


@pytest.fixture(scope="module")
def results(bench):
    """``{world_size: {mode: measures}}`` on 1 and 2 processes (the modes in turn in one set of
    processes: the byte counts do not depend on it)."""
    return {w: bench.run_fsdp_world(w, ARGS, MODES, isolate=False) for w in (1, 2)}


def expected_rank_bytes(bench, world_size: int, rank: int) -> int:
    """Float32 parameter, gradient, Adam ``exp_avg`` and ``exp_avg_sq`` of this rank's rows
    (``⌈d₀/W⌉`` rows per rank, the last rank fewer), plus one scalar ``step`` per tensor."""
    total = 0
    for p in bench.make_residual_mlp(ARGS).parameters():
        chunk = math.ceil(p.shape[0] / world_size)
        rows = max(0, min(chunk, p.shape[0] - rank * chunk))
        total += 4 * 4 * rows * (p.numel() // p.shape[0]) + 4
    return total


def test_fsdp_rank_holds_its_shard_rows(bench, results):
    one, two = results[1]["dp-fsdp-bk"]["state_bytes"], results[2]["dp-fsdp-bk"]["state_bytes"]
    assert one == [expected_rank_bytes(bench, 1, 0)]
    assert two == [expected_rank_bytes(bench, 2, 0), expected_rank_bytes(bench, 2, 1)]
    num_tensors = len(list(bench.make_residual_mlp(ARGS).parameters()))
    assert sum(two) == one[0] + 4 * num_tensors  # halved, but for the scalar steps on both ranks
    assert two[0] - two[1] == 4 * 4 * (ARGS.width + 1)  # of the 3-row head, rank 0 holds 2 rows


def test_ddp_rank_holds_the_whole_model(bench, results):
    whole = expected_rank_bytes(bench, 1, 0)
    assert results[1]["ddp"]["state_bytes"] == [whole]
    assert results[2]["ddp"]["state_bytes"] == [whole, whole]


def test_one_reduce_scatter_per_fully_shard_module(results):
    """On 2 ranks one reduce-scatter per ``fully_shard`` module; one process sends nothing (its
    shard is the whole sum)."""
    for world_size in (1, 2):
        r = results[world_size]["dp-fsdp-bk"]
        assert r["fsdp_modules"] == ARGS.layers + 1
        sends = world_size > 1
        assert r["reduce_scatters_per_step"] == (r["fsdp_modules"] if sends else 0)
        assert (r["bytes_per_step"] > 0) == sends
        assert results[world_size]["ddp"]["fsdp_modules"] == 0


def test_step_times_positive_and_report_prints(bench, results, capsys):
    assert all(r["step_s"] > 0 and r["peak_bytes"] >= 0 for w in results.values() for r in w.values())
    for world_size, by_mode in results.items():
        bench.print_world(world_size, by_mode)
    bench.print_summary(results)
    out = capsys.readouterr().out
    assert "dp-fsdp-bk" in out and "W=2 / W=1" in out


def test_rank_state_bytes_without_sharding(bench):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    assert bench.rank_state_bytes(model, optimizer) == 4 * 8
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    assert bench.rank_state_bytes(model, optimizer) == 4 * 8 * 4 + 2 * 4


def test_shard_leaves_passes_every_linear_to_fully_shard(bench):
    """``--shard-leaves``: every ``Linear`` is a ``fully_shard`` module of its own, each
    reduce-scattered once per step (the blocks and the root, left without parameters of their
    own, none), and a rank still holds only its shard rows."""
    args = SimpleNamespace(**vars(ARGS), shard_leaves=True)
    result = bench.run_fsdp_world(2, args, ("dp-fsdp-bk",), isolate=False)["dp-fsdp-bk"]
    linears = sum(isinstance(m, torch.nn.Linear) for m in bench.make_residual_mlp(ARGS).modules())
    assert linears > ARGS.layers
    assert result["fsdp_modules"] == linears + ARGS.layers + 1
    assert result["reduce_scatters_per_step"] == linears
    assert result["state_bytes"] == [expected_rank_bytes(bench, 2, 0), expected_rank_bytes(bench, 2, 1)]
