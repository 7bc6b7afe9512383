"""Per-layer functions of the norms-only modes (``ghost`` / ``bk``).

Importing this package registers, for ``nn.Linear`` (and ``BatchFirstLinear``),
``nn.Conv1d/2d/3d``, ``nn.Embedding`` and ``nn.EmbeddingBag``, a norm sampler
and the other functions of its
:class:`~opacus_dp.grad_sample.bookkeeping.norm_rules.NormRule`.
"""

from opacus_dp.grad_sample.bookkeeping.norm_samplers import conv, embedding, embedding_bag, linear  # noqa: F401
from opacus_dp.grad_sample.bookkeeping.norm_rules import NORM_RULES, NormRule, register_norm_rule

__all__ = ["NORM_RULES", "NormRule", "register_norm_rule"]

from opacus_dp.submodules import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)  # sub-modules as attributes, as in Opacus
