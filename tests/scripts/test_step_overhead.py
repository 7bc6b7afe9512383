"""scripts/benchmark_step_overhead.py: the overhead is the private step's time minus the non-private
one, expressed in same-size add_ passes, with and without the noise draw."""

import pytest

from tests.script_loading import load_script


@pytest.mark.parametrize("fast_noise", [[], ["--fast-noise", "philox"]])
def test_overhead_is_reported_in_add_passes(capsys, fast_noise):
    module = load_script("benchmark_step_overhead.py", "benchmark_step_overhead")
    result = module.main(["--dim", "256", "--repeats", "3", "--warmup", "1", "--modes", "bk,hooks", *fast_noise])
    ms = result["ms"]
    assert set(ms) == {"non-private", "private bk", "private hooks", "noise", "add_"}
    for mode in ("bk", "hooks"):
        overhead = ms[f"private {mode}"] - ms["non-private"]
        assert result[mode]["overhead_ms"] == pytest.approx(overhead)
        assert result[mode]["without_noise_add"] == pytest.approx((overhead - ms["noise"]) / max(ms["add_"], 1e-9))
    assert "without the noise draw" in capsys.readouterr().out
