"""Exceptions raised by opacus_dp."""


class PrivacyBudgetExceededError(RuntimeError):
    """Raised *before* a step whose privacy cost would push ε above the configured budget.

    No parameter, accountant record or sampler state is changed by the refused step; the
    refused logical batch (with any pieces accumulated before it) is dropped, never merged
    into the next step.
    """


class UnsupportedError(ValueError):
    """A component cannot be used privately (Opacus 1.x's base class of the validation errors)."""


class UnsupportedModuleError(UnsupportedError):
    """A module cannot be trained privately as it is (see ``ModuleValidator.fix``)."""
