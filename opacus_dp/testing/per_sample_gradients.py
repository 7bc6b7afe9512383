"""Opacus 1.x ``opacus.utils.per_sample_gradients_utils``: check a model's per-sample gradients
against the micro-batch oracle (one backward pass per sample), e.g. for a custom grad sampler.

The loss is ``L1Loss(output, 0)`` with the given reduction, as in Opacus. Inputs are tensors (or
tuples of tensors for several positional inputs); PackedSequence inputs are not supported here.
"""

import copy
from typing import Callable, Dict, Iterable, List, Union

import torch
import torch.nn as nn

from opacus_dp.grad_sample.mode_wrappers import wrap_model
from opacus_dp.compat.module_utils import trainable_parameters


def clone_module(module: nn.Module) -> nn.Module:
    """An independent deep copy of ``module``."""
    return copy.deepcopy(module)


def is_batch_empty(batch: Union[torch.Tensor, Iterable[torch.Tensor]]) -> bool:
    """True if the (first) tensor of ``batch`` has no element."""
    first = batch if torch.is_tensor(batch) else batch[0]
    return first.numel() == 0


class ModelWithLoss(nn.Module):
    """``module`` followed by ``L1Loss(output, zeros)`` (``loss_reduction`` "mean" or "sum")."""

    supported_reductions = ["mean", "sum"]

    def __init__(self, module: nn.Module, loss_reduction: str = "mean"):
        super().__init__()
        if loss_reduction not in self.supported_reductions:
            raise ValueError(f"loss_reduction must be one of {self.supported_reductions}, got {loss_reduction!r}")
        self.wrapped_module = module
        self.criterion = nn.L1Loss(reduction=loss_reduction)

    def forward(self, x):
        out = self.wrapped_module(*x) if isinstance(x, tuple) else self.wrapped_module(x)
        if isinstance(out, nn.utils.rnn.PackedSequence):
            raise TypeError("PackedSequence outputs are not supported by opacus_dp's ModelWithLoss")
        return self.criterion(out, torch.zeros_like(out))


def compute_microbatch_grad_sample(x, module: nn.Module, batch_first: bool = True, loss_reduction: str = "mean",
                                   chunk_method: Callable = iter) -> Dict[str, torch.Tensor]:
    """``{name: (B, *shape)}`` per-sample gradients from one backward pass per sample."""
    model = ModelWithLoss(clone_module(module), loss_reduction)
    if not batch_first and torch.is_tensor(x):
        x = x.transpose(0, 1)
    grads: Dict[str, List[torch.Tensor]] = {name: [] for name, _ in trainable_parameters(model.wrapped_module)}
    for x_i in chunk_method(x):
        model.zero_grad()
        if not isinstance(x_i, tuple):
            x_i = x_i.unsqueeze(0 if batch_first else 1)
        model(x_i).backward()
        for name, p in trainable_parameters(model.wrapped_module):
            grads[name].append(p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
    return {name: torch.stack(values, dim=0) for name, values in grads.items()}


def compute_opacus_grad_sample(x, module: nn.Module, batch_first: bool = True, loss_reduction: str = "mean",
                               grad_sample_mode: str = "hooks") -> Dict[str, torch.Tensor]:
    """``{name: (B, *shape)}`` per-sample gradients computed by opacus_dp (``grad_sample_mode``)."""
    clone = clone_module(module)
    wrapped = wrap_model(clone, grad_sample_mode, batch_first=batch_first, loss_reduction=loss_reduction)
    model = ModelWithLoss(wrapped, loss_reduction)
    model.zero_grad()
    model(x).backward()
    return {name: p.grad_sample for name, p in trainable_parameters(clone)}


def get_grad_sample_modes(use_ew: bool = False) -> List[str]:
    """The modes that materialise ``p.grad_sample`` ("ew", Opacus's expanded weights, is not
    one of opacus_dp's modes)."""
    return ["hooks", "functorch"]


def check_per_sample_gradients_are_correct(x, module: nn.Module, *, batch_first: bool = True, atol: float = 10e-6,
                                           rtol: float = 10e-5, grad_sample_mode: str = "hooks") -> bool:
    """True if opacus_dp's per-sample gradients of ``module`` on ``x`` match the micro-batch
    oracle for both loss reductions (``torch.allclose`` with ``atol``/``rtol``)."""
    if grad_sample_mode not in get_grad_sample_modes():
        raise ValueError(f"grad_sample_mode must be one of {get_grad_sample_modes()}, got {grad_sample_mode!r}")
    for reduction in ("sum", "mean"):
        expected = compute_microbatch_grad_sample(x, module, batch_first=batch_first, loss_reduction=reduction)
        got = compute_opacus_grad_sample(x, module, batch_first=batch_first, loss_reduction=reduction,
                                         grad_sample_mode=grad_sample_mode)
        if expected.keys() != got.keys() or not all(
                got[name] is not None and torch.allclose(expected[name], got[name], atol=atol, rtol=rtol)
                for name in expected):
            return False
    return True


__all__ = ["ModelWithLoss", "check_per_sample_gradients_are_correct", "clone_module", "compute_microbatch_grad_sample",
           "compute_opacus_grad_sample", "get_grad_sample_modes", "is_batch_empty"]
