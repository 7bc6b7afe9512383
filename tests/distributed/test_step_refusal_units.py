"""In-process checks of the refusal encoding and the step timeout (a one-process gloo group)."""

import datetime

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.distributed import AllReduceReducer, DPDDP, StepRefusedError
from opacus_dp.distributed.step_wait import step_bounds, timeout_seconds
from opacus_dp.errors import (LogicalBatchOverflowError, NonFiniteNormError, PoissonBatchMergeError,
                              PrivacyBudgetExceededError)
from opacus_dp.optim import DPOptimizer
from opacus_dp.optim.reduction import StepRelease
from opacus_dp.optim.step_refusal import (
    BUDGET, NON_FINITE, OTHER, POISSON_MERGE, TOO_MANY_SAMPLES, reason_code, refused_elsewhere)


def test_step_timeout_accepts_seconds_and_timedeltas_only():
    assert timeout_seconds(3) == 3.0 and timeout_seconds(datetime.timedelta(milliseconds=1500)) == 1.5
    assert timeout_seconds(None) is None
    for bad in (0, -1, float("inf"), float("nan"), datetime.timedelta(0)):
        with pytest.raises(ValueError, match="step_timeout"):
            timeout_seconds(bad)
    for bad in ("3", True):
        with pytest.raises(TypeError, match="step_timeout"):
            timeout_seconds(bad)


def test_step_bounds_end_before_the_group_timeout(group):
    assert step_bounds(3.0) == (3.0, 1.0)  # wait 3 s, then 1 s for the other ranks' tokens
    assert step_bounds(None) == (24.0, 3.0)  # the group's 30 s, less room for the tokens
    assert step_bounds(600.0) == (24.0, 3.0)  # never past the group's own timeout
    assert AllReduceReducer(step_timeout=datetime.timedelta(seconds=2)).step_timeout == 2.0


def test_reason_codes_are_declared_by_the_error_types_never_read_from_messages():
    assert reason_code(PrivacyBudgetExceededError("privacy budget exhausted")) == BUDGET
    assert reason_code(NonFiniteNormError("x")) == NON_FINITE
    assert reason_code(PoissonBatchMergeError("x")) == POISSON_MERGE
    assert reason_code(LogicalBatchOverflowError("x")) == TOO_MANY_SAMPLES
    assert reason_code(RuntimeError("anything else")) == OTHER
    # the words of a message decide nothing: a reworded or look-alike message keeps its type's reason
    assert reason_code(ValueError("non-finite (NaN or inf) per-sample gradient norm in x")) == OTHER
    assert reason_code(NonFiniteNormError("reworded")) == NON_FINITE
    error = refused_elsewhere({1: BUDGET, 3: NON_FINITE})
    assert isinstance(error, PrivacyBudgetExceededError) and error.refusals == {1: BUDGET, 3: NON_FINITE}
    assert "ranks 1, 3 refused this step" in str(error) and "rank 3: non-finite" in str(error)
    assert not isinstance(refused_elsewhere({1: NON_FINITE}), PrivacyBudgetExceededError)


def test_a_refusal_is_raised_by_the_settings_rows(group):
    """One process checks its own row as the table (nothing is sent); on several ranks the rows
    ride in the sums' all-reduce without extra bytes (tests/distributed/test_ddp.py counts them)."""
    reducer = AllReduceReducer()
    sums = [torch.ones(3, dtype=torch.float64)]
    reducer.reduce(StepRelease(sums, agreed={"a": 1.0, "b": 2.0}))
    with pytest.raises(StepRefusedError) as refused:
        reducer.reduce(StepRelease([torch.zeros(3, dtype=torch.float64)], agreed={"a": 1.0, "b": 2.0},
                                   refusal=NON_FINITE))
    assert refused.value.refusals == {0: NON_FINITE}
    assert reducer.bytes_reduced == 0 and reducer.num_all_reduces == 0
    with pytest.raises(ValueError, match="rows of agreed"):
        reducer.reduce(StepRelease(sums, refusal=NON_FINITE))


def _nan_step(model, optimizer):
    x = torch.randn(4, 3)
    x[0, 0] = float("nan")
    nn.CrossEntropyLoss()(model(x), torch.zeros(4, dtype=torch.long)).backward()
    optimizer.step()


def test_one_process_raises_as_before_without_any_note(group):
    """World size 1 (also behind DPDDP): the local error itself, unchanged."""
    with pytest.warns(UserWarning):
        engine = PrivacyEngine(accountant="rdp")
    data = TensorDataset(torch.randn(8, 3), torch.zeros(8, dtype=torch.long))
    module = DPDDP(nn.Linear(3, 2), step_timeout=5)
    model, optimizer, _ = engine.make_private(
        module=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=4), noise_multiplier=0.0, max_grad_norm=1.0,
        step_timeout=2)
    assert isinstance(optimizer, DPOptimizer) and optimizer.reducer.world_size == 1
    assert optimizer.reducer.step_timeout == 2.0  # make_private's overrides the wrapper's
    optimizer.non_finite_samples = "refuse"  # the debugging switch: a non-finite sample raises
    with pytest.raises(ValueError, match="non-finite") as error:
        _nan_step(model, optimizer)
    assert not isinstance(error.value, StepRefusedError)
    assert not getattr(error.value, "__notes__", None)
    assert optimizer.steps_taken == 0 and len(engine.accountant) == 0


def test_make_private_checks_step_timeout_without_a_process_group():
    with pytest.warns(UserWarning):
        engine = PrivacyEngine(accountant="rdp")
    model = nn.Linear(3, 2)
    data = TensorDataset(torch.randn(8, 3), torch.zeros(8, dtype=torch.long))
    with pytest.raises(TypeError, match="step_timeout"):
        engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            data_loader=DataLoader(data, batch_size=4), noise_multiplier=0.0,
                            max_grad_norm=1.0, step_timeout="soon")
