"""State-dict key aliases for modules that keep their parameters in submodules.

The DP layers hold every weight inside a small ``nn.Linear``-like submodule (so that
per-sample gradients come from the Linear sampler) but must read and write the flat
keys of the equivalent torch module, e.g. ``l0.weight_ih`` <-> ``weight_ih_l0``.

``StateDictAliasMixin`` does that with two hooks and nothing else:

* after ``state_dict()`` has collected ``prefix + internal`` keys, they are renamed to
  ``prefix + external`` (re-inserted in the order of :meth:`state_dict_aliases`, which the
  subclasses choose to be torch's order);
* before ``load_state_dict()`` distributes keys to the submodules, ``prefix + external``
  keys are renamed back to ``prefix + internal``. Internal keys are accepted as they are.
  Missing or unexpected keys are reported under their external names.

Parameters stay registered once, in their submodule: ``parameters()`` yields each tensor
once and no module owns a parameter it does not compute. ``__getattr__`` additionally
resolves an external name (``lstm.weight_ih_l0``) to the parameter it aliases.
The hooks are module-level functions, so modules stay picklable and deep-copyable.
"""

import functools
from typing import List, Tuple

import torch.nn as nn


def _save_external_names(module, state_dict, prefix, local_metadata):
    """Post-hook of ``state_dict``: internal keys -> external keys (in alias order)."""
    for internal, external in module.state_dict_aliases():
        key = prefix + internal
        if key in state_dict:
            state_dict[prefix + external] = state_dict.pop(key)


def _load_external_names(
    module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
):
    """Pre-hook of ``load_state_dict``: external keys -> internal keys."""
    module.__dict__["_alias_load_prefix"] = prefix
    for internal, external in module.state_dict_aliases():
        key = prefix + external
        if key in state_dict:
            state_dict[prefix + internal] = state_dict.pop(key)


def report_external_names(module, incompatible_keys, renames) -> None:
    """Post-hook body of ``load_state_dict``: report missing/unexpected keys by their
    external names. ``renames`` is ``[(internal, external), ...]`` relative to ``module``;
    the prefix was recorded by the pre-hook (and is removed here)."""
    prefix = module.__dict__.pop("_alias_load_prefix", None)
    if prefix is None:
        return
    table = {prefix + internal: prefix + external for internal, external in renames}
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        renamed = []
        for key in keys:
            key = table.get(key, key)
            if key not in renamed:
                renamed.append(key)
        keys[:] = renamed


def _report_external_names(module, incompatible_keys):
    report_external_names(module, incompatible_keys, module.state_dict_aliases())


class StateDictAliasMixin:
    """Mixin for ``nn.Module`` subclasses whose state-dict keys are aliases of inner keys.

    Subclasses call :meth:`_install_state_dict_aliases` once, at the end of ``__init__``,
    with ``[(internal_key, external_key), ...]`` relative to the module, in saving order.
    """

    def _install_state_dict_aliases(self, aliases: List[Tuple[str, str]]) -> None:
        self.__dict__["_state_dict_alias_table"] = tuple(aliases)
        self.register_state_dict_post_hook(_save_external_names)
        self.register_load_state_dict_pre_hook(_load_external_names)
        self.register_load_state_dict_post_hook(_report_external_names)

    def state_dict_aliases(self) -> Tuple[Tuple[str, str], ...]:
        """``((internal_key, external_key), ...)`` of this module, in saving order."""
        return self.__dict__.get("_state_dict_alias_table", ())

    def __getattr__(self, name: str):
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            for internal, external in self.state_dict_aliases():
                if external == name:
                    return functools.reduce(getattr, internal.split("."), self)
            raise
