"""The declared protocol between DPOptimizer and its gradient sources (GradSource), and the
absence of attribute probing between opacus_dp.optim and opacus_dp.grad_sample."""

import ast
import math
import pathlib

import pytest
import torch
import torch.nn as nn

from opacus_dp import PrivacyEngine
from opacus_dp.grad_sample import BookkeepingGradSampleModule, GradSampleModule
from opacus_dp.optim import DPOptimizer
from opacus_dp.optimizers import DPOptimizerFastGradientClipping
from opacus_dp.state_views import is_consumed
from opacus_dp.per_sample_source import (
    AttributeGradSource,
    GradSource,
    ModuleGradSource,
    PerSampleWrapper,
    grad_source_for,
)
from tests.engine.helpers import small_loader, small_model

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "opacus_dp"
PROTOCOL_NAMES = {"per_sample_norms", "clipped_sums", "pending_passes", "set_factor_function", "clear",
                  "forms_sums_in_backward", "grad_source", "pop", "pop_grad_samples", "zero_grad_sample"}


class StubSource:
    """Implements only the protocol: fixed per-sample gradients of one tensor."""

    forms_sums_in_backward = False

    def __init__(self, param, grads, passes=1):
        self.param, self.grads, self.passes, self.calls = param, grads, passes, []

    def per_sample_norms(self, params, name_of=None):
        self.calls.append("norms")
        return [self.grads.reshape(len(self.grads), -1).norm(dim=1) for _ in params]

    def clipped_sums(self, params, factors):
        self.calls.append("sums")
        return [torch.einsum("i,i...->...", f, self.grads) for f in factors]

    def pending_passes(self):
        return self.passes

    def set_factor_function(self, factor_function):
        self.calls.append(("factor_function", factor_function))

    def clear(self, params):
        self.calls.append("clear")


def test_every_source_satisfies_the_protocol():
    model = small_model()
    hooks, bk = GradSampleModule(small_model()), BookkeepingGradSampleModule(model)
    awaiting = DPOptimizerFastGradientClipping(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=0.0,
                                               max_grad_norm=1.0, expected_batch_size=2).grad_source
    for source in (AttributeGradSource(), ModuleGradSource(hooks), bk, awaiting, StubSource(None, None)):
        assert isinstance(source, GradSource), type(source).__name__
    assert isinstance(hooks, PerSampleWrapper) and isinstance(bk, PerSampleWrapper)
    assert type(grad_source_for(hooks)) is ModuleGradSource and grad_source_for(hooks).module is hooks
    assert grad_source_for(bk) is bk
    for plain in (None, small_model()):
        assert type(grad_source_for(plain)) is AttributeGradSource
    hooks.close()
    bk.close()


def test_a_stub_source_drives_a_step_to_the_hand_computed_clipped_mean():
    p = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    grads = torch.tensor([[3.0, 4.0], [0.3, 0.4]], dtype=torch.float64)  # norms 5 and 0.5
    source = StubSource(p, grads)
    optimizer = DPOptimizer(torch.optim.SGD([p], lr=1.0), noise_multiplier=0.0, max_grad_norm=1.0,
                            expected_batch_size=2, grad_source=source)
    optimizer.step()
    expected = (grads[0] / (5.0 + 1e-6) + grads[1]) / 2  # f = min(1, C / (‖g‖ + 1e-6))
    torch.testing.assert_close(p.detach(), -expected)
    assert source.calls == [("factor_function", None), "norms", "sums"]
    optimizer.zero_grad()
    assert source.calls[-1] == "clear"


def test_merged_passes_come_from_the_source():
    p = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    source = StubSource(p, torch.tensor([[0.3, 0.4]], dtype=torch.float64), passes=3)
    optimizer = DPOptimizer(torch.optim.SGD([p], lr=1.0), noise_multiplier=0.0, max_grad_norm=1.0,
                            expected_batch_size=1, grad_source=source)
    optimizer.step()
    assert optimizer.accumulated_iterations == 3
    torch.testing.assert_close(p.detach(), -torch.tensor([0.1, 0.4 / 3], dtype=torch.float64))


def test_a_source_without_the_protocol_is_refused():
    class OldSource:
        def pop(self, params):
            return {}

        def clear(self, params):
            pass

    model = small_model()
    with pytest.raises(TypeError, match="GradSource protocol"):
        DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=0.0, max_grad_norm=1.0,
                    expected_batch_size=2, grad_source=OldSource())


@pytest.mark.filterwarnings("ignore:secure_mode is off")
def test_bk_forms_sums_in_backward_exactly_with_per_layer_clipping():
    model = small_model()
    engine = PrivacyEngine()
    gsm, optimizer, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=small_loader(),
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="bk")
    assert optimizer.grad_source is gsm and not gsm.forms_sums_in_backward
    optimizer.max_grad_norms = [1.0] * len(optimizer.params)
    assert gsm.forms_sums_in_backward
    gsm.close()


def _sources(directory: pathlib.Path):
    for path in sorted(directory.rglob("*.py")):
        yield path, ast.parse(path.read_text())


def test_no_attribute_probing_of_a_grad_source_in_optim():
    """No hasattr/getattr on a source or module, nor of a protocol name, in the optimizer code."""
    found = []
    files = [*_sources(PACKAGE / "optim"), (PACKAGE / "per_sample_source.py",
                                           ast.parse((PACKAGE / "per_sample_source.py").read_text()))]
    for path, tree in files:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("hasattr", "getattr") and node.args:
                target = ast.unparse(node.args[0])
                name = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else ""
                if "source" in target or "module" in target or name in PROTOCOL_NAMES:
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def test_grad_sample_reads_no_optimizer_attribute():
    """grad_sample gets what it needs from the optimizer as explicit callables (StepClipping)."""
    found = []
    for path, tree in _sources(PACKAGE / "grad_sample"):
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and "optimizer" in ast.unparse(node.value).lower():
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("hasattr", "getattr") and node.args \
                    and "optimizer" in ast.unparse(node.args[0]).lower():
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def test_materialised_sources_keep_their_checks():
    p = nn.Parameter(torch.zeros(3))
    source = AttributeGradSource()
    with pytest.raises(RuntimeError, match="no per-sample gradients to process"):
        source.per_sample_norms([p], lambda q: "w")
    p.grad_sample = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="per-sample gradient of w has shape"):
        source.per_sample_norms([p], lambda q: "w")
    p.grad_sample = torch.tensor([[1.0, 2.0, 2.0], [0.0, 0.0, 0.0]])
    norms = source.per_sample_norms([p], lambda q: "w")
    assert torch.equal(norms[0], torch.tensor([3.0, 0.0]))
    assert is_consumed(p.grad_sample)  # kept to be read (Opacus 1.x), never taken again
    (total,) = source.clipped_sums([p], [torch.tensor([0.5, 1.0])])
    assert torch.equal(total, torch.tensor([0.5, 1.0, 1.0]))
    assert source.clipped_sums([p], [torch.ones(2)]) == [None]  # consumed
    with pytest.raises(RuntimeError, match="no per-sample gradients to process"):
        source.per_sample_norms([p], lambda q: "w")
    assert math.isclose(source.pending_passes(), 1)
