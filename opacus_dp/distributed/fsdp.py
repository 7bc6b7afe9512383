"""FSDP2 (``torch.distributed.fsdp.fully_shard``) models: detection, the sharding recipe, shard layout.

A model is *fully sharded* when its trainable parameters are ``DTensor`` shards managed by
``fully_shard`` modules (the usual recipe: each repeated block, then the root). DP-SGD then

* computes every per-sample norm and clipped sum on the rank that owns the sample, from the
  unsharded layer during its backward pass;
* reduce-scatters the clipped sums into the shards, one collective per ``fully_shard`` module
  (:mod:`~opacus_dp.distributed.reduce_scatter`);
* noises each rank's own shard only (:mod:`~opacus_dp.distributed.noise_streams`).

:func:`shard_model` applies the recipe of torch's FSDP2 documentation for a user who passes an
unsharded model (``make_private(..., fsdp=True)``), and :func:`rebind_optimizer` points the
optimizer at the sharded parameters (FSDP2 replaces every parameter by a new ``DTensor`` one).
"""

import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Type, Union

import torch
import torch.nn as nn

from opacus_dp.module_parameters import is_sharded_model as is_fully_sharded  # re-exported

try:  # FSDP2 is public from torch 2.6
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover - older torch
    FSDPModule = fully_shard = DTensor = Shard = None

FSDP_KWARGS = ("mesh", "reshard_after_forward", "mp_policy", "offload_policy")
FsdpOption = Union[bool, Dict[str, object]]


def fsdp_available() -> bool:
    """True if this torch has FSDP2's ``fully_shard``."""
    return fully_shard is not None


def fsdp_modules(module: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``(path, module)`` of every ``fully_shard`` module of ``module``, outermost first."""
    return [(path, m) for path, m in module.named_modules() if isinstance(m, FSDPModule)]


def parameter_groups(module: nn.Module) -> Dict[nn.Parameter, int]:
    """``{param: index}`` of the ``fully_shard`` module managing each parameter (the innermost
    one containing it): the groups FSDP communicates together, one collective each."""
    group_of: Dict[nn.Parameter, int] = {}
    for index, (_, owner) in enumerate(fsdp_modules(module)):
        for p in owner.parameters():
            group_of[p] = index  # inner modules come later and overwrite their parameters' entry
    return group_of


def shard_rows(param) -> Tuple[int, int, int]:
    """``(chunk_rows, local_rows, offset_rows)`` of this rank's shard of ``param`` (FSDP2's
    ``Shard(0)``: dim 0 padded to ``W · ⌈d₀/W⌉`` rows, rank ``r`` holds rows ``[r·c, (r+1)·c)``)."""
    mesh = param.device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    rows = param.shape[0] if param.dim() > 0 else 1
    chunk = math.ceil(rows / world)
    local = max(0, min(chunk, rows - rank * chunk))
    return chunk, local, rank * chunk


def check_sharded_parameters(params: Sequence[torch.Tensor], names: Dict[torch.Tensor, str],
                             group_of: Dict[nn.Parameter, int]) -> None:
    """Refuse a trainable tensor DP-SGD cannot reduce-scatter: not a ``fully_shard`` parameter,
    not ``Shard(0)`` on a 1-D mesh, or a local shard of another size than FSDP2's layout."""
    for p in params:
        name = names.get(p, f"<tensor of shape {tuple(p.shape)}>")
        if not isinstance(p, DTensor) or p not in group_of:
            raise ValueError(
                f"parameter {name} is not sharded by fully_shard although the model is: apply "
                "fully_shard to the root module too (after the blocks), as torch's FSDP2 recipe does, "
                "or pass make_private(..., fsdp=True) with the unsharded model")
        if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
            raise ValueError(
                f"parameter {name} is sharded as {tuple(p.placements)} on a {p.device_mesh.ndim}-D mesh: "
                "DP-SGD under FSDP2 supports Shard(0) on a 1-D mesh (no shard_placement_fn, no HSDP)")
        chunk, local, _ = shard_rows(p)
        if p.dim() > 0 and p.to_local().shape[0] != local:
            raise ValueError(f"parameter {name}: its local shard {tuple(p.to_local().shape)} is not "
                             f"FSDP2's even Shard(0) layout ({local} of {chunk} rows)")


def _blocks_of(model: nn.Module, blocks) -> List[nn.Module]:
    """The modules to shard on their own: those of the ``blocks`` classes, or by default the
    modules held in an ``nn.ModuleList`` (a transformer's layers) that train something; the
    outermost ones only (a block inside a block stays in its parent's unit)."""
    if blocks is not None:
        chosen = [m for m in model.modules() if m is not model and isinstance(m, tuple(blocks))]
    else:
        chosen = [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst
                  if any(p.requires_grad for p in m.parameters())]
    inner = {id(sub) for m in chosen for sub in m.modules() if sub is not m}
    return [m for m in chosen if id(m) not in inner]


def shard_model(model: nn.Module, *, blocks: Optional[Iterable[Type[nn.Module]]] = None,
                **fully_shard_kwargs) -> nn.Module:
    """Shard ``model`` in place as torch's FSDP2 documentation recommends: ``fully_shard`` on
    every block, then on the root; returns ``model``. ``blocks``: the block classes (default:
    the modules held in an ``nn.ModuleList``, e.g. a transformer's layers);
    ``fully_shard_kwargs``: ``mesh``, ``reshard_after_forward``, ``mp_policy``, ``offload_policy``."""
    if not fsdp_available():
        raise RuntimeError("fsdp=True needs torch.distributed.fsdp.fully_shard (torch >= 2.6)")
    unknown = sorted(set(fully_shard_kwargs) - set(FSDP_KWARGS))
    if unknown:
        raise ValueError(f"fsdp options {unknown} are not supported; use {list(FSDP_KWARGS)} "
                         "(and 'blocks': the block classes to shard on their own)")
    if is_fully_sharded(model):
        raise ValueError("fsdp=True was given a model already sharded with fully_shard: pass it "
                         "without fsdp=True (it is used as it is)")
    for block in _blocks_of(model, blocks):
        fully_shard(block, **fully_shard_kwargs)
    fully_shard(model, **fully_shard_kwargs)
    return model


def fsdp_options(option: FsdpOption) -> Optional[Dict[str, object]]:
    """``make_private``'s ``fsdp``: False → None; True → {}; a dict of :func:`shard_model` options."""
    if option is False or option is None:
        return None
    if option is True:
        return {}
    if isinstance(option, dict):
        return dict(option)
    raise TypeError(f"fsdp must be a bool or a dict of fully_shard options, got {type(option).__name__}")


def rebind_optimizer(optimizer: torch.optim.Optimizer, old_names: Dict[torch.Tensor, str],
                     model: nn.Module) -> torch.optim.Optimizer:
    """Point ``optimizer``'s parameter groups, in place, at ``model``'s sharded parameters, found by
    the names ``old_names`` gave the unsharded ones (a tensor already of ``model`` is kept); refused
    once the optimizer holds state. Returns ``optimizer``."""
    if any(len(s) for s in optimizer.state.values()):
        raise ValueError("fsdp=True needs an optimizer that has not stepped yet (its state would "
                         "refer to the unsharded parameters): create it before training")
    new_by_name = dict(model.named_parameters())
    current = {id(p) for p in new_by_name.values()}
    for group in optimizer.param_groups:
        missing = [old_names.get(p, "?") for p in group["params"]
                   if id(p) not in current and old_names.get(p) not in new_by_name]
        if missing:
            raise ValueError(f"optimizer parameters {missing} do not belong to the model that was sharded: "
                             "build the optimizer from model.parameters()")
        group["params"] = [p if id(p) in current else new_by_name[old_names[p]] for p in group["params"]]
    return optimizer
