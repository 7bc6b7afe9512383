"""Layer types of optional libraries (Hugging Face ``transformers``), registered once loaded.

``opacus_dp`` does not depend on such a library, and importing one only to register its layer
types would cost every user that time (``transformers``: about half a second). A model holding
one of its layers has loaded the library's module already, so a *loader* (a function registering
the module's types from the loaded module) is declared per module name with :func:`add_loader`
and runs once: at once if the module is loaded, else at the first look-up of one of the module's
types in a registry table. The registries (``GRAD_SAMPLERS``, ``NORM_RULES``) are
:class:`LayerTable`s, whose look-ups (``get``, ``in``, ``[]``) of a missing type ask for its loader.
"""

import sys
from types import ModuleType
from typing import Callable, Dict

_LOADERS: Dict[str, Callable[[ModuleType], None]] = {}


def add_loader(module_name: str, loader: Callable[[ModuleType], None]) -> None:
    """``loader(module)`` registers the layer types of module ``module_name``: now if the module
    is loaded, else when a type of it is first looked up in a :class:`LayerTable`."""
    module = sys.modules.get(module_name)
    if module is not None:
        loader(module)
    else:
        _LOADERS[module_name] = loader


def load_for(layer_type) -> bool:
    """Run the loader of ``layer_type``'s module, if one waits and the module is loaded."""
    name = getattr(layer_type, "__module__", None)
    if name not in _LOADERS or sys.modules.get(name) is None:
        return False
    _LOADERS.pop(name)(sys.modules[name])
    return True


class LayerTable(dict):
    """``{layer type: entry}``; a missing type is looked up again after its module's loader ran."""

    def __missing__(self, layer_type):
        if load_for(layer_type) and dict.__contains__(self, layer_type):
            return dict.__getitem__(self, layer_type)
        raise KeyError(layer_type)

    def get(self, layer_type, default=None):
        if not dict.__contains__(self, layer_type):
            load_for(layer_type)
        return dict.get(self, layer_type, default)

    def __contains__(self, layer_type) -> bool:
        return dict.__contains__(self, layer_type) or (load_for(layer_type) and dict.__contains__(self, layer_type))
