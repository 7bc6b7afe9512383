"""The generic torch.func fallback against the batch-size-1 autograd oracle."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from opacus_dp.grad_sample import GradSampleModule, functorch_grad_sample

from tests.grad_sample.oracle import (
    assert_grad_samples_close,
    gsm_grad_samples,
    oracle_grad_samples,
)


class ScaledMix(nn.Module):
    """Own parameters, two tensor inputs, a keyword tensor, a non-tensor flag, two outputs."""

    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))
        self.mix = nn.Parameter(torch.randn(dim, dim))

    def forward(self, x, y, *, gate=None, squash=True):
        h = torch.tanh(x * self.scale) if squash else x * self.scale
        if gate is not None:
            h = h * gate
        return h @ self.mix + y, (y * self.scale).sum(-1)


class Wrapper(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.inner = ScaledMix(dim)

    def forward(self, x, y, gate):
        out, side = self.inner(x, y, gate=gate, squash=False)
        return out.sum(-1) + side


@settings(max_examples=15, deadline=None)
@given(
    batch=st.integers(1, 4),
    middle=st.integers(1, 3),
    batch_first=st.booleans(),
    loss_reduction=st.sampled_from(["mean", "sum"]),
)
def test_keyword_and_multi_output_module(batch, middle, batch_first, loss_reduction):
    model = Wrapper(3).double()
    shape = (batch, middle, 3) if batch_first else (middle, batch, 3)
    x, y, gate = (torch.randn(*shape, dtype=torch.double) for _ in range(3))
    batch_dim = 0 if batch_first else 1
    expected = oracle_grad_samples(model, (x, y, gate), batch_dim=batch_dim)
    actual = gsm_grad_samples(
        model, (x, y, gate), loss_reduction=loss_reduction, batch_first=batch_first
    )
    assert_grad_samples_close(actual, expected)


class Bilinear(nn.Module):
    """A parent with its own parameter AND a child with parameters called in its forward."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 3)
        self.gain = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return self.proj(x) * self.gain


@pytest.mark.parametrize("force_functorch", [False, True])
def test_parent_with_own_parameter_and_child_layer(force_functorch):
    model = nn.Sequential(Bilinear(), nn.Tanh(), nn.Linear(3, 2)).double()
    x = torch.randn(4, 3, dtype=torch.double)
    expected = oracle_grad_samples(model, (x,))
    actual = gsm_grad_samples(model, (x,), force_functorch=force_functorch)
    assert_grad_samples_close(actual, expected)


@pytest.mark.parametrize(
    "make_layer, shape",
    [
        (lambda: nn.Linear(4, 3), (5, 2, 4)),
        (lambda: nn.Embedding(6, 3, padding_idx=1), None),
        (lambda: nn.EmbeddingBag(6, 3, mode="mean"), None),
        (lambda: nn.Conv1d(2, 3, 3, padding=1), (4, 2, 6)),
        (lambda: nn.LayerNorm(4), (3, 2, 4)),
        (lambda: nn.GroupNorm(2, 4), (3, 4, 5)),
        (lambda: nn.PReLU(3), (5, 3)),
        (lambda: nn.Bilinear(3, 2, 4), None),
    ],
)
def test_force_functorch_matches_registered_samplers_and_oracle(make_layer, shape):
    layer = make_layer().double()
    if isinstance(layer, nn.Bilinear):
        args = (torch.randn(4, 3, dtype=torch.double), torch.randn(4, 2, dtype=torch.double))
    elif shape is None:
        args = (torch.randint(0, 6, (4, 3)),)
    else:
        args = (torch.randn(*shape, dtype=torch.double),)
    expected = oracle_grad_samples(layer, args)
    assert_grad_samples_close(gsm_grad_samples(layer, args, force_functorch=True), expected)
    assert_grad_samples_close(gsm_grad_samples(layer, args), expected)


def test_contract_signature_with_plain_backprops():
    layer = nn.Linear(3, 2).double()
    x = torch.randn(4, 3, dtype=torch.double)
    g = torch.randn(4, 2, dtype=torch.double)
    result = functorch_grad_sample(layer, [x], g)
    torch.testing.assert_close(result[layer.weight], torch.einsum("bo,bi->boi", g, x))
    torch.testing.assert_close(result[layer.bias], g)


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return F.dropout(x * self.w, 0.5, training=True)


def test_random_forward_is_refused_not_silently_wrong():
    gsm = GradSampleModule(nn.Sequential(Noisy()))
    with pytest.raises(ValueError, match=r"0 \(Noisy\).*random operation.*outside this module"):
        gsm(torch.randn(4, 3)).sum().backward()
    gsm.close()


class RunningScale(nn.Module):
    """Own parameter, and a buffer updated from the batch in the forward pass."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x):
        self.scale.mul_(0.9).add_(0.1 * x.detach().abs().mean(0))
        return x * self.w / self.scale


def test_buffer_written_by_a_fallback_layer_is_refused_by_name():
    gsm = GradSampleModule(nn.Sequential(RunningScale()))
    with pytest.raises(ValueError, match=r"0 \(RunningScale\).*writes in place.*buffer"):
        gsm(torch.randn(4, 3)).sum().backward()
    gsm.close()


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x, mask):
        return x * self.w * mask


def test_unbatched_tensor_argument_is_reported():
    gsm = GradSampleModule(nn.Sequential(Masked()))
    with pytest.raises(ValueError, match=r"0 \(Masked\).*argument #1 has shape \(3,\)"):
        gsm._module[0](torch.randn(4, 3), torch.ones(3))
    gsm.close()


class SequenceWithLast(nn.Module):
    """Returns its output, a view of it, the same tensor again, and a non-tensor."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3))
        self.v = nn.Parameter(torch.randn(3))

    def forward(self, x):  # (B, T, 3)
        out = torch.tanh(x @ self.w)
        return out, out[:, -1], (out * self.v).sum((1, 2)), out, "done"


class UsesAllOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.seq = SequenceWithLast()

    def forward(self, x):
        out, last, score, again, _ = self.seq(x)
        return out.sum(1) + 2.0 * last + score.unsqueeze(-1) - again[:, 0]


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_outputs_derived_from_other_outputs_are_not_double_counted(loss_reduction):
    model = UsesAllOutputs().double()
    x = torch.randn(4, 5, 3, dtype=torch.double)
    expected = oracle_grad_samples(model, (x,))
    assert_grad_samples_close(gsm_grad_samples(model, (x,), loss_reduction=loss_reduction), expected)


class CustomLinear(nn.Module):
    """A layer without a registered sampler (the torch.func fallback), a matrix product."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d_out, d_in) * 0.3)

    def forward(self, x):
        return F.linear(x, self.w)


def test_fallback_recomputes_under_the_forward_passes_autocast():
    """A forward under ``torch.autocast`` (bfloat16 products): the fallback's recomputation runs
    under the same autocast (otherwise a bfloat16 input meets a float32 weight and fails), and
    each per-sample gradient equals the per-sample autograd oracle run under the same autocast,
    to bfloat16's rounding (2⁻⁸ relative, so 2e-2 of the gradient's largest entry)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), CustomLinear(8, 3))
    x = torch.randn(6, 5)
    gsm = GradSampleModule(model, loss_reduction="sum")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gsm(x)
    out.float().pow(2).sum().backward()
    got = model[2].w.grad_sample
    rows = []
    for i in range(len(x)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out_i = model(x[i:i + 1])
        rows.append(torch.autograd.grad(out_i.float().pow(2).sum(), model[2].w)[0])
    expected = torch.stack(rows)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
    gsm.close()


class LearnedOffset(nn.Module):
    """Called without inputs: returns its parameter (a learned tensor added to the batch)."""

    def __init__(self):
        super().__init__()
        self.offset = nn.Parameter(torch.randn(5, 3))

    def forward(self):
        return self.offset


def test_fallback_layer_called_without_tensor_inputs_is_refused():
    """Its output does not come from the samples: the fallback would take the output's first
    dimension (5 here, with a batch of 4) for the batch and clip rows of the parameter."""
    torch.manual_seed(0)
    offset, head = LearnedOffset(), nn.Linear(3, 2)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.offset, self.head = offset, head

        def forward(self, x):
            return self.head(x + self.offset().sum(0))

    gsm = GradSampleModule(Model())
    with pytest.raises(ValueError, match=r"offset \(LearnedOffset\).*without tensor arguments"):
        gsm(torch.randn(4, 3))
    gsm.close()


class CellLoop(nn.Module):
    """A torch recurrent cell unrolled by hand, its state left to the cell at the first step."""

    def __init__(self, cell, state_as_keyword):
        super().__init__()
        self.cell, self.state_as_keyword = cell, state_as_keyword
        self.head = nn.Linear(cell.hidden_size, 2)

    def forward(self, x):
        state = None
        for t in range(x.shape[1]):
            state = self.cell(x[:, t], hx=state) if self.state_as_keyword else self.cell(x[:, t], state)
        hidden = state[0] if isinstance(state, tuple) else state
        return self.head(hidden)


@pytest.mark.parametrize("make_cell", [nn.RNNCell, nn.GRUCell, nn.LSTMCell])
@pytest.mark.parametrize("state_as_keyword", [False, True])
def test_torch_cells_started_without_a_state(make_cell, state_as_keyword):
    model = CellLoop(make_cell(3, 4), state_as_keyword).double()
    x = torch.randn(5, 3, 3, dtype=torch.double)
    expected = oracle_grad_samples(model, (x,))
    assert_grad_samples_close(gsm_grad_samples(model, (x,)), expected)
