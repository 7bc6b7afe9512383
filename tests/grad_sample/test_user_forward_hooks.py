"""A user's forward hook that changes a layer's output does not change its per-sample gradients.

The per-sample gradient of a layer's parameters is that of the layer's own output; a hook the user
registered before the model was made private (scaling, adding, casting the output) is part of the
rest of the network. The wrapper's capture hook therefore runs before the user's hooks: recorded
after a hook that doubles the output, the output gradient would be that of the doubled output and
every per-sample gradient (and norm) half the true one — the sample's contribution left unclipped
up to twice the bound. Checked in every mode against the batch-size-1 autograd oracle.
"""

import pytest
import torch
import torch.nn as nn

from opacus_dp.grad_sample import BookkeepingGradSampleModule, GradSampleModule
from opacus_dp.layers import DPLSTM
from tests.ghost.helpers import assert_norms_and_sums, model_oracle, run_backward
from tests.grad_sample.oracle import default_loss

HOOKS = {
    "doubled": lambda module, args, out: out * 2,
    "shifted": lambda module, args, out: out + 1.5,
    "squared": lambda module, args, out: out * out,
}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(3, 5)
        self.second = nn.Linear(5, 2)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = DPLSTM(3, 4, batch_first=True)

    def forward(self, x):
        return self.lstm(x)[0].sum(dim=1)


def _model(cls, hook):
    torch.manual_seed(0)
    model = cls().double()
    for layer in (m for m in model.modules() if isinstance(m, nn.Linear)):
        layer.register_forward_hook(HOOKS[hook])
    return model


@pytest.mark.parametrize("hook", sorted(HOOKS))
@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_per_sample_gradients_are_the_layers_own(mode, hook):
    model = _model(Net, hook)
    x = torch.randn(4, 6, 3, dtype=torch.float64)
    oracle = model_oracle(model, (x,))
    wrapper = GradSampleModule(model, force_functorch=mode == "functorch", loss_reduction="sum")
    default_loss(wrapper(x)).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_sample, oracle[name], rtol=1e-9, atol=1e-10,
                                   msg=lambda m: f"{name}: {m}")
    wrapper.close()


@pytest.mark.parametrize("hook", sorted(HOOKS))
@pytest.mark.parametrize("rule", ["mixed", "ghost"])
@pytest.mark.parametrize("cls", [Net, Recurrent])
def test_norms_and_clipped_sums_are_the_layers_own(cls, rule, hook):
    model = _model(cls, hook)
    x = torch.randn(4, 6, 3, dtype=torch.float64)
    oracle = model_oracle(model, (x,))
    wrapper = BookkeepingGradSampleModule(model, layer_rule=rule)
    run_backward(wrapper, (x,), "mean", 4)
    assert_norms_and_sums(wrapper, oracle)
    wrapper.close()


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_a_compiled_private_model_records_the_layers_own_output(mode):
    """Compiled, the calls are tapped right after the layer's forward, before the user's hooks, as
    eagerly (the first forward learns the calls; the second runs the graph)."""
    model = _model(Net, "doubled")
    x = torch.randn(4, 6, 3, dtype=torch.float64)
    oracle = model_oracle(model, (x,))
    if mode == "hooks":
        wrapper = GradSampleModule(model, loss_reduction="sum")
    else:
        wrapper = BookkeepingGradSampleModule(model, loss_reduction="sum")
    wrapper.compile(backend="eager")
    for _ in range(2):
        wrapper.zero_grad_sample()
        model.zero_grad(set_to_none=True)
        default_loss(wrapper(x)).backward()
    if mode == "bk":
        assert_norms_and_sums(wrapper, oracle)
    else:
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad_sample, oracle[name], rtol=1e-9, atol=1e-10)
    wrapper.close()
