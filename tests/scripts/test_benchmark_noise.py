"""scripts/benchmark_noise.py: every noise variant is timed beside an add_ of the same size, and each
ratio is its median ÷ the add_ median."""

import json

import pytest

from tests.script_loading import load_script


def load():
    return load_script("benchmark_noise.py", "benchmark_noise")


def test_variants_are_reported_against_add(tmp_path, capsys):
    out = tmp_path / "noise.json"
    load().main(["--sizes", "4096", "--repeats", "3", "--threads", "2", "--json", str(out)])
    medians = json.loads(out.read_text())["4096"]
    for name in ("torch.normal", "philox (2 threads)", "philox noised (2 threads)", "philox fused (2 threads)",
                 "philox secure (2 threads)", "add_"):
        assert name in medians and medians[name][0] > 0
    printed = capsys.readouterr().out
    add = medians["add_"][0]
    line = next(row for row in printed.splitlines() if row.strip().startswith("philox fused"))
    assert float(line.split()[-2]) == pytest.approx(medians["philox fused (2 threads)"][0] / add, rel=0.01, abs=0.01)
    assert "native Philox kernel" in printed


def test_each_variant_draws_the_distribution():
    """The timed philox operations draw N(0, 1) (mean 0, std 1 within 5 standard errors)."""
    import torch
    ops = load().variants(1 << 16, 2)
    noise = ops["philox (2 threads)"]()
    n = noise.numel()
    assert abs(float(noise.mean())) < 5 / n ** 0.5 and abs(float(noise.std()) - 1) < 5 / (2 * n) ** 0.5
    assert isinstance(noise, torch.Tensor)
