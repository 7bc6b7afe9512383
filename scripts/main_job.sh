#!/usr/bin/env bash
# The main job: a private (DP-SGD) training run on scikit-learn's handwritten digits,
# a real dataset shipped inside the installed scikit-learn package (no download).
# Creates ./.venv (if absent) with the package and its example extras.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ensure_venv.sh "examples"
exec "$VENV/bin/python" examples/quickstart.py "$@"
