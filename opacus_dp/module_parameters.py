"""Which parameters a module owns and trains. A leaf module.

"Owns" means the module's own parameter table (``named_parameters(recurse=False)``), read
directly: the hooks call these at every layer call.

**Canonical parameters.** FSDP2 (``fully_shard``) swaps a module's parameters between the
sharded ``DTensor`` (the one the optimizer holds, registered outside forward/backward) and an
unsharded plain tensor (registered while the module runs). A per-sample wrapper registers the
sharded tables once (:func:`register_canonical`); from then on :func:`own_parameters` answers
with the canonical (sharded) tensor of each name, whichever tensor the module holds at that
moment, and :func:`to_canonical` / :func:`to_live` re-key the results of the per-layer rules,
which key by the tensor the layer holds while it runs. Modules never registered are untouched.
"""

import weakref
from typing import Dict, List, Tuple

import torch
import torch.nn as nn

try:  # FSDP2 (torch >= 2.6)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - older torch
    FSDPModule = DTensor = None

_CANONICAL: "weakref.WeakKeyDictionary[nn.Module, Dict[str, nn.Parameter]]" = weakref.WeakKeyDictionary()


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor`` (checks on it must not become collectives that only some
    ranks enter), else ``tensor`` itself."""
    if DTensor is not None and isinstance(tensor, DTensor):
        return tensor.to_local()
    return tensor


def is_sharded_model(model: nn.Module) -> bool:
    """True if ``model`` or a submodule was passed to FSDP2's ``fully_shard``."""
    return any(is_fsdp_module(m) for m in model.modules())


def is_fsdp_module(module: nn.Module) -> bool:
    """True if ``module`` itself was passed to FSDP2's ``fully_shard``."""
    return FSDPModule is not None and isinstance(module, FSDPModule)


def register_canonical_if_sharded(model: nn.Module) -> bool:
    """:func:`register_canonical` for a model sharded with FSDP2; returns whether it is."""
    sharded = is_sharded_model(model)
    if sharded:
        register_canonical(model)
    return sharded


def register_canonical(model: nn.Module) -> None:
    """Record, for every submodule of ``model`` owning parameters, its current parameter table
    as the canonical one (call it while no forward/backward runs, e.g. right after sharding)."""
    for module in model.modules():
        table = {n: p for n, p in module._parameters.items() if p is not None}
        if table:
            _CANONICAL[module] = table


def forget_canonical(model: nn.Module) -> None:
    """Undo :func:`register_canonical` for ``model``'s submodules."""
    for module in model.modules():
        _CANONICAL.pop(module, None)


def _canonical_by_live(module: nn.Module):
    """``{id(live tensor): canonical tensor}`` for a registered module whose table differs now, else None."""
    table = _CANONICAL.get(module) if _CANONICAL else None
    if table is None:
        return None
    live = module._parameters
    if all(live.get(n) is p for n, p in table.items()):
        return None
    return {id(live[n]): p for n, p in table.items() if live.get(n) is not None}


def holds_canonical(module: nn.Module) -> bool:
    """True unless ``module`` is registered and now holds other tensors (FSDP2: unsharded)."""
    return _canonical_by_live(module) is None


def to_canonical(module: nn.Module, by_tensor: Dict[torch.Tensor, object]) -> Dict[torch.Tensor, object]:
    """``by_tensor`` (keyed by the tensors ``module`` holds now) keyed by the canonical ones."""
    mapping = _canonical_by_live(module)
    if mapping is None:
        return by_tensor
    return {mapping.get(id(t), t): v for t, v in by_tensor.items()}


def to_live(module: nn.Module, by_tensor: Dict[torch.Tensor, object]) -> Dict[torch.Tensor, object]:
    """``by_tensor`` (keyed by canonical tensors) keyed by the tensors ``module`` holds now."""
    mapping = _canonical_by_live(module)
    if mapping is None:
        return by_tensor
    back = {id(canonical): live_id for live_id, canonical in mapping.items()}
    live = {id(t): t for t in module._parameters.values() if t is not None}
    return {live[back[id(t)]] if id(t) in back else t: v for t, v in by_tensor.items()}


def trainable(param) -> bool:
    """True for a parameter that exists and requires a gradient."""
    return param is not None and param.requires_grad


def own_parameters(module: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    """``(name, param)`` of the parameters owned directly by ``module``, as
    ``module.named_parameters(recurse=False)`` lists them (each once, ``None`` entries left out),
    read from the module's own table: called by the hooks at every layer call, where the
    generator machinery of ``named_parameters`` cost more than the lookup itself."""
    result, seen = [], set()
    table = _CANONICAL.get(module) if _CANONICAL else None
    items = module._parameters.items() if table is None else \
        ((n, table.get(n, p)) for n, p in module._parameters.items())
    for name, p in items:
        if p is not None and id(p) not in seen:
            seen.add(id(p))
            result.append((name, p))
    return result


def own_tensors(module: nn.Module) -> List[nn.Parameter]:
    """The parameters of :func:`own_parameters`, without their names."""
    return [p for _, p in own_parameters(module)]


def has_trainable_parameters(module: nn.Module) -> bool:
    """True when ``module`` directly owns a parameter with ``requires_grad``."""
    return any(p is not None and p.requires_grad for p in module._parameters.values())


def trains_anything(module: nn.Module) -> bool:
    """True when ``module`` or one of its submodules has a parameter with ``requires_grad``."""
    return any(p.requires_grad for p in module.parameters())
