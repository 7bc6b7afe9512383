"""``fullgraph=True``: the model's own code compiled as one graph, the wrapper eager around it.

``private.compile(fullgraph=True)`` and ``make_private(module=torch.compile(model, fullgraph=True))``
compile the wrapped model's call (its hooked layers tapped into the graph) and run the wrapper's
bookkeeping and model-level checks eagerly around it: training equals eager training, dynamo makes
no graph break, and a forward whose calls cannot be tapped is refused with the way out.
``torch.compile(private, fullgraph=True)`` is refused in ``test_compiled_wrapper.py``.
"""

import pytest
import torch
import torch.nn as nn

from tests.compile.helpers import (assert_one_mlp_graph_without_breaks, assert_same_training, batch, build,
                                   eager_training, initial, make_private, recording_backend, steps, train)

pytestmark = pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")


def in_place_fullgraph(private):
    private.compile(backend="aot_eager", fullgraph=True)
    return private


def passed_fullgraph(model):
    return torch.compile(model, backend="aot_eager", fullgraph=True)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bk"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "sequential_cnn"])
def test_in_place_fullgraph_trains_as_eager(name, mode):
    expected = eager_training(name, mode)
    assert_same_training(train(name, mode, after=in_place_fullgraph), expected, initial(name))


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_a_model_compiled_with_fullgraph_trains_as_eager(mode):
    expected = eager_training("cnn", mode)
    assert_same_training(train("cnn", mode, before=passed_fullgraph), expected, initial("cnn"))


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_the_compiled_forward_is_one_graph_with_its_hooked_layers_and_no_break(mode):
    graphs, backend = recording_backend()
    private, optimizer, criterion = make_private(build("mlp"), mode, "mlp")
    private.compile(backend=backend, fullgraph=True)
    steps(private, optimizer, criterion, "mlp", sizes=(8, 8))  # the first forward learns the calls
    assert_one_mlp_graph_without_breaks(graphs)


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_a_call_broadcast_over_the_batch_compiles_into_one_graph_and_trains_as_eager(mode):
    """The Block's position embedding (one sample broadcast over the batch) is tapped, expanded to
    the batch inside the graph: fullgraph=True holds, and training is the eager training."""
    graphs, backend = recording_backend()

    def in_place(private):
        private.compile(backend=backend, fullgraph=True)
        return private

    assert_same_training(train("block", mode, after=in_place), eager_training("block", mode), initial("block"))
    assert graphs and all("embedding(" in code for code in graphs)


def test_the_compiled_call_without_fullgraph_keeps_untappable_calls_outside_and_trains_as_eager():
    """In bk a layer of its own type with a buffer is not tapped: its hooks, and the wrapper's own
    hooks on the model, run outside the graph."""
    def in_place(private):
        private.compile(backend="eager")
        return private

    assert_same_training(train("block_with_buffer", "bk", after=in_place), eager_training("block_with_buffer", "bk"),
                         initial("block_with_buffer"))


@pytest.mark.parametrize("way", ["in place", "passed compiled"])
def test_untappable_calls_under_fullgraph_are_refused_before_the_step(way):
    model = build("block_with_buffer")
    if way == "in place":
        private, optimizer, criterion = make_private(model, "bk", "block_with_buffer")
        private.compile(backend="eager", fullgraph=True)
    else:
        private, optimizer, criterion = make_private(model, "bk", "block_with_buffer", passed_fullgraph(model))
    start = [p.detach().clone() for p in model.parameters()]
    x, y = batch("block_with_buffer", 8)
    with pytest.raises(ValueError, match="fullgraph=True.*cannot be traced into the graph.*without fullgraph"):
        private(x)
    assert all(torch.equal(a, b) for a, b in zip(start, model.parameters()))
    private.compile(backend="eager")  # the way out: the same model trains
    steps(private, optimizer, criterion, "block_with_buffer", sizes=(8,))
    assert any(not torch.equal(a, b) for a, b in zip(start, model.parameters()))


class BufferWriter(nn.Module):
    """Writes its buffer (not a public one) once ``write`` is set."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))
        self.write = False

    def forward(self, x):
        if self.write:
            self.calls.add_(1)
        return x


@pytest.mark.parametrize("fullgraph", [False, True])
def test_the_model_checks_run_around_the_compiled_call(fullgraph):
    """The buffer-write check runs eagerly around each compiled call (its hooks on the model, an
    ``nn.Sequential`` whose call dynamo traces into the graph, do nothing there): a write in a
    later, compiled forward is refused as eagerly."""
    torch.manual_seed(0)
    writer = BufferWriter()
    private, optimizer, criterion = make_private(nn.Sequential(nn.Linear(6, 3), writer), "bk", "mlp")
    private.compile(backend="aot_eager", fullgraph=fullgraph)
    steps(private, optimizer, criterion, "mlp", sizes=(8, 8))  # learned, then compiled: no write
    writer.write = True
    with pytest.raises(Exception, match=r"^1 \(BufferWriter\) writes in place .* its buffer 'calls'"):
        private(batch("mlp", 8)[0])
