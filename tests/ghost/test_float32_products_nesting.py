"""Blocks of ``ieee_float32_products`` inside one another (``maths.float32_products``): an inner
block switches only what its thread's outer block left, and every product that decides a clip —
the ghost norms in the backward pass, the clipped sums and the summed per-sample gradients at the
step — still runs with IEEE float32 settings under a user's reduced precision.

These tests read the settings, so they run on any CPU (whether the CPU honours a reduced
precision is what ``test_float32_products.py``'s end-to-end checks need)."""

import threading

import pytest
import torch
from opacus_dp.grad_sample.bookkeeping import pass_sums
from opacus_dp.grad_sample.bookkeeping.norm_samplers import linear as linear_norms
from opacus_dp.maths import float32_products
from opacus_dp.maths.float32_products import FULL_PRECISION, ieee_float32_products
from tests.ghost.test_float32_products import _restore_precision  # noqa: F401 (autouse fixture)
from tests.precision.helpers import mlp, private, squared_error

pytestmark = [pytest.mark.skipif(not float32_products._precision_settings(), reason="torch < 2.9: legacy settings"),
              pytest.mark.filterwarnings("ignore:secure_mode")]

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _values(settings):
    return [s.fp32_precision for s in settings]


@pytest.fixture
def switches(monkeypatch):
    """The calls of ``_switch_to_ieee`` (its ``cpu_only`` argument), still switching."""
    calls, original = [], float32_products._switch_to_ieee

    def counted(cpu_only=False):
        calls.append(cpu_only)
        return original(cpu_only)

    monkeypatch.setattr(float32_products, "_switch_to_ieee", counted)
    return calls


def test_an_inner_block_switches_only_what_the_outer_one_left(switches):
    torch.set_float32_matmul_precision("medium")
    everything = float32_products._precision_settings()
    on_cpu = float32_products._precision_settings(cpu_only=True)
    before = _values(everything)
    assert "bf16" in _values(on_cpu)
    with ieee_float32_products(CPU):
        assert switches == [True]
        with ieee_float32_products(CPU):  # covered: nothing read or switched
            assert switches == [True]
            assert all(v in FULL_PRECISION for v in _values(on_cpu))
        assert all(v in FULL_PRECISION for v in _values(on_cpu))  # the inner exit restored nothing
        with ieee_float32_products(CUDA):  # wider: every setting, the CUDA ones restored after
            assert switches == [True, False]
            assert all(v in FULL_PRECISION for v in _values(everything))
        assert all(v in FULL_PRECISION for v in _values(on_cpu))
        assert [v for s, v in zip(everything, before) if s not in on_cpu] == [
            s.fp32_precision for s in everything if s not in on_cpu]
        with ieee_float32_products(CUDA):  # the level the CUDA block set is gone with it
            assert switches == [True, False, False]
    assert _values(everything) == before
    with ieee_float32_products(CPU):  # a new outer block switches again
        assert switches[-1] is True and len(switches) == 4
    assert _values(everything) == before


def test_an_error_inside_restores_the_settings_and_the_level(switches):
    torch.set_float32_matmul_precision("medium")
    before = _values(float32_products._precision_settings())
    with pytest.raises(RuntimeError, match="boom"):
        with ieee_float32_products(CPU):
            raise RuntimeError("boom")
    assert _values(float32_products._precision_settings()) == before
    with ieee_float32_products(CPU):
        assert len(switches) == 2  # not taken as still covered


def test_a_block_on_another_thread_is_not_covered_by_this_threads_block(switches):
    torch.set_float32_matmul_precision("medium")
    seen = []

    def other():
        with ieee_float32_products(CPU):
            seen.append(len(switches))

    with ieee_float32_products(CPU):
        thread = threading.Thread(target=other)
        thread.start()
        thread.join(timeout=30)
    assert seen == [2]  # the other thread read and (where needed) switched the settings itself


class _Spy:
    """Wraps a module's function, recording oneDNN's settings at each call."""

    def __init__(self, monkeypatch, module, name):
        self.settings, original = [], getattr(module, name)

        def spied(*args, **kwargs):
            self.settings.append(_values(float32_products._precision_settings(cpu_only=True)))
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, spied)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_norms_and_clipped_sums_run_with_ieee_settings_under_reduced_precision(mode, monkeypatch):
    """A ghost layer (norms at the backward pass, its sum at the step) and a materialised bias
    (its per-sample gradients summed at the step): every product with oneDNN's settings IEEE."""
    norms = _Spy(monkeypatch, linear_norms, "gram_sq_norms")
    sums = _Spy(monkeypatch, linear_norms, "matrix_product")  # the clipped sum's product
    per_sample = _Spy(monkeypatch, pass_sums, "weighted_sum")  # called inside the step's block
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    _, model, optimizer, criterion = private(mlp(), x, y, mode=mode)
    criterion = criterion or squared_error
    torch.set_float32_matmul_precision("medium")
    before = _values(float32_products._precision_settings(cpu_only=True))
    assert "bf16" in before
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()
    assert len(norms.settings) == 2 and len(sums.settings) == 2 and len(per_sample.settings) == 2
    for recorded in (norms.settings, sums.settings, per_sample.settings):
        assert all(v in FULL_PRECISION for values in recorded for v in values), recorded
    assert _values(float32_products._precision_settings(cpu_only=True)) == before
