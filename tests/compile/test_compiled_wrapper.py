"""What ``make_private`` does with a compiled model, what dynamo compiles, and the private torch
attributes :mod:`opacus_dp.grad_sample.compiled_modules` relies on."""

import pytest
import torch
import torch.nn as nn

from opacus_dp.grad_sample import GradSampleModule
from opacus_dp.grad_sample.compiled_modules import compile_like, take_compiled
from opacus_dp.model_wrappers import unwrap_model
from tests.compile.helpers import batch, build, make_private, steps

pytestmark = pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")


class Recorder:
    """A dynamo backend that runs the captured graphs as they are and keeps their code."""

    def __init__(self):
        self.graphs = []

    def __call__(self, graph_module, example_inputs):
        self.graphs.append(graph_module.code)
        return graph_module.forward


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_a_compiled_model_is_wrapped_uncompiled_and_the_wrapper_compiled_alike(mode):
    model, recorder = build("block"), Recorder()
    private, optimizer, criterion = make_private(model, mode, "block", module=torch.compile(model, backend=recorder))
    assert isinstance(private, GradSampleModule) and unwrap_model(private) is model
    plain, _, _ = make_private(build("block"), mode, "block")
    assert list(private.state_dict()) == list(plain.state_dict())  # no "_orig_mod." in the keys
    steps(private, optimizer, criterion, "block", sizes=(8, 8))  # the first forward learns (traced_taps)
    assert any("linear" in code for code in recorder.graphs)  # the user's backend compiled the layers


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_what_dynamo_compiles_around_hooked_layers(mode):
    """docs/compile.md: once the first forward has learned the calls (traced_taps), nn.Sequential's
    loop is one graph with both hooked Linear layers and the ReLU between them, and the Block's
    layers (its position embedding broadcast over the batch too) are in one graph with its softmax;
    a forward with a call that cannot be tapped (bk: a layer of its own type with a buffer) keeps
    the hooks outside the graph, and the code between hooked calls is compiled (the softmax)."""
    graphs = {}
    names = ("block", "mlp") + (("block_with_buffer",) if mode == "bk" else ())
    for name in names:
        recorder = Recorder()
        private, optimizer, criterion = make_private(build(name), mode, name)
        private.compile(backend=recorder)
        steps(private, optimizer, criterion, name, sizes=(8, 8))
        graphs[name] = recorder.graphs
    assert any("softmax" in code and code.count("linear(") >= 3 and code.count("embedding(") >= 2
               for code in graphs["block"])
    assert any("relu" in code and code.count("linear(") >= 2 for code in graphs["mlp"])
    if mode == "bk":
        assert any("softmax" in code for code in graphs["block_with_buffer"])
        assert not any("softmax" in code and "linear(" in code for code in graphs["block_with_buffer"])  # hooks outside


def test_fullgraph_around_the_wrapper_is_refused_naming_the_way_out():
    """Dynamo cannot trace the wrapper's bookkeeping into one graph: torch.compile(private,
    fullgraph=True) is refused at its first call, before the model runs, naming
    private.compile(fullgraph=True) (tests/compile/test_fullgraph.py)."""
    model = build("mlp")
    private, _, _ = make_private(model, "hooks", "mlp")
    before = [p.detach().clone() for p in model.parameters()]
    compiled = torch.compile(private, backend="eager", fullgraph=True)
    with pytest.raises(ValueError, match=r"private_model\.compile\(fullgraph=True\)"):
        compiled(batch("mlp", 4)[0])
    assert all(p.grad_sample is None for p in model.parameters())  # the model did not run
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    torch.compile(private, backend="eager")(batch("mlp", 4)[0])  # without fullgraph: accepted


def test_opacus_api_per_sample_gradients_under_compile():
    x, y = batch("cnn", 6)
    grad_samples = []
    for compiled in (False, True):
        model = build("cnn")
        wrapper = GradSampleModule(model)
        run = torch.compile(wrapper, backend="eager") if compiled else wrapper
        nn.functional.cross_entropy(run(x), y).backward()
        grad_samples.append([p.grad_sample.clone() for p in model.parameters()])
        wrapper.close()
    for eager, compiled in zip(*grad_samples):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_private_torch_attributes_relied_on():
    """``OptimizedModule._orig_mod`` / ``.dynamo_ctx`` (with ``.fullgraph``), ``nn.Module._call_impl``
    (what ``nn.Module.compile`` compiles: the forward with the module's hooks) and the dynamo
    setting ``skip_nnmodule_hook_guards``."""
    assert isinstance(torch._dynamo.config.skip_nnmodule_hook_guards, bool)
    model, recorder = nn.Linear(3, 2), Recorder()
    original, compiled = take_compiled(torch.compile(model, backend=recorder, fullgraph=True))
    assert original is model and take_compiled(model) == (model, None)
    assert compiled.dynamo_ctx.fullgraph is True
    assert torch.compile(model, backend="eager").dynamo_ctx.fullgraph is False
    other = GradSampleModule(nn.Linear(3, 2))
    assert compile_like(other, compiled) is other
    x = torch.randn(4, 3)
    for _ in range(2):  # the first forward learns the call (traced_taps), the second is compiled
        torch.testing.assert_close(other(x), nn.functional.linear(x, other._module.weight, other._module.bias))
    assert len(recorder.graphs) == 1


@pytest.mark.filterwarnings("ignore:secure_mode is off")
def test_the_model_inside_a_compiled_wrapper_is_found_and_checkpointed_with_its_own_keys(tmp_path):
    """A private model compiled by other software (``torch.compile(private)``, as the HF
    ``Trainer``'s ``torch_compile=True`` does): :func:`unwrap_model` finds the user's model inside
    (``_orig_mod``), so a checkpoint saved through it has the model's keys and loads into an
    uncompiled private model, and back into a compiled one."""
    from opacus_dp import PrivacyEngine

    model = build("mlp")
    private, optimizer, criterion = make_private(model, "bk", "mlp")
    compiled = torch.compile(private, backend="eager")
    assert unwrap_model(compiled) is model and unwrap_model(torch.compile(model, backend="eager")) is model
    steps(compiled, optimizer, criterion, "mlp", sizes=(8,))
    PrivacyEngine(accountant="rdp").save_checkpoint(path=tmp_path / "ckpt.pt", module=compiled)
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)["module_state_dict"]
    assert list(saved) == list(build("mlp").state_dict())  # no "_orig_mod." nor "_module."
    fresh = build("mlp")
    fresh_private, _, _ = make_private(fresh, "bk", "mlp")
    for target in (fresh_private, torch.compile(fresh_private, backend="eager")):
        with torch.no_grad():
            for p in fresh.parameters():
                p.zero_()
        PrivacyEngine(accountant="rdp").load_checkpoint(path=tmp_path / "ckpt.pt", module=target)
        assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
