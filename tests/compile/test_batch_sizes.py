"""Poisson batches change size from step to step. A compiled private model is compiled twice, as
the same model without privacy is (for the first batch size, then once with a dynamic batch
dimension), not once per new size: the taps' batch dimension is dynamic as the inputs' is
(``opacus_dp.grad_sample.traced_taps``). Training stays the eager training."""

import pytest
import torch
import torch.nn as nn

from tests.compile.helpers import (assert_same_training, batch, build, count_tapped_calls, eager_training, initial,
                                   make_private, recording_backend, steps)

pytestmark = pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")

SIZES = (8, 6, 7, 5, 4, 3, 2)  # at most the helpers' batch size (8); 1 is a size of its own to dynamo
SEQUENTIAL_CALLS = 3  # two convolutions and the head of tests.compile.helpers.sequential_cnn


def graphs_without_privacy(name: str) -> int:
    """Graphs dynamo builds for the same model compiled without privacy, over the same batches."""
    graphs, backend = recording_backend()
    model = build(name)
    compiled = torch.compile(model, backend=backend)
    for n in SIZES:
        x, y = batch(name, n)
        nn.functional.cross_entropy(compiled(x), y).backward()
    return len(graphs)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bk"])
@pytest.mark.parametrize("how", ["in place", "around"])
def test_new_batch_sizes_do_not_compile_the_model_again(monkeypatch, how, mode):
    tapped = count_tapped_calls(monkeypatch)
    expected_graphs = graphs_without_privacy("sequential_cnn")
    assert expected_graphs == 2
    expected = eager_training("sequential_cnn", mode, sizes=SIZES)
    graphs, backend = recording_backend()
    model = build("sequential_cnn")
    private, optimizer, criterion = make_private(model, mode, "sequential_cnn")
    if how == "in place":
        private.compile(backend=backend)
    else:
        private = torch.compile(private, backend=backend)
    steps(private, optimizer, criterion, "sequential_cnn", sizes=SIZES)
    model_graphs = [g for g in graphs if "conv2d" in g]
    assert len(model_graphs) == expected_graphs
    assert tapped == [SEQUENTIAL_CALLS] * (len(SIZES) - 1)  # the first forward learns the calls
    assert_same_training([p.detach() for p in model.parameters()], expected, initial("sequential_cnn"))


@pytest.mark.slow
def test_inductor_with_new_batch_sizes_trains_as_eager(monkeypatch):
    """Inductor's kernels for the dynamic batch dimension (and its own output-gradient layouts)."""
    tapped = count_tapped_calls(monkeypatch)
    expected = eager_training("sequential_cnn", "bk", sizes=SIZES)
    model = build("sequential_cnn")
    private, optimizer, criterion = make_private(model, "bk", "sequential_cnn")
    private.compile(backend="inductor")
    steps(private, optimizer, criterion, "sequential_cnn", sizes=SIZES)
    assert tapped == [SEQUENTIAL_CALLS] * (len(SIZES) - 1)
    assert_same_training([p.detach() for p in model.parameters()], expected, initial("sequential_cnn"))


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_a_call_broadcast_over_the_batch_does_not_compile_the_model_again(monkeypatch, mode):
    """The Block's position embedding (one row broadcast over the batch) is expanded to its tap's
    batch size inside the graph: that size is dynamic too."""
    tapped = count_tapped_calls(monkeypatch)
    expected_graphs = graphs_without_privacy("block")
    expected = eager_training("block", mode, sizes=SIZES)
    graphs, backend = recording_backend()
    model = build("block")
    private, optimizer, criterion = make_private(model, mode, "block")
    private.compile(backend=backend)
    steps(private, optimizer, criterion, "block", sizes=SIZES)
    assert len([g for g in graphs if "embedding(" in g]) == expected_graphs == 2
    assert tapped == [6] * (len(SIZES) - 1)  # two embeddings, LayerNorm and three Linear layers
    assert_same_training([p.detach() for p in model.parameters()], expected, initial("block"))
