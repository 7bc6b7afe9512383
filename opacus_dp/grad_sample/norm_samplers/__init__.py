"""Per-layer functions of the norms-only modes (``ghost`` / ``bk``).

Importing this package registers, for ``nn.Linear`` (and ``BatchFirstLinear``),
``nn.Conv1d/2d/3d``, ``nn.Embedding`` and ``nn.EmbeddingBag``, a norm sampler
(:func:`~opacus_dp.grad_sample.registry.register_norm_sampler`) and the matching
:class:`~opacus_dp.grad_sample.norm_samplers.table.GhostLayer` functions.
"""

from opacus_dp.grad_sample.norm_samplers import conv, embedding, embedding_bag, linear  # noqa: F401
from opacus_dp.grad_sample.norm_samplers.table import GHOST_LAYERS, GhostLayer, register_ghost_layer

__all__ = ["GHOST_LAYERS", "GhostLayer", "register_ghost_layer"]

from opacus_dp.submodules import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)  # sub-modules as attributes, as in Opacus
