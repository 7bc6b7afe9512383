"""Pieces and per-example losses of one logical batch, for :mod:`opacus_dp.integrations.transformers`.

A logical batch is one Poisson sample (one private step). It reaches the training step as one
mapping of tensors whose first dimension holds the examples, and is cut into physical pieces of
at most ``per_device_train_batch_size`` rows (the layout of :func:`~opacus_dp.data.batch_memory_manager.split_indices`:
``k = max(1, ⌈n/b⌉)`` consecutive pieces whose sizes differ by at most one). An empty batch
gives one empty piece, so its step (noise only) is still taken and accounted.

The loss of a piece is the mean of per-example losses ``ℓ_i``, so that each example's gradient
``∇ℓ_i`` depends on that example alone. Hugging Face models average the loss over every token of
the batch instead, which makes an example's gradient depend on how many tokens the others have.
"""

from typing import Any, Callable, List, Mapping, Optional

import torch
import torch.nn.functional as F

from opacus_dp.data.batch_memory_manager import split_indices

IGNORE_INDEX = -100  # label of positions without a loss (padding, prompts), as in transformers

PerExampleLoss = Callable[[Any, torch.Tensor], torch.Tensor]


def batch_size_of(inputs: Mapping[str, Any]) -> int:
    """Number of rows of the logical batch (the first dimension of its tensors)."""
    sizes = {int(v.shape[0]) for v in inputs.values() if torch.is_tensor(v) and v.dim() > 0}
    if len(sizes) != 1:
        shapes = {k: tuple(v.shape) for k, v in inputs.items() if torch.is_tensor(v)}
        raise ValueError(f"DPTrainer: the batch's tensors must share their first (example) dimension, got {shapes}; "
                         "make the data collator return one row per example")
    return sizes.pop()


def pieces(inputs: Mapping[str, Any], max_rows: int) -> List[dict]:
    """The physical pieces of ``inputs`` (tensors and per-example lists sliced by rows)."""
    n = batch_size_of(inputs)
    result = []
    for chunk in split_indices(list(range(n)), max_rows):
        start, end = (chunk[0], chunk[-1] + 1) if chunk else (0, 0)
        result.append({k: _rows(v, start, end, n) for k, v in inputs.items()})
    return result


def _rows(value, start: int, end: int, n: int):
    if torch.is_tensor(value) and value.dim() > 0:
        return value[start:end]
    if isinstance(value, list) and len(value) == n:
        return value[start:end]
    return value


def per_example_loss(outputs, labels: torch.Tensor, *, shift: bool,
                     attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``ℓ_i`` for each row, in float32.

    * token logits ``[n, T, V]``: mean cross-entropy over the row's positions whose label is not
      ``-100`` (``shift``: a causal LM, position ``t`` predicts label ``t+1``, and only from an input
      that is not padding, ``attention_mask`` 1: a left-padded row's first token, predicted from
      padding only when a longer row is in the batch, would tie the row's loss to the others); 0
      for a row without such positions;
    * ``[n, 1]`` logits with float labels: squared error (regression);
    * ``[n, K]`` logits with float labels of the same shape: mean binary cross-entropy (multi-label);
    * ``[n, K]`` logits with integer labels: cross-entropy.
    """
    logits = (outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]).float()
    if logits.dim() == 3:
        if shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
            if attention_mask is not None:  # the inputs of a causal LM are its labels' positions
                labels = labels.masked_fill(attention_mask[:, :-1] == 0, IGNORE_INDEX)
        losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                 ignore_index=IGNORE_INDEX, reduction="none").view(labels.shape)
        counted = (labels != IGNORE_INDEX).sum(dim=1).clamp(min=1)
        return losses.sum(dim=1) / counted
    if labels.is_floating_point():
        if logits.shape[-1] == 1 and labels.dim() == 1:
            return (logits.squeeze(-1) - labels.float()) ** 2
        return F.binary_cross_entropy_with_logits(logits, labels.float(), reduction="none").mean(dim=1)
    return F.cross_entropy(logits, labels.view(-1), reduction="none")


def piece_losses(model, piece: dict, *, shift: bool, loss_fn: Optional[PerExampleLoss]) -> torch.Tensor:
    """Forward ``piece`` through ``model`` (without its labels) and return ``ℓ_i`` per row."""
    piece = dict(piece)
    if "labels" not in piece:
        raise ValueError("DPTrainer: the batch has no 'labels'; the private step needs one loss per example "
                         "(make the data collator return labels)")
    labels = piece.pop("labels")
    mask = piece.get("attention_mask")
    mask = mask if torch.is_tensor(mask) and mask.shape == labels.shape else None  # one entry per token
    outputs = model(**piece)
    losses = loss_fn(outputs, labels) if loss_fn is not None else \
        per_example_loss(outputs, labels, shift=shift, attention_mask=mask)
    if losses.dim() != 1 or losses.shape[0] != labels.shape[0]:
        raise ValueError(f"DPTrainer: per_example_loss must return one loss per example (shape [{labels.shape[0]}]), "
                         f"got shape {tuple(losses.shape)}")
    return losses
