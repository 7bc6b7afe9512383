"""A model compiled in place (``model.compile(...)``) before or after it is made private.

At its forward the wrapper adopts the model's compiled call, as if ``private.compile(...)`` had
been called with the same arguments: training equals eager training, the model's forward with its
hooked layers is one graph without breaks, ``fullgraph=True`` keeps its meaning (untappable calls
refused with the way out), and closing the wrapper gives the compiled call back to the model.
"""

import warnings

import pytest
import torch
import torch.nn as nn

from opacus_dp import GradSampleModule
from tests.compile.helpers import (assert_one_mlp_graph_without_breaks, assert_same_training, batch, build,
                                   eager_training, initial, make_private, recording_backend, steps, train)

pytestmark = pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")


def compiled_in_place(**options):
    def compile_model(model):
        model.compile(**options)
        return model
    return compile_model


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bk"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "block"])
def test_a_model_compiled_in_place_trains_as_eager(name, mode):
    """``aot_eager`` donates buffers of the Block's graph: ``ghost`` runs one book-keeping pass, as
    for a compiled private model (the eager ghost loss's second pass would be refused)."""
    got = train(name, mode, before=compiled_in_place(backend="aot_eager"))
    assert_same_training(got, eager_training(name, mode), initial(name))


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_its_forward_is_one_graph_with_the_hooked_layers_and_no_break(mode, when):
    """Compiled in place before or after ``make_private``. Without adoption each hooked layer of
    the eagerly run wrapper would be a graph break."""
    graphs, backend = recording_backend()
    model = build("mlp")
    if when == "before":
        model.compile(backend=backend, fullgraph=True)
    private, optimizer, criterion = make_private(model, mode, "mlp")
    if when == "after":
        model.compile(backend=backend, fullgraph=True)
    steps(private, optimizer, criterion, "mlp", sizes=(8, 8))  # the first forward learns the calls
    assert model._compiled_call_impl is None  # the wrapper holds it
    assert_one_mlp_graph_without_breaks(graphs)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bk"])
def test_a_model_compiled_in_place_after_make_private_trains_as_eager(mode):
    def compiled_after(private):
        private._module.compile(backend="aot_eager")
        return private

    assert_same_training(train("cnn", mode, after=compiled_after), eager_training("cnn", mode), initial("cnn"))


def test_fullgraph_refuses_untappable_calls_before_the_step():
    """In bk a layer of its own type with a buffer cannot be tapped (tests.compile.helpers)."""
    model = build("block_with_buffer")
    model.compile(backend="eager", fullgraph=True)
    private, optimizer, criterion = make_private(model, "bk", "block_with_buffer")
    start = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="fullgraph=True.*cannot be traced into the graph.*without fullgraph"):
        private(batch("block_with_buffer", 8)[0])
    assert all(torch.equal(a, b) for a, b in zip(start, model.parameters()))
    private.compile(backend="eager")  # the way out
    steps(private, optimizer, criterion, "block_with_buffer", sizes=(8,))
    assert any(not torch.equal(a, b) for a, b in zip(start, model.parameters()))


def test_closing_the_wrapper_gives_the_compiled_call_back():
    model = build("mlp")
    model.compile(backend="eager")
    compiled_call = model._compiled_call_impl
    wrapper = GradSampleModule(model)
    wrapper(batch("mlp", 4)[0])
    assert model._compiled_call_impl is None and wrapper._compiled_model_call is compiled_call
    assert wrapper.to_standard_module() is model
    assert model._compiled_call_impl is compiled_call and wrapper._compiled_model_call is None
    wrapper(batch("mlp", 4)[0])  # a closed wrapper adopts nothing
    assert model._compiled_call_impl is compiled_call


def test_a_model_compiled_again_while_wrapped_is_adopted_again_and_keeps_its_last_call():
    model = build("mlp")
    model.compile(backend="eager")
    wrapper = GradSampleModule(model)
    wrapper(batch("mlp", 4)[0])
    model.compile(backend="aot_eager")
    newer = model._compiled_call_impl
    wrapper(batch("mlp", 4)[0])
    assert wrapper._compiled_model_call is newer and model._compiled_call_impl is None
    model.compile(backend="eager")
    newest = model._compiled_call_impl
    wrapper.close()  # the model's newest call stays; the adopted one is dropped
    assert model._compiled_call_impl is newest and wrapper._compiled_model_call is None


def test_a_submodule_compiled_in_place_is_left_compiled():
    """Only the wrapped model's own call is adopted; a compiled submodule runs compiled inside the
    eager wrapper (its hooks outside its graph), and trains as eager."""
    model = nn.Sequential(build("cnn"))
    model[0].compile(backend="eager")
    private, optimizer, criterion = make_private(model, "bk", "cnn")
    assert model[0]._compiled_call_impl is not None and private._compiled_model_call is None
    steps(private, optimizer, criterion, "cnn")
    assert_same_training([p.detach().clone() for p in model.parameters()], eager_training("cnn", "bk"),
                         initial("cnn"))


def test_the_0x_api_leaves_the_compiled_call_on_the_model_it_trains_through():
    """``PrivacyEngine(model, ...).attach(optimizer)`` trains by calling the model itself: its
    compiled call stays there (hooked layers outside its graph), and training equals eager training."""
    from opacus_dp import PrivacyEngine
    from tests.compile.helpers import CLIP, SIZES

    def trained(compile_first: bool):
        model = build("mlp")
        if compile_first:
            model.compile(backend="eager")
        compiled_call = model._compiled_call_impl
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the secure-RNG note
            PrivacyEngine(model, batch_size=8, sample_size=64, noise_multiplier=0.0,
                          max_grad_norm=CLIP).attach(optimizer)
        assert model._compiled_call_impl is compiled_call
        for n in SIZES:
            x, y = batch("mlp", n)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    assert_same_training(trained(True), trained(False), initial("mlp"))
