"""A recurrent cell's input projection and step projection hold one output gradient between them.

``ih``'s output gradient ``G (B, T, 4H)`` holds, at position ``t``, the numbers of ``hh``'s output
gradient at step ``t``; the book-keeping keeps ``G`` once (``hh``'s calls view it, ``ih`` goes
ghost) after checking every step value for value. The norms and clipped sums must still be the
autograd oracle's, the kept tensors must share ``G``'s memory where the cell declares the pair,
and anything that breaks the equality must leave the calls as recorded.
"""

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils._python_dispatch import TorchDispatchMode

from opacus_dp.grad_sample import BookkeepingGradSampleModule
from opacus_dp.grad_sample.bookkeeping.passes import Call
from opacus_dp.grad_sample.bookkeeping import step_gradients
from opacus_dp.grad_sample.bookkeeping.step_gradients import share_step_gradients, step_projections
from opacus_dp.layers import DPGRU, DPLSTM, DPRNN
from opacus_dp.maths.views import joined
from tests.ghost.helpers import assert_norms_and_sums, model_oracle, per_step, run_backward

RULES = ["mixed", "ghost"]


class Recurrent(nn.Module):
    """A recurrent layer over (B, T, F) inputs of per-sample lengths, summed outputs."""

    def __init__(self, layer):
        super().__init__()
        self.rnn = layer

    def forward(self, x, lengths):
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        return pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])[0].sum(dim=1)


# Sizes where, over T = 7 steps, both projections take the ghost path once the gradient is shared
# (2 T² < d p); the LSTM's input projection (4 -> 32) and step projection (8 -> 32) would each
# materialise keeping their own gradient (d p <= T (d + p)).
LAYERS = {
    "lstm": lambda: DPLSTM(4, 8, batch_first=True),
    "lstm-two-layers-bidirectional": lambda: DPLSTM(4, 8, num_layers=2, bidirectional=True, batch_first=True),
    "lstm-proj": lambda: DPLSTM(4, 8, proj_size=4, batch_first=True),
    "rnn-tanh-bidirectional": lambda: DPRNN(16, 16, bidirectional=True, batch_first=True),
    "rnn-relu": lambda: DPRNN(16, 16, nonlinearity="relu", batch_first=True),
}


def _wrapped(make_layer, rule, lengths=(7, 3, 5, 1), step_layers=True, joined=True):
    """``joined=False``: the steps call ``hh`` (hooked per step), whose calls are then shared
    here; by default the wrapper records them as one call (test_joined_step_calls)."""
    torch.manual_seed(0)
    model = Recurrent(make_layer()).double()
    x = torch.randn(len(lengths), 7, model.rnn.input_size, dtype=torch.float64)
    inputs = (x, torch.tensor(lengths))
    oracle = model_oracle(model, inputs)
    wrapper = BookkeepingGradSampleModule(model, layer_rule=rule)
    if not step_layers:
        wrapper._bookkeeper.step_layers = {}
    if not joined:
        per_step(model)
    run_backward(wrapper, inputs, "mean", len(lengths))
    return model, wrapper, oracle


def _kept(wrapper):
    (finished,) = wrapper._bookkeeper._resolved
    return {layer: backprops for layer, _, backprops, _ in finished.ghost_calls}


def _cells(model):
    return [m for m in model.modules() if hasattr(m, "ih") and hasattr(m, "hh")]


@pytest.mark.parametrize("joined", [True, False], ids=["joined", "per-step"])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_shared_gate_gradients_give_the_oracle_norms_and_sums(name, rule, joined, comparison):
    model, wrapper, oracle = _wrapped(LAYERS[name], rule, joined=joined)
    kept = _kept(wrapper)
    for cell in _cells(model):
        g = kept[cell.ih]
        assert kept[cell.hh].data_ptr() == g.data_ptr() and kept[cell.hh].shape == g.shape, \
            "the step projection's merged output gradient is the input projection's, not a copy"
    assert {mode for n, mode in wrapper.layer_modes().items() if ".ih " in n} == {"ghost"}
    assert_norms_and_sums(wrapper, oracle)


@pytest.mark.parametrize("joined", [True, False], ids=["joined", "per-step"])
@pytest.mark.parametrize("name", ["lstm", "lstm-two-layers-bidirectional"])
def test_the_step_projection_takes_the_gradient_products_of_the_input_projection(name, joined):
    """``G_i G_iᵀ`` is formed once per cell: the step projection takes the input projection's
    (counted as taken products; the bidirectional layers' input projections also share ``X``'s)."""
    taken = []
    for step_layers in (True, False):
        model, wrapper, oracle = _wrapped(LAYERS[name], "ghost", step_layers=step_layers, joined=joined)
        taken.append(wrapper._bookkeeper._input_grams.taken)
        assert_norms_and_sums(wrapper, oracle)
    assert taken[0] - taken[1] == len(_cells(model))


def test_a_lifted_copy_of_the_gradient_keeps_no_products(monkeypatch):
    """Under bfloat16 autocast the norms are formed from float32 copies of the output gradients: the
    products of the input projection's copy are not kept (they would hold the copy until the end
    of the pass, and the step projection's own copy could not take them)."""
    from opacus_dp.grad_sample.bookkeeping import shared_input_grams as shared

    kept = []
    entry = shared._Entry
    monkeypatch.setattr(shared, "_Entry", lambda source, *rest: kept.append(source) or entry(source, *rest))
    torch.manual_seed(0)
    model = Recurrent(DPLSTM(4, 8, batch_first=True))
    inputs = (torch.randn(4, 7, 4), torch.tensor([7, 3, 5, 1]))
    wrapper = BookkeepingGradSampleModule(model, layer_rule="ghost")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = wrapper(*inputs)
    out.float().sum().backward()
    assert wrapper._bookkeeper._input_grams.taken == 0 and kept == []
    assert set(wrapper.layer_modes().values()) == {"ghost"}


def test_without_the_pair_each_projection_keeps_its_own_gradient():
    """The same LSTM without the declared pair (the earlier behaviour): each projection's own
    ``(A, G)`` would cost more than its per-sample gradients, so both materialise."""
    model, wrapper, oracle = _wrapped(LAYERS["lstm"], "mixed", step_layers=False)
    assert set(wrapper.layer_modes().values()) == {"materialised"}
    assert_norms_and_sums(wrapper, oracle)


@pytest.mark.parametrize("rule", RULES)
def test_gru_declares_no_pair_and_keeps_its_own_gradients(rule):
    """The GRU's candidate gate multiplies ``hh``'s output by the reset gate: no shared gradient."""
    model, wrapper, oracle = _wrapped(lambda: DPGRU(3, 8, batch_first=True), rule)
    assert step_projections(model) == {}
    kept = _kept(wrapper)
    (cell,) = _cells(model)
    if cell.ih in kept:
        assert kept[cell.ih].data_ptr() != kept[cell.hh].data_ptr()
    assert_norms_and_sums(wrapper, oracle)


def test_declared_pairs_of_a_model():
    lstm, gru = DPLSTM(3, 4, num_layers=2), DPGRU(3, 4)
    links = step_projections(nn.ModuleList([lstm, gru]))
    assert links == {lstm.l0.ih: lstm.l0.hh, lstm.l1.ih: lstm.l1.hh}


# ---------------------------------------------------------------- share_step_gradients itself


class _Released:
    released = False


def _call(backprops, scale=4.0):
    return Call(layer=None, name="layer", call=_Released(), backprops=[backprops], scale=scale)


def _steps(g, times):
    return [_call(g[:, t].clone()) for t in times]


@pytest.fixture(params=["per step", "one read"])
def comparison(request, monkeypatch):
    """Both ways of comparing the steps: one ``torch.equal`` each (CPU), or all at once with one
    read of the result (other devices; forced here on CPU)."""
    if request.param == "one read":
        monkeypatch.setattr(step_gradients, "EARLY_EXIT_DEVICES", ())
    return request.param


class _DeviceReads(TorchDispatchMode):
    """Counts the reads of a tensor's value by the host (a synchronisation on a GPU)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recorded", ["last step first", "first step first"])
def test_steps_become_views_of_the_whole_gradient_in_time_order(recorded, comparison):
    g = torch.randn(3, 5, 4)
    times = [4, 3, 2, 1, 0] if recorded == "last step first" else [0, 1, 2, 3, 4]
    steps = _steps(g, times)
    with _DeviceReads() as reads:
        assert share_step_gradients(_call(g), steps, steps_pending=0)
    if comparison == "one read":  # one read per order of the steps tried
        assert reads.count == (1 if recorded == "last step first" else 2)
    else:
        assert reads.count >= len(times)
    for t, c in enumerate(steps):
        (b,) = c.backprops
        assert b.data_ptr() == g[:, t].data_ptr() and torch.equal(b, g[:, t])
    merged = joined([c.backprops[0].unsqueeze(1) for c in steps], dim=1)
    assert merged.data_ptr() == g.data_ptr() and torch.equal(merged, g)


@pytest.mark.parametrize("spoil", ["one value", "a NaN on both sides", "steps still pending", "one step missing",
                                   "other scale", "other dtype", "swapped steps"])
def test_any_mismatch_leaves_the_recorded_calls(spoil, comparison):
    g = torch.randn(3, 5, 4, dtype=torch.float64)
    steps = _steps(g, [4, 3, 2, 1, 0])
    pending = 0
    if spoil == "one value":
        steps[2].backprops[0][1, 3] += 1e-12
    elif spoil == "a NaN on both sides":  # NaN equals nothing, as torch.equal has it
        g[1, 2, 0] = steps[2].backprops[0][1, 0] = float("nan")
    elif spoil == "steps still pending":
        pending = 1
    elif spoil == "one step missing":
        steps.pop()
    elif spoil == "other scale":
        steps[0].scale = 2.0
    elif spoil == "other dtype":
        steps[0].backprops = [steps[0].backprops[0].float()]
    else:
        steps[1], steps[2] = steps[2], steps[1]
    before = [(id(c), c.backprops[0]) for c in steps]
    assert not share_step_gradients(_call(g), steps, steps_pending=pending)
    assert [(id(c), c.backprops[0]) for c in steps] == before


# ---------------------------------------------------------------- joined


def test_consecutive_slices_join_as_a_view():
    x = torch.randn(2, 6, 3)
    parts = [x[:, 0:1], x[:, 1:4], x[:, 4:6]]
    out = joined(parts, dim=1)
    assert out.data_ptr() == x.data_ptr() and torch.equal(out, x)
    assert torch.equal(joined(parts, dim=-2), x)


@pytest.mark.parametrize("case", ["out of order", "a gap", "separate tensors", "other strides", "one part"])
def test_anything_else_is_concatenated(case):
    x = torch.randn(2, 6, 3)
    parts = {"out of order": [x[:, 2:4], x[:, 0:2]], "a gap": [x[:, 0:2], x[:, 3:5]],
             "separate tensors": [x[:, 0:2].clone(), x[:, 2:4].clone()],
             "other strides": [x[:, 0:2], x.transpose(0, 1).contiguous().transpose(0, 1)[:, 2:4]],
             "one part": [x[:, 1:3]]}[case]
    out = joined(parts, dim=1)
    assert torch.equal(out, torch.cat(parts, dim=1))
    assert all(out.data_ptr() != p.data_ptr() for p in parts)
