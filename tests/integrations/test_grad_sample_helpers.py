"""``opacus.tests.grad_samples.common`` equivalents: the micro-batch comparison that third-party
grad-sampler tests subclass, checked against an autograd loop written here."""

import pytest
import torch
import torch.nn as nn

from opacus_dp.testing.grad_samples.common import (GradSampleHooks_test,
                                                   compute_grad_samples_microbatch_and_opacus)


def _autograd_loop(x, module, reduction):
    """Per-sample gradients of ``L1Loss(module(x_i), 0)``, one sample at a time (reduction over
    the sample's own output, as a batch of one)."""
    rows = {name: [] for name, p in module.named_parameters() if p.requires_grad}
    for x_i in x:
        module.zero_grad()
        out = module(x_i.unsqueeze(0))
        nn.L1Loss(reduction=reduction)(out, torch.zeros_like(out)).backward()
        for name, p in module.named_parameters():
            rows[name].append(p.grad.detach().clone())
    return {name: torch.stack(r) for name, r in rows.items()}


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_microbatch_and_library_gradients_match_an_autograd_loop(reduction):
    x = torch.randn(5, 3, 4)
    module = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    micro, lib = compute_grad_samples_microbatch_and_opacus(x, module, loss_reduction=reduction)
    expected = _autograd_loop(x, module, reduction)
    assert micro.keys() == lib.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(micro[name], expected[name])
        # loss_reduction="mean" tells the library to undo the batch mean's 1/B per sample
        torch.testing.assert_close(lib[name], expected[name], atol=1e-6, rtol=1e-5)


class _Subclass(GradSampleHooks_test):
    def runTest(self):  # unittest needs a test method to build the case
        pass


def test_subclass_run_test_passes_for_supported_layers():
    case = _Subclass()
    case.run_test(torch.randn(4, 3, 5), nn.Linear(5, 2))
    case.run_test(torch.randn(3, 2, 6, 6), nn.Conv2d(2, 3, 3), ew_compatible=False)
    case.run_test(torch.randn(5, 4, 3), nn.Linear(3, 2), batch_first=False)
    case.run_test(torch.randn(0, 3), nn.Linear(3, 2))  # an empty batch only runs the library


def test_check_values_and_shapes_report_every_mismatch():
    case = _Subclass()
    good = {"w": torch.ones(2, 3), "b": torch.ones(2)}
    case.check_values(good, {k: v.clone() for k, v in good.items()}, "mean", 1e-6, 1e-5)
    with pytest.raises(AssertionError, match=r"(?s)1 values do not match.*Param w"):
        case.check_values(good, {"w": 2 * good["w"], "b": good["b"]}, "mean", 1e-6, 1e-5)
    with pytest.raises(AssertionError, match=r"2 shapes do not match"):
        case.check_shapes(good, {"w": torch.ones(3, 3), "b": torch.ones(1)}, "sum")


def test_packed_sequences_are_refused_by_name():
    seq = nn.utils.rnn.pack_sequence([torch.randn(3, 2), torch.randn(2, 2)])
    with pytest.raises(NotImplementedError, match="x.*PackedSequence"):
        compute_grad_samples_microbatch_and_opacus(seq, nn.LSTM(2, 2))
