"""Wrapping, unwrapping and the autograd side effects of the norms-only wrapper."""

import pytest
import torch
import torch.nn as nn

from opacus_dp.grad_sample import BookkeepingGradSampleModule, GradSampleModule
from opacus_dp.grad_sample.mode_selection import choose_mode, wrap_norms_only
from tests.ghost.helpers import assert_norms_and_sums, model_oracle, run_backward


def convnet():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(inplace=True), nn.Flatten(),
                         nn.Linear(12, 4), nn.ReLU(inplace=True), nn.Linear(4, 2)).double()


def hook_counts(module):
    return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in module.modules()]


def test_close_restores_the_module_exactly():
    model = convnet()
    model[3].bias.requires_grad_(False)
    flags = [p.requires_grad for p in model.parameters()]
    hooks = hook_counts(model)
    wrapper = BookkeepingGradSampleModule(model)
    run_backward(wrapper, (torch.randn(2, 2, 4, 4, dtype=torch.float64),), "mean", 2)
    wrapper.close()
    assert hook_counts(model) == hooks
    assert [p.requires_grad for p in model.parameters()] == flags
    assert not any("grad_sample" in p.__dict__ for p in model.parameters())
    GradSampleModule(model).close()  # the layers can be wrapped again


def test_weight_gradients_are_skipped_and_inputs_still_get_theirs():
    """No autograd weight gradient (p.grad stays None), even for the first layer and with
    ReLU(inplace=True) after it; the gradient w.r.t. a differentiable input is unchanged."""
    model = convnet()
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    x_leaf = x.clone().requires_grad_(True)
    model(x_leaf).pow(2).sum().backward()
    expected_input_grad, oracle = x_leaf.grad.clone(), model_oracle(model, (x,))
    model.zero_grad(set_to_none=True)
    wrapper = BookkeepingGradSampleModule(model)
    out = wrapper(x)
    assert all(p.requires_grad for p in model.parameters()), "flags restored after forward"
    (0.5 * out.pow(2) + 0.3 * out).sum().div(3).backward()
    assert all(p.grad is None for p in model.parameters())
    assert_norms_and_sums(wrapper, oracle)
    wrapper.zero_grad()
    x_leaf = x.clone().requires_grad_(True)
    wrapper(x_leaf).pow(2).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    torch.testing.assert_close(x_leaf.grad, expected_input_grad)


def test_disabled_hooks_and_no_grad_leave_autograd_alone():
    model = convnet()
    wrapper = BookkeepingGradSampleModule(model)
    x = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    with torch.no_grad():
        wrapper(x)
    wrapper.disable_hooks()
    wrapper(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(RuntimeError, match="no per-sample gradients"):
        wrapper.per_sample_norms([p for p in model.parameters()])


def test_keeping_weight_gradients_gives_the_same_norms():
    model = convnet()
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    oracle = model_oracle(model, (x,))
    wrapper = BookkeepingGradSampleModule(model, skip_weight_grads=False)
    run_backward(wrapper, (x,), "mean", 3)
    assert all(p.grad is not None for p in model.parameters())
    assert_norms_and_sums(wrapper, oracle)


def test_a_failing_forward_restores_requires_grad():
    model = convnet()
    wrapper = BookkeepingGradSampleModule(model)
    with pytest.raises(RuntimeError):
        wrapper(torch.randn(2, 2, 4, 4, dtype=torch.float64).requires_grad_(True)[:, :1])
    assert all(p.requires_grad for p in model.parameters())


def test_empty_batch_gives_zero_rows_and_no_sums():
    model = convnet()
    wrapper = BookkeepingGradSampleModule(model, loss_reduction="sum")
    run_backward(wrapper, (torch.zeros(0, 2, 4, 4, dtype=torch.float64),), "sum", 0)
    params = [p for p in model.parameters()]
    assert all(n.shape == (0,) for n in wrapper.per_sample_norms(params))


def test_forbidden_accumulation_raises_and_non_finite_norms_reach_the_optimizer():
    model = convnet()
    wrapper = BookkeepingGradSampleModule(model, loss_reduction="sum")
    wrapper.forbid_grad_accumulation()
    x = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    run_backward(wrapper, (x,), "sum", 2)
    with pytest.raises(ValueError, match="second batch"):
        run_backward(wrapper, (x,), "sum", 2)
    wrapper.zero_grad()
    x[0, 0, 0, 0] = float("nan")
    run_backward(wrapper, (x,), "sum", 2)
    norms = wrapper.per_sample_norms([p for p in model.parameters()])
    assert not bool(torch.isfinite(norms[0][0])) and bool(torch.isfinite(norms[0][1]))  # the optimizer drops sample 0


def test_inconsistent_batch_sizes_are_refused():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x, y):
            return self.a(x).sum() + self.b(y).sum()

    wrapper = BookkeepingGradSampleModule(TwoInputs())
    with pytest.raises(ValueError, match="Inconsistent batch sizes"):
        wrapper(torch.randn(3, 2), torch.randn(4, 2)).backward()


def test_data_parallel_is_refused_and_auto_falls_back_to_hooks():
    model = nn.DataParallel(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="DataParallel.*hooks"):
        BookkeepingGradSampleModule(model)
    assert choose_mode(model) == "hooks" and choose_mode(nn.Linear(2, 2)) == "bk"
    wrapped = wrap_norms_only(model, "auto", batch_first=True, loss_reduction="mean")
    assert type(wrapped) is GradSampleModule
    wrapped.close()


def test_recorded_inputs_are_released_after_resolution_and_a_second_backward_is_refused():
    """A resolved call drops its inputs at once (they no longer outlive the backward pass);
    a second backward pass through the same graph then raises instead of reading them."""
    wrapper = BookkeepingGradSampleModule(convnet())
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    captured = []
    original = wrapper._bookkeeper.record

    def record(layer, name, call, *args):
        captured.append(call)
        original(layer, name, call, *args)

    wrapper._bookkeeper.record = record
    loss = wrapper(x).pow(2).sum()
    loss.backward(retain_graph=True)
    assert captured and all(call.released and call.args == () for call in captured)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()
