"""Loading a script of ``scripts/`` as a module, for the tests of the benchmark and tool scripts."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(file_name: str, module_name: str) -> ModuleType:
    """``scripts/<file_name>`` executed as a fresh module named ``module_name``; ``scripts/`` is put
    on ``sys.path`` first, as running the script does, so that it finds its sibling modules."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(module_name, SCRIPTS / file_name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
