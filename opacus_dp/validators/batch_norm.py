"""Opacus 1.x's import path ``opacus.validators.batch_norm`` (re-exports only): validate / fix a
BatchNorm (fixed: GroupNorm, or InstanceNorm; :mod:`opacus_dp.compat.layer_validators`)."""

from opacus_dp.compat.layer_validators import BATCHNORM, INSTANCENORM
from opacus_dp.compat.layer_validators import fix_batch_norm as fix
from opacus_dp.compat.layer_validators import validate_batch_norm as validate

__all__ = ["BATCHNORM", "INSTANCENORM", "fix", "validate"]
