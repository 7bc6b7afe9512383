"""Opacus 1.x's import path ``opacus.validators.instance_norm`` (re-exports only): validate / fix
an InstanceNorm (fixed: without running statistics; :mod:`opacus_dp.compat.layer_validators`)."""

from opacus_dp.compat.layer_validators import INSTANCENORM
from opacus_dp.compat.layer_validators import fix_instance_norm as fix
from opacus_dp.compat.layer_validators import validate_instance_norm as validate

__all__ = ["INSTANCENORM", "fix", "validate"]
