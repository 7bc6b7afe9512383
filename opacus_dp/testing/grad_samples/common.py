"""``GradSampleHooks_test``: a ``unittest.TestCase`` base that checks a layer's per-sample
gradients against the micro-batch oracle, with the class and method names of Opacus's
``opacus.tests.grad_samples.common`` that third-party grad-sampler tests subclass.

The oracle: for the loss ``L = L1Loss(reduction)(module(x), 0)``, sample ``i``'s gradient is the
gradient of ``L1Loss(reduction)(module(x_i), 0)`` on the batch of one ``x_i`` (one backward pass
per sample). The library's per-sample gradients of the whole batch must equal it,
``grad_sample_i = oracle_i``, for both reductions: with ``loss_reduction="mean"`` the library
undoes the batch mean's factor ``1/B`` on each sample, as Opacus does.
"""

import unittest
from typing import Callable, Dict, Tuple, Union

import torch
import torch.nn as nn
from torch.nn.utils.rnn import PackedSequence

from opacus_dp.testing.per_sample_gradients import (compute_microbatch_grad_sample, compute_opacus_grad_sample,
                                                        is_batch_empty)

GradSamples = Dict[str, torch.Tensor]


def expander(x: int, factor: int = 2) -> int:
    """``x · factor``: a layer size grown from an input size in parametrised tests."""
    return x * factor


def shrinker(x: int, factor: int = 2) -> int:
    """``max(1, x // factor)``: a layer size shrunk from an input size, never 0."""
    return max(1, x // factor)


def compute_grad_samples_microbatch_and_opacus(
        x: Union[torch.Tensor, Tuple[torch.Tensor, ...]], module: nn.Module, batch_first: bool = True,
        loss_reduction: str = "mean", grad_sample_mode: str = "hooks",
        chunk_method: Callable = iter) -> Tuple[GradSamples, GradSamples]:
    """``(oracle, library)`` per-sample gradients ``{name: (B, *shape)}`` of ``module`` on ``x``.

    Both are computed on copies of ``module`` under ``torch.manual_seed(0)``, inside
    ``torch.random.fork_rng`` so the caller's global RNG is left as it was.
    """
    if isinstance(x, PackedSequence):
        raise NotImplementedError("x: PackedSequence inputs are not supported by the micro-batch helpers; "
                                  "pass a padded tensor")
    if is_batch_empty(x):
        raise RuntimeError("x is an empty batch: the micro-batch oracle needs at least one sample")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        oracle = compute_microbatch_grad_sample(x, module, batch_first=batch_first, loss_reduction=loss_reduction,
                                                chunk_method=chunk_method)
        torch.manual_seed(0)
        library = compute_opacus_grad_sample(x, module, batch_first=batch_first, loss_reduction=loss_reduction,
                                             grad_sample_mode=grad_sample_mode)
    if oracle.keys() != library.keys():
        raise ValueError(f"parameter names differ: only in the micro-batch oracle {sorted(oracle.keys() - library)}, "
                         f"only in the library {sorted(library.keys() - oracle)}")
    return oracle, library


def _grad_sample_modes(x, module: nn.Module, batch_first: bool, ew_compatible: bool):
    """"hooks" and "functorch"; only "hooks" for ``EmbeddingBag`` or an empty batch; plus
    Opacus's "ew" (which runs "hooks" here) when ``ew_compatible`` and ``batch_first``."""
    packed = isinstance(x, PackedSequence)
    modes = ["hooks"] if type(module) is nn.EmbeddingBag or (not packed and is_batch_empty(x)) else [
        "hooks", "functorch"]
    if ew_compatible and batch_first:
        modes.append("ew")
    return modes


def _report(failures, what: str, loss_reduction: str) -> None:
    if failures:
        lines = "\n\t".join(f"{i}. {msg}" for i, msg in enumerate(failures, 1))
        raise AssertionError(f"A total of {len(failures)} {what} do not match "
                             f"for loss_reduction={loss_reduction}: \n\t{lines}")


class GradSampleHooks_test(unittest.TestCase):  # noqa: N801 (Opacus's name, subclassed by user tests)
    """Subclass it and call ``self.run_test(x, module, ...)`` from a test method."""

    def run_test(self, x, module: nn.Module, batch_first: bool = True, atol: float = 10e-6, rtol: float = 10e-5,
                 ew_compatible: bool = True, chunk_method: Callable = iter) -> None:
        """Both loss reductions × every applicable grad-sample mode, each as a ``subTest``."""
        for loss_reduction in ("sum", "mean"):
            for mode in _grad_sample_modes(x, module, batch_first, ew_compatible):
                with self.subTest(grad_sample_mode=mode, loss_reduction=loss_reduction):
                    self.run_test_with_reduction(x, module, batch_first=batch_first, loss_reduction=loss_reduction,
                                                 atol=atol, rtol=rtol, grad_sample_mode=mode,
                                                 chunk_method=chunk_method)

    def run_test_with_reduction(self, x, module: nn.Module, batch_first: bool = True, loss_reduction: str = "mean",
                                atol: float = 10e-6, rtol: float = 10e-5, grad_sample_mode: str = "hooks",
                                chunk_method: Callable = iter) -> None:
        """One reduction and mode; an empty batch only checks that the library runs on it."""
        if not isinstance(x, PackedSequence) and is_batch_empty(x):
            compute_opacus_grad_sample(x, module, batch_first=batch_first, loss_reduction=loss_reduction,
                                       grad_sample_mode=grad_sample_mode)
            return
        oracle, library = compute_grad_samples_microbatch_and_opacus(
            x, module, batch_first=batch_first, loss_reduction=loss_reduction, grad_sample_mode=grad_sample_mode,
            chunk_method=chunk_method)
        self.check_shapes(oracle, library, loss_reduction)
        self.check_values(oracle, library, loss_reduction, atol, rtol)

    def check_shapes(self, microbatch_grad_samples: GradSamples, opacus_grad_samples: GradSamples,
                     loss_reduction: str) -> None:
        """AssertionError listing every parameter whose two shapes differ."""
        failures = [f"Param '{name}': from library {tuple(got.shape)}, from micro-batch "
                    f"{tuple(microbatch_grad_samples[name].shape)}"
                    for name, got in opacus_grad_samples.items() if got.shape != microbatch_grad_samples[name].shape]
        _report(failures, "shapes", loss_reduction)

    def check_values(self, microbatch_grad_samples: GradSamples, opacus_grad_samples: GradSamples,
                     loss_reduction: str, atol: float, rtol: float) -> None:
        """AssertionError listing every parameter where ``torch.testing.assert_close`` fails."""
        failures = []
        for name, got in opacus_grad_samples.items():
            want = microbatch_grad_samples[name]
            try:
                torch.testing.assert_close(actual=want, expected=got, atol=atol, rtol=rtol)
            except AssertionError:
                diff = (got - want).abs()
                failures.append(f"Param {name}: library L2 norm {got.norm(2):.6g}, micro-batch L2 norm "
                                f"{want.norm(2):.6g}, max abs difference {diff.max():.3g}")
        _report(failures, "values", loss_reduction)


__all__ = ["GradSampleHooks_test", "compute_grad_samples_microbatch_and_opacus", "expander", "shrinker"]
