"""One-line notices of the examples on stderr (what Python's warning display would print with a
source path, once per process of a ``torchrun`` job).

The library reminds, with a ``SecureModeNotice`` (a ``UserWarning``) at each engine it builds, that ``secure_mode`` is off.
In the examples that reminder becomes one line naming the flag that turns it on
(``--secure-rng``), printed by the main process only; every other warning is issued unchanged.
"""

import sys
import warnings
from contextlib import contextmanager
from typing import Iterator

from opacus_dp.engine.private_step import SecureModeNotice

SECURE_MODE_NOTE = ("note: secure_mode is off: noise and sampling come from seeded generators, fine for "
                    "experiments; pass --secure-rng for a model you release")


def say_error(message: str, show: bool = True) -> None:
    """Print ``message`` on stderr (when ``show``: the main process)."""
    if show:
        print(message, file=sys.stderr, flush=True)


@contextmanager
def engine_notices(show: bool, note: str = SECURE_MODE_NOTE) -> Iterator[None]:
    """Around building a privacy engine: its secure-mode reminder becomes ``note`` on stderr
    (once, and only where ``show``); other warnings are re-issued as they came (module doc)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    noted = False
    for warning in caught:
        if issubclass(warning.category, SecureModeNotice):
            if not noted:
                say_error(note, show)
            noted = True
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno,
                                   source=warning.source)
