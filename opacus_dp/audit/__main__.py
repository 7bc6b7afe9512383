"""``python -m opacus_dp.audit``: see :mod:`opacus_dp.audit.cli`."""

import sys

from opacus_dp.audit.cli import main

sys.exit(main())
