"""Errors reported by ``ModuleValidator`` (class names as in Opacus 1.x, plus the 0.x one)."""

from typing import List, Sequence

from opacus_dp.errors import UnsupportedError, UnsupportedModuleError  # noqa: F401  (Opacus 1.x path)


class UnsupportableModuleError(UnsupportedModuleError):
    """The module can never be trained privately as such."""


class NotYetSupportedModuleError(UnsupportedModuleError):
    """The module is not supported in its current form."""


class ShouldReplaceModuleError(UnsupportedModuleError):
    """The module is supported through a replacement (``ModuleValidator.fix``)."""


class IllegalModuleConfigurationError(UnsupportedModuleError):
    """The module (or model) is configured in a way that breaks the privacy guarantee."""


class IncompatibleModuleException(UnsupportedModuleError):
    """Raised by the classic ``DPModelInspector``; lists every violation (``.errors``)."""


def combined_error(errors: Sequence[UnsupportedModuleError], cls=UnsupportedModuleError) -> UnsupportedModuleError:
    """One exception of class ``cls`` whose message lists all ``errors`` (kept in ``.errors``)."""
    lines: List[str] = [f"  - {error}" for error in errors]
    combined = cls(f"{len(errors)} module(s) cannot be trained privately:\n" + "\n".join(lines))
    combined.errors = list(errors)
    return combined
