"""scripts/benchmark_trainers.py: private and non-private training through the Hugging Face Trainer and
Lightning, eager and compiled, side by side."""

import pytest

from tests.script_loading import load_script

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")


def test_ratios_are_medians_of_each_rounds_ratio():
    module = load_script("benchmark_trainers.py", "benchmark_trainers")

    def round_of(ms):
        return {v: {"ms": t, "graphs": 0, "breaks": 0} for v, t in zip(module.VARIANTS, ms)}

    rounds = [round_of([10, 8, 20, 12]), round_of([10, 12, 30, 6]), round_of([20, 10, 20, 20])]
    rows = {line[:22].strip(): line[22:].split() for line in module.report(rounds).splitlines()[1:]}
    assert rows["non-private compiled"][:2] == ["10.0", "0.80"]  # median of 0.8, 1.2, 0.5
    assert rows["private"][:2] == ["20.0", "2.00"]  # median of 2, 3, 1
    assert rows["private compiled"][:3] == ["12.0", "0.60", "1.50"]  # medians of (0.6, 0.2, 1) and (1.5, 0.5, 2)


@pytest.mark.slow
@pytest.mark.parametrize("framework, model, noise", [("hf", "llama", "off"), ("lightning", "llama", "off"),
                                                     ("hf", "gpt2", "philox"), ("lightning", "gpt2", "philox")])
def test_the_compiled_private_run_is_traced(capsys, framework, model, noise):
    """The hooked layers are all traced into the graphs: privacy adds no graph break, also to
    GPT-2, whose position embedding is called on one row broadcast over the batch."""
    if framework == "lightning":
        pytest.importorskip("lightning")
    module = load_script("benchmark_trainers.py", "benchmark_trainers")
    (run,) = module.main(["--framework", framework, "--model", model, "--layers", "1", "--hidden", "32", "--length",
                          "16", "--vocab", "50", "--batch-size", "4", "--examples", "64", "--steps", "4",
                          "--warmup", "2", "--rounds", "1", "--backend", "eager", "--threads", "1", "--fast-noise", noise])
    assert set(run) == set(module.VARIANTS) and all(r["ms"] > 0 for r in run.values())
    assert run["private"]["graphs"] == run["non-private"]["graphs"] == 0
    compiled = run["private compiled"]
    assert compiled["graphs"] > 0 and compiled["breaks"] <= run["non-private compiled"]["breaks"]
    (header,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"{framework}: {model} ")]
    assert header.startswith(f"{framework}: {model} 1 layers") and header.endswith(f"noise {noise}")
