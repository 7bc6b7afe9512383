"""A compiled private model trains exactly as the eager one, in every mode: compiled after
``make_private``, in place (``private.compile()``), or passed to ``make_private`` compiled.

``backend="eager"`` (dynamo's graph capture, the hooks outside it) runs everything; "aot_eager"
adds AOT autograd's compiled backward; one "inductor" run (slow: a C++ build) checks the default.
"""

import pytest
import torch

from tests.compile.helpers import (MODES, assert_same_training, compile_after, compile_in_place, eager_training,
                                   initial, train)

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


def test_ghost_needs_the_buffers_of_its_first_backward():
    """"ghost" backpropagates twice through one graph; AOT autograd frees ("donates") saved
    buffers after the first backward unless told not to: refused loudly, or equal with
    ``donated_buffer=False``. (The Block's broadcast position embedding keeps its hooks outside
    the graph; with its calls tapped, the CNN's graph saves no buffer that it donates.)"""
    expected = eager_training("block", "ghost")
    with pytest.raises(RuntimeError, match="torch.compile"):
        train("block", "ghost", after=compile_after("aot_eager"))
    torch.compiler.reset()
    with torch._functorch.config.patch(donated_buffer=False):
        got = train("block", "ghost", after=compile_after("aot_eager"))
    assert_same_training(got, expected, initial("block"))
    assert_same_training(train("cnn", "ghost", after=compile_after("aot_eager")), eager_training("cnn", "ghost"),
                         initial("cnn"))


@pytest.mark.slow
def test_inductor():
    expected = eager_training("mlp", "hooks")
    assert_same_training(train("mlp", "hooks", after=compile_after("inductor")), expected, initial("mlp"))
