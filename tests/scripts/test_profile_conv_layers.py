"""scripts/profile_conv_layers.py: every convolution of the model, the rule ``bk`` applies to it,
and the floor computed from the rows it printed."""

import pytest
import torch
import torch.nn as nn

from opacus_dp.grad_sample.bookkeeping.norm_samplers.conv import conv_prefers_ghost
from tests.script_loading import load_script


def load():
    return load_script("profile_conv_layers.py", "profile_conv_layers")


def test_rows_follow_bk_rules_and_the_floor_adds_them_up(capsys):
    script = load()
    result = script.main(["--model", "convnet", "--repeats", "1", "--batch-size", "4"])
    calls = script.recorded_calls(script.WORKLOADS["convnet"].build(None), script.WORKLOADS["convnet"].batch()[0][:4])
    assert [row["layer"] for row in result["layers"]] == [name for name, *_ in calls]
    assert len(calls) == sum(isinstance(m, nn.Conv2d) for m in script.WORKLOADS["convnet"].build(None).modules())
    for row, (_, layer, x, gy) in zip(result["layers"], calls):
        assert row["rule"] == ("ghost" if conv_prefers_ghost(layer, [x]) else "materialised")
        assert gy.shape[0] == x.shape[0] == 4 and row["weight_grad_ms"] > 0 and row["bk_ms"] > 0
    assert result["extra_ms"] == pytest.approx(sum(r["bk_ms"] - r["weight_grad_ms"] for r in result["layers"]))
    expected = (result["non_private_ms"] + result["extra_ms"] + result["fixed_ms"]) / result["non_private_ms"]
    assert result["floor"] == pytest.approx(expected)
    assert f"floor {result['floor']:.2f}" in capsys.readouterr().out


def test_recorded_calls_hold_each_layers_input_and_output_gradient():
    script = load()
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 1, 1))
    x = torch.randn(2, 2, 5, 5)
    calls = script.recorded_calls(model, x)
    assert [name for name, *_ in calls] == ["0", "2"]
    first, second = calls[0][1:], calls[1][1:]
    torch.testing.assert_close(first[1], x)
    torch.testing.assert_close(second[1], torch.relu(model[0](x)).detach())
    torch.testing.assert_close(second[2], torch.ones(2, 1, 5, 5))  # of the summed output
    assert first[2].shape == (2, 3, 5, 5) and first[2].abs().sum() > 0
