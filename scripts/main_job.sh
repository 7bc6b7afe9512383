#!/usr/bin/env bash
# The main job: a private (DP-SGD) training run on scikit-learn's handwritten digits, a real
# dataset shipped inside the installed scikit-learn package (no download): examples/quickstart.py.
# Creates ./.venv (if absent) with the package and its example extras; the install is skipped
# when nothing it depends on changed, and pip's output is shown only if it fails
# (see scripts/ensure_venv.sh). Extra arguments go to the quickstart (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ensure_venv.sh "examples"
exec "$VENV/bin/python" examples/quickstart.py "$@"
