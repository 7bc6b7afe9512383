"""scripts/benchmark_patch_gram.py: both forms of the patch Gram timed per layer of the grid, the
cost model's pick reported, and the time its picks lose summed by hand."""

import pytest
import torch
import torch.nn as nn

from opacus_dp.grad_sample.bookkeeping.norm_samplers.conv import _prefers_autocorrelation
from tests.script_loading import load_script


def test_grid_picks_and_lost_time(monkeypatch, capsys):
    module = load_script("benchmark_patch_gram.py", "benchmark_patch_gram")
    scripted = iter([1.0, 3.0, 5.0, 2.0, 4.0, 4.2, 7.0, 1.0])  # windows, autocorrelation per layer

    monkeypatch.setattr(module, "median_ms", lambda fn, repeats, device: (fn(), next(scripted))[1])
    result = module.main(["--channels", "4,16", "--sizes", "2,8", "--kernels", "3", "--strides", "1,2",
                          "--batch-size", "2", "--repeats", "1"])
    rows = result["rows"]
    assert [(r["channels"], r["size"], r["stride"]) for r in rows] == [(4, 8, 1), (4, 8, 2), (16, 8, 1), (16, 8, 2)]
    assert {r['pick'] for r in rows} == {'windows', 'autocorrelation'}  # the grid has both
    for r in rows:  # the pick is the model's for that layer and input
        layer = nn.Conv2d(r["channels"], 64, 3, r["stride"], 1, bias=False)
        expected = _prefers_autocorrelation(layer, torch.zeros(2, r["channels"], 8, 8))
        assert r["pick"] == ("autocorrelation" if expected else "windows")
    lost = sum(r[f"{r['pick']}_ms"] - min(r["windows_ms"], r["autocorrelation_ms"]) for r in rows)
    assert result["lost_ms"] == pytest.approx(lost)
    assert len(result["slow"]) == sum(r[f"{r['pick']}_ms"] > 1.1 * min(r["windows_ms"], r["autocorrelation_ms"])
                                      for r in rows)
    assert f"lost ms (the picks against the faster form, summed over 4 layers): {lost:.2f}" in capsys.readouterr().out


def test_timed_forms_run_the_real_patch_grams():
    module = load_script("benchmark_patch_gram.py", "benchmark_patch_gram")
    result = module.main(["--channels", "8", "--sizes", "6", "--kernels", "3", "--strides", "2",
                          "--batch-size", "2", "--repeats", "1"])
    (row,) = result["rows"]
    assert row["windows_ms"] > 0 and row["autocorrelation_ms"] > 0
