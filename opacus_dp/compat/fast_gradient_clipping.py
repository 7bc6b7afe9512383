"""Opacus 1.6's ``DPLossFastGradientClipping`` (see
:mod:`opacus_dp.grad_sample.grad_sample_module_fast_gradient_clipping`)."""

from opacus_dp.grad_sample.bookkeeping.ghost_criterion import GhostCriterion, GhostLoss, StepClipping
from opacus_dp.grad_sample.bookkeeping.module import BookkeepingGradSampleModule
from opacus_dp.optim.dp_optimizer import DPOptimizer

DPTensorFastGradientClipping = GhostLoss  # the loss whose backward() runs the two passes

__all__ = ["DPLossFastGradientClipping", "DPTensorFastGradientClipping"]


class DPLossFastGradientClipping(GhostCriterion):
    """``criterion`` whose losses run the two-pass ghost backward of ``module`` and clip with
    ``optimizer``'s bound; connects ``optimizer`` to ``module``'s per-sample norms.

    Refused: a module that is not a norms-only wrapper, an optimizer that is not a DPOptimizer,
    loss reductions that disagree, and a module bound other than the optimizer's (the noise is
    calibrated to the optimizer's)."""

    def __init__(self, module, optimizer, criterion, loss_reduction: str = "mean"):
        if not isinstance(module, BookkeepingGradSampleModule) or not module.supports_two_passes:
            raise TypeError("module must be a GradSampleModuleFastGradientClipping (or the model "
                            f"make_private(..., grad_sample_mode='ghost') returns), got {type(module).__name__}")
        if not isinstance(optimizer, DPOptimizer):
            raise TypeError(f"optimizer must be a DPOptimizerFastGradientClipping, got {type(optimizer).__name__}")
        reductions = {"loss_reduction": loss_reduction, "module.loss_reduction": module.loss_reduction,
                      "optimizer.loss_reduction": optimizer.loss_reduction}
        if len(set(reductions.values())) > 1:
            raise ValueError(f"the loss reductions disagree ({reductions}): use the same 'mean' or 'sum' everywhere")
        bound = getattr(module, "max_grad_norm", optimizer.max_grad_norm)
        if bound != optimizer.max_grad_norm:
            raise ValueError(
                f"module.max_grad_norm={bound} but optimizer.max_grad_norm={optimizer.max_grad_norm}: the "
                "samples would be clipped to one bound and the noise calibrated to the other; pass the "
                "same max_grad_norm to both")
        if optimizer.grad_source is not module:  # first connection: a pass seen before it is not private
            optimizer.connect_grad_source(module)
            optimizer.grad_source.clear(optimizer.params)
        clipping = StepClipping(params=lambda: optimizer.params, clip_factors=optimizer.clip_factors)
        super().__init__(criterion, loss_reduction, module=module, clipping=clipping)
