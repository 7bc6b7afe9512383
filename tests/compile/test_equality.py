"""A compiled private model trains exactly as the eager one, in every mode: compiled after
``make_private``, in place (``private.compile()``), or passed to ``make_private`` compiled.

``backend="eager"`` (dynamo's graph capture, the hooks outside it) runs everything; "aot_eager"
adds AOT autograd's compiled backward; one "inductor" run (slow: a C++ build) checks the default.
"""

import pytest
import torch
import torch.nn as nn

from tests.compile.helpers import (MODES, assert_same_training, batch, build, compile_after, compile_in_place,
                                   eager_training, initial, make_private, steps, train)

pytestmark = pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["cnn", "block"])  # "mlp": below, compiled before make_private
def test_compiling_the_private_model(name, mode):
    expected = eager_training(name, mode)
    assert_same_training(train(name, mode, after=compile_after("eager")), expected, initial(name))


@pytest.mark.parametrize("mode", MODES)
def test_passing_a_compiled_model_to_make_private(mode):
    expected = eager_training("mlp", mode)
    got = train("mlp", mode, before=lambda model: torch.compile(model, backend="eager"))
    assert_same_training(got, expected, initial("mlp"))


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_compiling_in_place(mode):
    expected = eager_training("mlp", mode)
    assert_same_training(train("mlp", mode, after=compile_in_place("eager")), expected, initial("mlp"))


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_empty_and_single_sample_batches(mode):
    sizes = (8, 0, 5, 1)
    expected = eager_training("mlp", mode, sizes=sizes)
    assert_same_training(train("mlp", mode, after=compile_after("eager"), sizes=sizes), expected, initial("mlp"))


@pytest.mark.parametrize("mode", ["hooks", "functorch", "bk"])
def test_aot_autograd_backward(mode):
    expected = eager_training("cnn", mode)
    assert_same_training(train("cnn", mode, after=compile_after("aot_eager")), expected, initial("cnn"))


def test_aot_autograd_backward_transformer_block():
    expected = eager_training("block", "bk")
    got = train("block", "bk", before=lambda model: torch.compile(model, backend="aot_eager"))
    assert_same_training(got, expected, initial("block"))


def test_ghost_runs_one_book_keeping_pass_after_a_compiled_forward():
    """AOT autograd frees ("donates") saved buffers after a compiled backward, so ``ghost``'s second
    pass through it could fail (the Block's graph donates): after a forward of the compiled
    private model the ghost loss runs one book-keeping pass, the same update as two."""
    for name in ("block", "cnn"):
        got = train(name, "ghost", after=compile_after("aot_eager"))
        assert_same_training(got, eager_training(name, "ghost"), initial(name))
    model = build("cnn")
    private, optimizer, criterion = make_private(model, "ghost", "cnn")
    compiled = torch.compile(private, backend="aot_eager")
    for forward, two_passes in ((private, True), (compiled, False), (private, True)):
        criterion(forward(batch("cnn", 4)[0]), batch("cnn", 4)[1]).backward()
        assert private.supports_two_passes is two_passes
        optimizer.step()
        optimizer.zero_grad()


def test_ghost_names_the_way_out_where_a_submodule_compiled_before_make_private_donates_buffers():
    """A submodule compiled in place before ``make_private`` (the model itself would be adopted:
    ``test_compiled_before_wrapping.py``): the private wrapper runs eagerly around its compiled
    call, the ghost loss runs two passes, and the second is refused loudly; equal with
    ``donated_buffer=False``."""
    expected = eager_training("block", "ghost")

    def trained_with_compiled_block():
        block = build("block")
        block.compile(backend="aot_eager")
        model = nn.Sequential(block)  # no parameters of its own: the Block's, in the same order
        private, optimizer, criterion = make_private(model, "ghost", "block")
        steps(private, optimizer, criterion, "block")
        return [p.detach().clone() for p in model.parameters()]

    with pytest.raises(RuntimeError, match="private_model.compile"):
        trained_with_compiled_block()
    torch.compiler.reset()
    with torch._functorch.config.patch(donated_buffer=False):
        got = trained_with_compiled_block()
    assert_same_training(got, expected, initial("block"))


@pytest.mark.slow
def test_inductor():
    expected = eager_training("mlp", "hooks")
    assert_same_training(train("mlp", "hooks", after=compile_after("inductor")), expected, initial("mlp"))
