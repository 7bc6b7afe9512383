"""scripts/benchmark_step_overhead.py: the overhead is the private step's time minus the non-private
one, expressed in same-size add_ passes, with and without the noise draw."""

import pytest

from tests.script_loading import load_script


@pytest.mark.parametrize("options", [[], ["--fast-noise", "philox"], ["--fast-noise", "philox", "--api", "classic"],
                                     ["--fast-noise", "threads", "--timer", "wall"]])
def test_overhead_is_reported_in_add_passes(capsys, options):
    module = load_script("benchmark_step_overhead.py", "benchmark_step_overhead")
    result = module.main(["--dim", "256", "--repeats", "3", "--warmup", "1", "--modes", "bk,hooks", *options])
    ms = result["ms"]
    assert set(ms) == {"non-private", "private bk", "private hooks", "noise", "add_"}
    for mode in ("bk", "hooks"):
        overhead = ms[f"private {mode}"] - ms["non-private"]
        assert result[mode]["overhead_ms"] == pytest.approx(overhead)
        assert result[mode]["without_noise_add"] == pytest.approx((overhead - ms["noise"]) / max(ms["add_"], 1e-9))
    assert "without the noise draw" in capsys.readouterr().out


@pytest.mark.parametrize("api", ["modern", "classic"])
def test_private_steps_add_the_noise_of_sigma_one(api):
    """The private variants are private steps: the update of one step divided by the learning
    rate is the clipped mean (norm ≤ C/B = 0.5 in all) plus N(0, (σC/B)²) = N(0, 0.25) per
    coordinate: its standard deviation over 64² coordinates is 0.5 within 5 % (the estimate's
    own error is about 1 %)."""
    module = load_script("benchmark_step_overhead.py", "benchmark_step_overhead")
    step = module.build("bk", 64, "mean", "philox", api)
    before = step.weight.detach().clone()
    step()
    update = (before - step.weight.detach()) / 1e-3
    assert float(update.std()) == pytest.approx(0.5, rel=0.05)
