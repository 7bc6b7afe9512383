"""The step projection of DPLSTM/DPRNN recorded as one call per run (``bk``, ``ghost``).

The norms and clipped sums must be the autograd oracle's with the joined call and with the
per-step calls it replaces; the joined call must be used where it is equivalent (one capture of
``hh`` per run, not one per step) and must leave the per-step calls wherever it might not be: a
user's hook on ``hh``, a global module hook, hooks disabled (ordinary gradients), no grad, a frozen
projection, a wrapper that keeps autograd's weight gradients or has been closed.
"""

import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp.grad_sample import BookkeepingGradSampleModule, GradSampleModule
from opacus_dp.grad_sample.bookkeeping.module import BookkeepingGradSampleModule as Wrapper
from opacus_dp.layers import DPLSTM, DPRNN
from opacus_dp.layers import joined_steps
from tests.ghost.helpers import assert_norms_and_sums, model_oracle, per_step, private_update, run_backward

STEPS = 6
LAYERS = {
    "lstm": lambda: DPLSTM(4, 8, batch_first=True),
    "lstm-two-layers-bidirectional": lambda: DPLSTM(4, 8, num_layers=2, bidirectional=True, batch_first=True),
    "lstm-proj": lambda: DPLSTM(4, 8, proj_size=3, batch_first=True),
    "rnn-relu-bidirectional": lambda: DPRNN(5, 6, nonlinearity="relu", bidirectional=True, batch_first=True),
}


class Recurrent(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.rnn = layer

    def forward(self, x):
        return self.rnn(x)[0].sum(dim=1)


def _cells(model):
    return [m for m in model.modules() if hasattr(m, "ih") and hasattr(m, "hh")]


@pytest.fixture
def captures(monkeypatch):
    """``{layer: calls recorded}`` by every wrapper's forward hook (not the calls of forward
    passes that record nothing, such as the wrapper's own checks of the model)."""
    counts = {}
    capture = GradSampleModule._capture  # the norms-only wrapper's calls it too

    def counting(self, path, master, *rest, **kwargs):
        if self._recording() and torch.is_grad_enabled():
            counts[master] = counts.get(master, 0) + 1
        return capture(self, path, master, *rest, **kwargs)

    monkeypatch.setattr(GradSampleModule, "_capture", counting)
    return counts


def _wrapped(name, rule="mixed", joined=True, batch=4, hook=None, check=True):
    torch.manual_seed(0)
    model = Recurrent(LAYERS[name]()).double()
    if hook is not None:
        for cell in _cells(model):
            cell.hh.register_forward_hook(hook)
    x = torch.randn(batch, STEPS, model.rnn.input_size, dtype=torch.float64)
    oracle = model_oracle(model, (x,))
    wrapper = BookkeepingGradSampleModule(model, layer_rule=rule, check_sample_independence=check)
    if not joined:
        per_step(model)
    return model, wrapper, x, oracle


@pytest.mark.parametrize("joined", [True, False], ids=["joined", "per-step"])
@pytest.mark.parametrize("rule", ["mixed", "ghost"])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_norms_and_sums_are_the_oracles(name, rule, joined, captures):
    model, wrapper, x, oracle = _wrapped(name, rule, joined)
    run_backward(wrapper, (x,), "mean", len(x))
    for cell in _cells(model):
        assert captures[cell.hh] == (1 if joined else STEPS), "one call of hh per run, or one per step"
        assert captures[cell.ih] == 1
    assert_norms_and_sums(wrapper, oracle)


@pytest.mark.parametrize("joined", [True, False], ids=["joined", "per-step"])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_materialised_per_sample_gradients_and_ordinary_gradients(name, joined, captures):
    """``hooks`` (``GradSampleModule``): ``p.grad_sample`` is the oracle's, and ``p.grad`` the
    ordinary gradient (the joined steps compute ``hh`` from its parameters themselves there)."""
    torch.manual_seed(0)
    model = Recurrent(LAYERS[name]()).double()
    x = torch.randn(4, STEPS, model.rnn.input_size, dtype=torch.float64)
    oracle = model_oracle(model, (x,))
    wrapper = GradSampleModule(model)
    if not joined:
        per_step(model)
    run_backward(wrapper, (x,), "mean", len(x))
    assert [captures[c.hh] for c in _cells(model)] == [1 if joined else STEPS] * len(_cells(model))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad_sample, oracle[n], rtol=1e-9, atol=1e-10, msg=lambda m: f"{n}: {m}")
        torch.testing.assert_close(p.grad, oracle[n].mean(dim=0), rtol=1e-9, atol=1e-10, msg=lambda m: f"{n}: {m}")


def test_the_joined_call_takes_the_input_projections_gradient_products():
    """``ih`` and ``hh`` receive one output gradient: its Gram products are formed once per cell."""
    taken = {}
    for joined in (True, False):
        model, wrapper, x, oracle = _wrapped("lstm-two-layers-bidirectional", "ghost", joined)
        run_backward(wrapper, (x,), "mean", len(x))
        taken[joined] = wrapper._bookkeeper._input_grams.taken
        assert_norms_and_sums(wrapper, oracle)
    assert taken[True] == taken[False] >= len(_cells(model))


@pytest.mark.parametrize("mode", ["bk", "ghost", "hooks"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_private_updates_equal_the_per_step_updates(mode, clipping, captures):
    """A whole ``make_private`` step on packed sequences of several lengths (PackedSequence,
    the masked steps), the same with the steps' own calls."""
    torch.manual_seed(1)
    lengths = torch.tensor([6, 2, 5, 1, 6, 3])
    tokens = torch.randint(1, 20, (6, STEPS)) * (torch.arange(STEPS) < lengths[:, None])  # 0: padding

    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.rnn = nn.Embedding(20, 4), DPLSTM(4, 5, num_layers=2, batch_first=True)

        def forward(self, t):
            packed = nn.utils.rnn.pack_padded_sequence(self.emb(t), (t != 0).sum(dim=1), batch_first=True,
                                                       enforce_sorted=False)
            return nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True)[0].sum(dim=1)

    updates = []
    for joined in (True, False):
        torch.manual_seed(0)
        model = Packed().double()
        prepare = None if joined else (lambda t, m=model: (per_step(m), t)[1])
        bound = 0.05 if clipping == "flat" else [0.05] * len(list(model.parameters()))
        captures.clear()
        updates.append(private_update(model, DataLoader(TensorDataset(tokens), batch_size=6), mode, bound, 6,
                                      prepare=prepare, clipping=clipping))
        assert [captures[cell.hh] for cell in _cells(model)] == [1 if joined else STEPS] * 2
    for a, b in zip(*updates):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)
        assert a.abs().sum() > 0


def test_a_users_hook_on_the_step_projection_keeps_the_step_calls(captures):
    """The hook runs at every step and its change of the output is in the gradients."""
    seen = []
    model, wrapper, x, oracle = _wrapped("lstm", hook=lambda m, a, out: seen.append(1) or out * 0.5, check=False)
    seen.clear()  # the oracle's calls
    run_backward(wrapper, (x,), "mean", len(x))
    assert len(seen) == STEPS and captures[model.rnn.l0.hh] == STEPS
    assert_norms_and_sums(wrapper, oracle)


def test_a_global_module_hook_keeps_the_step_calls(captures):
    seen = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, a, out: seen.append(m) if isinstance(m, nn.Linear) else None)
    try:
        model, wrapper, x, oracle = _wrapped("lstm", check=False)
        seen.clear()  # the oracle's calls
        run_backward(wrapper, (x,), "mean", len(x))
    finally:
        handle.remove()
    assert seen.count(model.rnn.l0.hh) == STEPS and captures[model.rnn.l0.hh] == STEPS
    assert_norms_and_sums(wrapper, oracle)


def _plain_grads(name, x):
    torch.manual_seed(0)
    model = Recurrent(LAYERS[name]()).double()
    model(x).pow(2).sum().backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_with_the_hooks_disabled_every_projection_gets_its_ordinary_gradient():
    model, wrapper, x, _ = _wrapped("lstm-proj")
    wrapper.disable_hooks()
    wrapper(x).pow(2).sum().backward()
    expected = _plain_grads("lstm-proj", x)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], msg=lambda m: f"{n}: {m}")


def test_without_grad_nothing_is_recorded(captures):
    model, wrapper, x, _ = _wrapped("lstm")
    with torch.no_grad():
        out = wrapper(x)
    torch.manual_seed(0)
    plain = Recurrent(LAYERS["lstm"]()).double()
    torch.testing.assert_close(out, plain(x), rtol=0, atol=0)
    assert not captures


def test_a_frozen_step_projection_is_not_joined(captures):
    torch.manual_seed(0)
    model = Recurrent(LAYERS["lstm"]()).double()
    model.rnn.l0.hh.requires_grad_(False)
    x = torch.randn(4, STEPS, 4, dtype=torch.float64)
    oracle = model_oracle(model, (x,))
    wrapper = BookkeepingGradSampleModule(model)
    run_backward(wrapper, (x,), "mean", len(x))
    assert captures[model.rnn.l0.ih] == 1 and captures.get(model.rnn.l0.hh, 0) <= STEPS
    assert_norms_and_sums(wrapper, oracle)


def test_a_wrapper_that_keeps_weight_gradients_joins_with_the_parameters_themselves(captures):
    """``skip_weight_grads=False``: the joined steps compute ``hh`` from its parameters, so that
    ``p.grad`` is the ordinary gradient, and the norms are the oracle's."""
    torch.manual_seed(0)
    model = Recurrent(LAYERS["lstm-proj"]()).double()
    x = torch.randn(4, STEPS, 4, dtype=torch.float64)
    oracle = model_oracle(model, (x,))
    wrapper = BookkeepingGradSampleModule(model, skip_weight_grads=False)
    run_backward(wrapper, (x,), "mean", len(x))
    assert captures[model.rnn.l0.hh] == 1
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, oracle[n].mean(dim=0), rtol=1e-9, atol=1e-10, msg=lambda m: f"{n}: {m}")
    assert_norms_and_sums(wrapper, oracle)


def test_closing_the_wrapper_gives_the_steps_back():
    """After ``close()`` the model trains with ordinary gradients of every parameter."""
    model, wrapper, x, _ = _wrapped("lstm-two-layers-bidirectional")
    assert all(cell in joined_steps._RECORDERS for cell in _cells(model))
    wrapper.close()
    assert all(cell not in joined_steps._RECORDERS for cell in _cells(model))
    model(x).pow(2).sum().backward()
    expected = _plain_grads("lstm-two-layers-bidirectional", x)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_a_compiled_private_model_steps_as_the_eager_one(backend, monkeypatch):
    """The graph joins the steps too (after the forward that learns the taps' layout, which calls
    ``hh`` at every step); the update is the eager one."""
    joined, record = [], Wrapper._record_joined_steps
    monkeypatch.setattr(Wrapper, "_record_joined_steps",
                        lambda self, *args, traced=False: joined.append(traced) or record(self, *args, traced=traced))
    torch.manual_seed(2)
    x = torch.randn(4, STEPS, 4)
    loader = DataLoader(TensorDataset(x), batch_size=4)
    updates = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = Recurrent(LAYERS["lstm-two-layers-bidirectional"]())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            updates.append(_compiled_update(model, loader, backend if compiled else None))
    assert joined == [False] * 12 + [True] * 8  # 4 cells: 3 eager steps; compiled, 2 tapped ones
    for a, b in zip(*updates):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        assert a.abs().sum() > 0


def test_a_compiled_forward_stacks_the_steps_inputs_after_the_last_step():
    """Compiled, the joined call's inputs are stacked once (``JoinedSteps``): written into slices
    of one tensor step by step, they compiled to a chain of ``T`` scatters, which inductor fused
    into one kernel that read every step's input for every entry of the stack (``T²`` work: 2.6 ms
    of a 50 ms step at T = 64 in the LSTM benchmark, growing with T²)."""
    import operator

    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    model = Recurrent(LAYERS["lstm-two-layers-bidirectional"]())
    loader = DataLoader(TensorDataset(torch.randn(4, STEPS, 4)), batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _compiled_update(model, loader, recording)
    calls = [node.target for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    assert graphs and operator.setitem not in calls
    graphs.clear()
    plain = Recurrent(LAYERS["lstm-two-layers-bidirectional"]())
    plain.compile(backend=recording)
    plain(torch.randn(4, STEPS, 4))
    plain_calls = [node.target for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    assert calls.count(torch.stack) == plain_calls.count(torch.stack) + 4  # 4 runs: one stack of inputs each


def _compiled_update(model, loader, backend):
    from opacus_dp import PrivacyEngine

    wrapper, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=loader,
        noise_multiplier=0.0, max_grad_norm=0.1, poisson_sampling=False, grad_sample_mode="bk")
    if backend is not None:
        wrapper.compile(backend=backend)
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(3):  # the first compiled forward learns the calls, the later ones are tapped
        (xb,) = next(iter(loader))
        optimizer.zero_grad()
        wrapper(xb).pow(2).sum().backward()
        optimizer.step()
    return [b - p.detach() for b, p in zip(before, model.parameters())]


def test_under_bfloat16_autocast_the_joined_call_gives_the_per_step_norms():
    norms = []
    for joined in (True, False):
        torch.manual_seed(0)
        model, x = Recurrent(LAYERS["lstm-two-layers-bidirectional"]()), torch.randn(4, STEPS, 4)
        wrapper = BookkeepingGradSampleModule(model)
        if not joined:
            per_step(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = wrapper(x)
        out.float().pow(2).sum().backward()
        norms.append(torch.stack(wrapper.per_sample_norms([p for _, p in wrapper.trainable_parameters()])))
    assert norms[0].dtype == torch.float32 and norms[0].abs().sum() > 0
    torch.testing.assert_close(norms[0], norms[1], rtol=2e-2, atol=1e-3)


def test_wrappers_that_come_and_go_do_not_disturb_a_compiled_model(monkeypatch):
    """The traced forward reads no process-wide table: another model's wrapper, made and closed
    between two compiled steps, changes neither the compiled model's code nor its joined calls."""
    joined, record = [], Wrapper._record_joined_steps
    monkeypatch.setattr(Wrapper, "_record_joined_steps",
                        lambda self, *args, traced=False: joined.append(traced) or record(self, *args, traced=traced))
    torch.manual_seed(0)
    model = Recurrent(LAYERS["lstm"]())
    wrapper = BookkeepingGradSampleModule(model)
    wrapper.compile(backend="eager")
    x = torch.randn(4, STEPS, 4)
    for step in range(4):
        other = BookkeepingGradSampleModule(Recurrent(LAYERS["lstm"]()))
        other.close()
        del other
        wrapper(x).pow(2).sum().backward()
        wrapper.per_sample_norms([p for _, p in wrapper.trainable_parameters()])
        wrapper._bookkeeper.clear()
    assert joined[-3:] == [True] * 3


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_empty_batches_before_a_step_change_nothing(mode):
    """Poisson sampling's empty batches run the layer on no rows: the next step's update is the
    per-step calls' and no joined call is left waiting."""
    from opacus_dp import PrivacyEngine

    torch.manual_seed(3)
    x = torch.randn(4, STEPS, 4, dtype=torch.float64)
    updates = []
    for joined in (True, False):
        torch.manual_seed(0)
        model = Recurrent(LAYERS["lstm-proj"]()).double()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = PrivacyEngine().make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                data_loader=DataLoader(TensorDataset(x), batch_size=4), noise_multiplier=0.0, max_grad_norm=0.1,
                poisson_sampling=False, grad_sample_mode=mode, criterion=lambda out, *_: out.pow(2).sum())
        wrapper, optimizer = result[0], result[1]
        criterion = result[2] if mode == "ghost" else (lambda out: out.pow(2).sum())
        if not joined:
            per_step(model)
        before = [p.detach().clone() for p in model.parameters()]
        for batch in (x[:0], x[:0], x):
            optimizer.zero_grad()
            criterion(wrapper(batch)).backward()
            optimizer.step()
        assert not wrapper._bookkeeper._joined.get(model.rnn.l0.hh)
        updates.append([b - p.detach() for b, p in zip(before, model.parameters())])
    for a, b in zip(*updates):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)
        assert a.abs().sum() > 0


def test_a_cell_with_its_own_recurrence_keeps_the_step_calls(captures):
    """A subclass inherits the declared pair but changes what ``hh``'s output feeds (here halved):
    ``ih``'s output gradient is no longer ``hh``'s, and the checked per-step calls give the oracle."""
    from opacus_dp.layers.rnn_cells import DPLSTMCell

    class HalvedCell(DPLSTMCell):
        def recurrence(self, input_gates, state, project=None):
            h, c = state
            i, f, g, o = (input_gates + 0.5 * self.hh(h)).chunk(4, dim=-1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            return torch.sigmoid(o) * torch.tanh(c), c

    class HalvedLSTM(DPLSTM):
        def _make_cell(self, layer_input, device, dtype):
            return HalvedCell(layer_input, self.hidden_size, self.bias, device=device, dtype=dtype)

    torch.manual_seed(0)
    model = Recurrent(HalvedLSTM(4, 8, batch_first=True)).double()
    x = torch.randn(4, STEPS, 4, dtype=torch.float64)
    oracle = model_oracle(model, (x,))
    wrapper = BookkeepingGradSampleModule(model)
    run_backward(wrapper, (x,), "mean", len(x))
    assert captures[model.rnn.l0.hh] == STEPS
    assert_norms_and_sums(wrapper, oracle)


@pytest.mark.parametrize("joined", [True, False], ids=["joined", "per-step"])
def test_a_sequence_first_model_gives_the_oracle(joined, captures):
    """``batch_first=False`` (model and wrapper): the steps' inputs and ``G`` are batch-first inside."""

    class SequenceFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.fc = DPLSTM(4, 8, num_layers=2, bidirectional=True), nn.Linear(16, 3)

        def forward(self, x):
            return self.fc(self.rnn(x)[0]).sum(dim=0)

    torch.manual_seed(0)
    model = SequenceFirst().double()
    x = torch.randn(STEPS, 3, 4, dtype=torch.float64)
    oracle = model_oracle(model, (x,), batch_dim=1)
    wrapper = BookkeepingGradSampleModule(model, batch_first=False)
    if not joined:
        per_step(model)
    run_backward(wrapper, (x,), "mean", 3)
    assert [captures[c.hh] for c in _cells(model)] == [1 if joined else STEPS] * 4
    assert_norms_and_sums(wrapper, oracle)
