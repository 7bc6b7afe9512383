"""scripts/benchmark_row_blocks.py: every candidate floor is timed on the same inputs, with the row
blocks that floor gives, and the released floor is back in place afterwards."""

import pytest

from opacus_dp.grad_sample.bookkeeping.norm_samplers import linear
from tests.script_loading import load_script


def test_each_floor_is_timed_with_its_own_blocks(capsys):
    module = load_script("benchmark_row_blocks.py", "benchmark_row_blocks")
    released = linear.MIN_BLOCK_ROWS
    result = module.main(["--shapes", "2,130,8,12;1,300,4,4", "--repeats", "2", "--warmup", "0",
                          "--models", "lstm"])
    assert linear.MIN_BLOCK_ROWS == released
    first, second = result["layers"]
    assert first["blocks"] == {128: 1, 64: 2, 32: 4} and second["blocks"] == {128: 2, 64: 4, 32: 8}
    assert all(ms > 0 for row in result["layers"] for ms in row["ms"].values())
    (model,) = result["models"]
    assert model["model"] == "lstm" and set(model["ratio"]) == set(module.FLOORS)
    assert all(ratio > 0 for ratio in model["ratio"].values())
    assert "bk x np, 64 rows" in capsys.readouterr().out


def test_a_floor_is_set_only_for_its_block():
    module = load_script("benchmark_row_blocks.py", "benchmark_row_blocks")
    released = linear.MIN_BLOCK_ROWS
    with pytest.raises(RuntimeError):
        with module.block_rows(32):
            assert linear.row_blocks(64) == 2
            raise RuntimeError("inside")
    assert linear.MIN_BLOCK_ROWS == released


def test_bad_shapes_and_models_off_cpu_are_refused():
    module = load_script("benchmark_row_blocks.py", "benchmark_row_blocks")
    with pytest.raises(SystemExit):
        module.main(["--shapes", "2,130,8"])
    with pytest.raises(SystemExit):
        module.main(["--device", "cuda", "--models", "lstm"])


def test_the_floor_of_other_devices_is_the_one_set_for_them():
    module = load_script("benchmark_row_blocks.py", "benchmark_row_blocks")
    cpu, elsewhere = linear.MIN_BLOCK_ROWS, linear.MIN_BLOCK_ROWS_ELSEWHERE
    with module.block_rows(32, "cuda"):
        assert linear.row_blocks(64, "cuda") == 2 and linear.row_blocks(64) == 1
    assert (linear.MIN_BLOCK_ROWS, linear.MIN_BLOCK_ROWS_ELSEWHERE) == (cpu, elsewhere)
