"""scripts/benchmark_layer_overhead.py: each phase of each mode timed per layer, the private variants
being ``make_private``'s model and optimizer in the named mode."""

import pytest

from tests.script_loading import load_script


def test_phases_per_layer_and_the_difference_printed(capsys):
    module = load_script("benchmark_layer_overhead.py", "benchmark_layer_overhead")
    rows = module.main(["--layers", "3", "--modes", "bk,hooks", "--steps", "2", "--warmup", "1"])
    assert set(rows) == {"non-private", "bk", "hooks"}
    assert all(set(row) == set(module.PHASES) and all(v >= 0 for v in row.values()) for row in rows.values())
    printed = capsys.readouterr().out
    line = next(line for line in printed.splitlines() if line.startswith("bk "))
    above = sum(rows["bk"].values()) - sum(rows["non-private"].values())
    assert float(line.split()[-1]) == pytest.approx(above, abs=0.06)


def test_each_mode_steps_a_private_model_of_that_mode():
    """The private variants are ``make_private``'s model and DP optimizer (σ = 1, C = 1) in the
    named mode (``bk``: the norms-only wrapper), the non-private one a plain model and SGD."""
    from opacus_dp.grad_sample import GradSampleModule
    from opacus_dp.grad_sample.bookkeeping.module import BookkeepingGradSampleModule
    from opacus_dp.optim import DPOptimizer

    module = load_script("benchmark_layer_overhead.py", "benchmark_layer_overhead")
    plain, bk, hooks = (module.build(mode, 2, 4, 2) for mode in (None, "bk", "hooks"))
    assert not isinstance(plain.model, GradSampleModule) and not isinstance(plain.optimizer, DPOptimizer)
    assert isinstance(bk.model, BookkeepingGradSampleModule)
    assert isinstance(hooks.model, GradSampleModule) and not isinstance(hooks.model, BookkeepingGradSampleModule)
    for private in (bk, hooks):
        assert isinstance(private.optimizer, DPOptimizer)
        assert private.optimizer.noise_multiplier == 1.0 and private.optimizer.max_grad_norm == 1.0
        private()
        assert all(len(private.times[phase]) == 1 for phase in module.PHASES)
