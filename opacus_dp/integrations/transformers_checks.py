"""What :class:`~opacus_dp.integrations.transformers.DPTrainer` refuses up front: ``TrainingArguments``
it cannot train with (``fp16``'s loss scaling, NEFTune's noise scaled by the batch's padded length,
...), and optimizers (the ``Trainer``'s, from ``optim``, or the user's, from
``optimizers=(optimizer, scheduler)``) that the private step cannot drive.

The private step wraps the optimizer: per-example clipping, noise, then the optimizer's own
``step()`` on the private gradient, once per logical batch (the learning-rate scheduler, which
changes the shared ``param_groups``, steps once per logical batch too). It cannot drive:

* optimizers that update parameters during the backward pass from their raw gradients, before
  any clipping or noise: LOMO / AdaLomo (``optim="lomo"``, ``"adalomo"``) and the layer-wise
  optimizers (``optim="*_layerwise"``, a step per parameter in a gradient hook);
* optimizers with ``train()``/``eval()`` modes (schedule-free ones): the ``Trainer`` switches
  them through the private optimizer, which does not forward the call;
* an optimizer that is already private (made by ``make_private``): give the plain one;
* an object that is not a ``torch.optim.Optimizer``, or one over tensors that are not the
  model's trainable parameters (their per-example gradients do not exist).
"""

import torch
import torch.distributed as dist
from transformers import TrainingArguments

from opacus_dp.optim.wrapped_optimizer import WrappedOptimizer

FUSED_UPDATES = ("lomo", "adalomo")  # the update happens inside backward


def optim_name(args: TrainingArguments) -> str:
    return str(getattr(args.optim, "value", args.optim)).lower()


def refuse_unsupported(args: TrainingArguments) -> None:
    """Refuse ``TrainingArguments`` that DPTrainer cannot train with (module doc)."""
    name = optim_name(args)
    refusals = {
        "several GPUs in one process (nn.DataParallel)": args.n_gpu > 1,
        "DeepSpeed": bool(args.deepspeed),
        "FSDP": bool(args.fsdp),
        "auto_find_batch_size": bool(args.auto_find_batch_size),
    }
    found = [reason for reason, present in refusals.items() if present]
    processes = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if processes != args.world_size:
        raise ValueError(f"DPTrainer: torch.distributed runs {processes} processes but TrainingArguments sees "
                         f"world_size={args.world_size}, so each process would train alone; on CPUs pass "
                         "TrainingArguments(use_cpu=True) under torchrun")
    if found:
        raise ValueError(f"DPTrainer does not support {', '.join(found)}: train on one device per process "
                         "(CUDA_VISIBLE_DEVICES=0, or torchrun for several), with auto_find_batch_size=False")
    if name in FUSED_UPDATES or name.endswith("layerwise"):
        raise ValueError(
            f"DPTrainer does not support optim={name!r}: it updates each parameter during the backward pass "
            "from its raw gradient, before per-example clipping and noise. Choose an optimizer that steps "
            "once per batch (optim='adamw_torch', 'sgd', 'adafactor', ...)")
    if name.startswith("schedule_free"):
        raise ValueError(f"DPTrainer does not support optim={name!r}: {_MODES}")
    if getattr(args, "neftune_noise_alpha", None):
        raise ValueError(f"DPTrainer does not support neftune_noise_alpha={args.neftune_noise_alpha}: NEFTune scales "
                         "its embedding noise by the padded length of the batch, so one example's gradient would "
                         "depend on the lengths of the others. Leave neftune_noise_alpha=None")
    if getattr(args, "label_smoothing_factor", 0):
        raise ValueError(f"DPTrainer: label_smoothing_factor={args.label_smoothing_factor} would not be applied: "
                         f"the private step trains on one loss per example. {_OWN_LOSS}")


def refuse_loss_scaling(args: TrainingArguments, accelerator) -> None:
    """Refuse ``fp16=True`` (Accelerate's ``GradScaler``): Accelerate calls the private step through
    a wrapper that hides its ``grad_scaler`` argument, so the step cannot undo the loss scale
    (:mod:`~opacus_dp.optim.amp_scaling`) and fails, nor could the pieces of a logical batch."""
    if args.fp16 or getattr(accelerator, "scaler", None) is not None:
        raise ValueError("DPTrainer does not support fp16=True (float16 with Accelerate's GradScaler): the private "
                         "step would see the loss scale in each example's gradient. Use bf16=True (no loss "
                         "scaling), or write the loop with make_private and torch.amp.GradScaler (docs/precision.md)")


def refuse_trainer_loss(compute_loss_func) -> None:
    """Refuse the Trainer's ``compute_loss_func``: it returns one loss for the whole batch, from
    which no per-example gradient follows."""
    if compute_loss_func is not None:
        raise ValueError(f"DPTrainer: compute_loss_func would not be called: it returns one loss for the batch, "
                         f"and the private step needs one loss per example. {_OWN_LOSS}")


_OWN_LOSS = ("Pass DPTrainer(..., per_example_loss=f) with f(outputs, labels) returning a tensor of one loss per "
             "example (label smoothing: F.cross_entropy(..., label_smoothing=s, reduction='none') averaged per row)")


_MODES = ("schedule-free optimizers need the Trainer's optimizer.train()/eval() calls, which the private "
          "optimizer wrapping them does not forward. Choose an optimizer without modes (optim='adamw_torch', ...)")


def check_optimizer(optimizer, model: torch.nn.Module) -> None:
    """Refuse an optimizer the private step cannot drive (module doc)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("DPTrainer: the optimizer (Trainer(optimizers=(optimizer, scheduler))) must be a "
                        f"torch.optim.Optimizer over the model's parameters, got {type(optimizer).__name__}")
    if isinstance(optimizer, WrappedOptimizer):
        raise ValueError("DPTrainer: the optimizer is already private (a DPOptimizer from make_private); pass "
                         "the plain torch.optim optimizer: DPTrainer makes it private")
    if type(optimizer).__name__ in ("Lomo", "AdaLomo", "LayerWiseDummyOptimizer"):
        raise ValueError(f"DPTrainer does not support {type(optimizer).__name__}: it updates parameters during the "
                         "backward pass from their raw gradients, before per-example clipping and noise")
    if callable(getattr(optimizer, "train", None)) or callable(getattr(optimizer, "eval", None)):
        raise ValueError(f"DPTrainer does not support {type(optimizer).__name__}: {_MODES}")
    own = {id(p) for p in model.parameters() if p.requires_grad}
    foreign = sum(1 for group in optimizer.param_groups for p in group["params"]
                  if p.requires_grad and id(p) not in own)
    if foreign:
        raise ValueError(f"DPTrainer: the optimizer holds {foreign} trainable tensors that are not trainable "
                         "parameters of the model, so they have no per-example gradients; build it on "
                         "model.parameters() of the model given to DPTrainer")
