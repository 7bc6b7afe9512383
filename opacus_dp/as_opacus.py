"""``python -m opacus_dp.as_opacus script.py [args...]`` (or ``-m module [args...]``): run a script
unchanged with opacus_dp standing in for ``opacus`` (:func:`opacus_dp.install_as_opacus`).

``sys.argv`` is what the script would see if run directly, and ``sys.path[0]`` its directory.
"""

import os
import runpy
import sys

from opacus_dp.integrations import install_as_opacus

USAGE = ("usage: python -m opacus_dp.as_opacus script.py [args...]\n"
         "       python -m opacus_dp.as_opacus -m module [args...]")


def main(argv=None) -> None:
    """Install the alias, then run the script (or module) as ``__main__``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        print(USAGE, file=sys.stderr)
        raise SystemExit(0 if argv[:1] in (["-h"], ["--help"]) else 2)
    install_as_opacus()
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
