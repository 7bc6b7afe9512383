"""Code compiled before the wrapper's hooks existed never runs without them.

Dynamo does not guard on module hooks by default: code compiled for a module without hooks (the
model before ``make_private``, or another instance of one of its classes) would be reused once
hooks are added, and skip them. The wrapper turns those guards on and clears such code; should
hookless code run anyway, the DP optimizer refuses the step (never a silent non-private one).
"""

import multiprocessing

import pytest
import torch
import torch.nn as nn

from opacus_dp.grad_sample import compiled_modules
from tests.compile.helpers import (MODES, assert_same_training, batch, build, eager_training, initial,
                                   make_private, steps)

pytestmark = pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")


def warm(compiled: nn.Module, name: str = "mlp") -> None:
    """Run ``compiled`` once, without hooks, as a non-private evaluation would (same batch size
    as the first training step: its code would serve that step unchanged)."""
    compiled(batch(name, 8)[0])


def params(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["functorch", "ghost"])
def test_compiled_and_run_before_make_private(mode):
    model = build("mlp")
    compiled = torch.compile(model, backend="eager")
    warm(compiled)
    private, optimizer, criterion = make_private(model, mode, "mlp", module=compiled)
    steps(private, optimizer, criterion, "mlp")
    assert_same_training(params(model), eager_training("mlp", mode), initial("mlp"))


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_training_through_the_earlier_compiled_model(mode):
    """``make_private`` got the plain model; training calls the compiled one made before."""
    model = build("mlp")
    compiled = torch.compile(model, backend="eager")
    warm(compiled)
    _, optimizer, criterion = make_private(model, mode, "mlp")
    steps(compiled, optimizer, criterion, "mlp")
    assert_same_training(params(model), eager_training("mlp", mode), initial("mlp"))


@pytest.mark.parametrize("mode", ["ghost"])
def test_regionally_compiled_block_run_before(mode):
    model = build("cnn")
    model.conv.compile(backend="eager")
    model.norm.compile(backend="eager")
    warm(model, "cnn")
    private, optimizer, criterion = make_private(model, mode, "cnn")
    steps(torch.compile(private, backend="eager"), optimizer, criterion, "cnn")
    assert_same_training(params(model), eager_training("cnn", mode), initial("cnn"))


@pytest.mark.parametrize("mode", ["functorch", "bk"])
def test_another_instance_compiled_before(mode):
    """Dynamo reuses code across instances of a class: the other, hookless instance's code must
    not serve the private one."""
    warm(torch.compile(build("mlp"), backend="eager"))
    model = build("mlp")
    private, optimizer, criterion = make_private(model, mode, "mlp")
    steps(torch.compile(private, backend="eager"), optimizer, criterion, "mlp")
    assert_same_training(params(model), eager_training("mlp", mode), initial("mlp"))


def _hookless_step(mode: str) -> str:
    """In a fresh process (no code compiled by other tests): the outcome of a step whose forward
    ran compiled code without the hooks, the hook guards left off as in dynamo's default."""
    compiled_modules.guard_module_hooks = lambda: None
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):
        model = build("mlp")
        compiled = torch.compile(model, backend="eager")
        warm(compiled)
        _, optimizer, criterion = make_private(model, mode, "mlp")
        before = params(model)
        x, y = batch("mlp", 8)
        optimizer.zero_grad()
        criterion(compiled(x), y).backward()
    try:
        optimizer.step()
    except (RuntimeError, ValueError) as error:
        unchanged = all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        return f"refused: {error}" if unchanged else "refused after an update"
    return "stepped"


@pytest.mark.parametrize("mode", MODES)
def test_hookless_code_gets_no_private_step(mode):
    """The last line of defence: were the hook guards not turned on (as with dynamo's default),
    code compiled before wrapping would run without the hooks; the step is then refused and the
    parameters are left as they were."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        outcome = pool.apply(_hookless_step, (mode,))
    assert outcome.startswith("refused: ") and "per-sample gradient" in outcome, outcome