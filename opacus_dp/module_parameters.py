"""Which parameters a module owns and trains. A leaf module.

"Owns" means the module's own parameter table (``named_parameters(recurse=False)``), read
directly: the hooks call these at every layer call.
"""

from typing import List, Tuple

import torch.nn as nn


def trainable(param) -> bool:
    """True for a parameter that exists and requires a gradient."""
    return param is not None and param.requires_grad


def own_parameters(module: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    """``(name, param)`` of the parameters owned directly by ``module``, as
    ``module.named_parameters(recurse=False)`` lists them (each once, ``None`` entries left out),
    read from the module's own table: called by the hooks at every layer call, where the
    generator machinery of ``named_parameters`` cost more than the lookup itself."""
    result, seen = [], set()
    for name, p in module._parameters.items():
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
