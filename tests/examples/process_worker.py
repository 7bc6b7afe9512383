"""One process of a multi-process example test: runs several example scripts in sequence.

Started by :func:`tests.examples.example_runs.run_in_processes` with torchrun's environment
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR) and one JSON argument
``{"examples": dir, "runs": [{"name", "argv", "port", "log"}, ...]}``. Each run gets its own
MASTER_PORT, so each example sets up and tears down its own gloo process group. Running
several examples in one interpreter pays torch's import cost once.
"""

import contextlib
import importlib.util
import json
import os
import sys


def run_example(examples: str, name: str, argv, log_path: str) -> int:
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(examples, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with open(log_path, "w", encoding="utf-8") as log, contextlib.redirect_stdout(log):
        return module.main(argv) or 0


def main() -> int:
    plan = json.loads(sys.argv[1])
    sys.path.insert(0, plan["examples"])
    for run in plan["runs"]:
        os.environ["MASTER_PORT"] = str(run["port"])
        code = run_example(plan["examples"], run["name"], run["argv"], run["log"])
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
