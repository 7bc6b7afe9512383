"""The warning class of the data package (a leaf module: samplers and checks both raise it)."""


class SamplingWarning(UserWarning):
    """The loader's sampling differs from the Poisson sampling the accountant assumes."""
